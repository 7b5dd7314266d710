"""The coordinator's request lifecycle, on a LocalMesh (its real servers, in this process):
start, fan-out and fan-in, abort, deadline, and the failover decision when a replica goes.

Stages hold requests at gates (tests/unit/local_stages.py), so each test looks at the
coordinator's request table while a request is known to be at a given stage.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from omnirail.client.sdk import AsyncClient
from omnirail.config import PipelineConfig
from omnirail.coordinator.requests import State
from omnirail.testing.local_mesh import LocalMesh
from omnirail.wire.errors import Code, OmniError
from tests.unit.local_stages import gate, stage

WAIT_S = 20.0  # only reached when something is broken


def pipeline(*stages: dict[str, Any], **settings: Any) -> PipelineConfig:
    return PipelineConfig.from_dict(
        {"name": "lifecycle", "abort_ack_timeout_s": 5, "stages": list(stages), **settings}
    )


LINE = pipeline(stage("a", next="b"), stage("b", next="c"), stage("c", terminal=True))
FAN = pipeline(
    stage("a", next=["b", "c"]),
    stage("b", next="d"),
    stage("c", next="d"),
    stage("d", wait_for=["b", "c"], merge_fn="tests.unit.local_stages:merge_paths", terminal=True),
)


@pytest.fixture
async def line() -> AsyncIterator[tuple[LocalMesh, AsyncClient]]:
    async with LocalMesh(LINE) as mesh, mesh.async_client(timeout=WAIT_S) as client:
        yield mesh, client


async def entered(key: str, gate_: Any) -> None:
    assert await asyncio.to_thread(gate_.entered.wait, WAIT_S), f"nothing reached gate {key}"


def count(mesh: LocalMesh, name: str, **labels: str) -> float:
    return mesh.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_a_request_is_live_while_it_runs_and_forgotten_when_it_ends(line: Any) -> None:
    mesh, client = line
    key = uuid.uuid4().hex
    held = gate(key)
    call = asyncio.create_task(client.generate({"hold": {"b": key}}, request_id="r1"))
    await entered(key, held)
    rec = mesh.coordinator.requests.live["r1"]
    assert rec.state == State.RUNNING
    assert rec.entry.stage == "a" and rec.entry.assigned == 1
    assert rec.terminals == ("c",) and rec.possible == {"a", "b", "c"}
    held.release.set()
    result = await call
    assert result.output["path"] == ["a", "b", "c"]
    assert mesh.coordinator.requests.live == {}
    assert rec.state == State.COMPLETED and rec.entry is None  # no longer counted
    assert count(mesh, "omnirail_requests_total", state="completed") == 1


async def test_fan_out_reaches_both_branches_and_fan_in_merges_once() -> None:
    async with LocalMesh(FAN) as mesh, mesh.async_client(timeout=WAIT_S) as client:
        key = uuid.uuid4().hex
        held = gate(key)
        call = asyncio.create_task(client.generate({"hold": {"b": key}}, request_id="f1"))
        await entered(key, held)
        # c is done and waits at d for b: the request is live at the coordinator.
        assert "f1" in mesh.coordinator.requests.live
        held.release.set()
        out = (await call).output
    assert out["from"] == ["b", "c"]  # merge_fn sees its sources in wait_for order
    assert out["path"] == [["a", "b"], ["a", "c"], "d"]


async def test_an_abort_ends_the_request_and_every_stage_acknowledges(line: Any) -> None:
    mesh, client = line
    key = uuid.uuid4().hex
    held = gate(key)
    call = asyncio.create_task(client.generate({"hold": {"b": key}}, request_id="ab1"))
    await entered(key, held)
    answer = await client.abort("ab1", "test")
    assert answer.not_acknowledged == []
    assert len(answer.acknowledged) == 3  # one replica of each stage
    with pytest.raises(OmniError) as err:
        await call
    assert err.value.code == Code.CANCELLED
    assert mesh.coordinator.requests.live == {}
    assert count(mesh, "omnirail_requests_total", state="aborted") == 1
    held.release.set()
    # What b computes after the abort goes nowhere: c never sees the request.
    await asyncio.sleep(0.2)
    assert all(s.inflight == 0 for h in mesh.hosts.values() for s in h.stages.values())


async def test_a_request_past_its_deadline_fails_and_is_cleaned_up(line: Any) -> None:
    mesh, client = line
    key = uuid.uuid4().hex
    held = gate(key)
    with pytest.raises(OmniError) as err:
        await client.generate({"hold": {"b": key}}, request_id="d1", timeout=0.5)
    assert err.value.code == Code.DEADLINE_EXCEEDED
    assert mesh.coordinator.requests.live == {}
    held.release.set()
    b = mesh.hosts["stage-b"].stages["b"]
    for _ in range(100):
        if b.inflight == 0:
            break
        await asyncio.sleep(0.02)
    assert b.inflight == 0, "the stage kept the expired request"
    # The mesh serves on.
    assert (await client.generate({})).output["path"] == ["a", "b", "c"]


def replicated(retry_safe: bool) -> PipelineConfig:
    return pipeline(
        stage("a", next="b", retry_safe=retry_safe),
        stage("b", next="c", retry_safe=retry_safe, replicas=2),
        stage("c", terminal=True, retry_safe=retry_safe),
    )


async def _lose_the_holding_replica(mesh: LocalMesh, client: AsyncClient) -> Any:
    """Starts a request held at b, stops the b replica holding it; returns the call and
    its gate."""
    key = uuid.uuid4().hex
    held = gate(key)
    call = asyncio.create_task(client.generate({"hold": {"b": key}}, request_id="lost1"))
    await entered(key, held)
    (holder,) = [n for n, h in mesh.hosts.items() if "b" in h.stages and h.stages["b"].inflight]
    held.entered.clear()
    await mesh.stop_process(holder)
    return call, held


async def test_a_retry_safe_request_runs_again_on_another_replica() -> None:
    async with LocalMesh(replicated(True)) as mesh, mesh.async_client(timeout=WAIT_S) as client:
        call, held = await _lose_the_holding_replica(mesh, client)
        await entered("lost1 again", held)  # the new attempt reached the other replica
        held.release.set()
        assert (await call).output["path"] == ["a", "b", "c"]
        assert held.passed == 2
        assert count(mesh, "omnirail_requests_redispatched_total") == 1


async def test_a_request_that_may_not_run_again_fails_naming_the_stage() -> None:
    async with LocalMesh(replicated(False)) as mesh, mesh.async_client(timeout=WAIT_S) as client:
        call, held = await _lose_the_holding_replica(mesh, client)
        with pytest.raises(OmniError) as err:
            await call
        held.release.set()
        assert err.value.code == Code.UNAVAILABLE and err.value.stage == "b"
        assert "replica" in err.value.message
        assert held.passed == 1
        # The other replica serves the next request.
        assert (await client.generate({})).output["path"] == ["a", "b", "c"]
