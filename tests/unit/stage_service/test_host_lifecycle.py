"""The stage host's part of a request's life, on a LocalMesh (the real `StageHost` and
coordinator in this process): start-up and registration, fan-in state, aborts and
deadlines reaching the stage, and what the other hosts learn when one goes.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest

from omnirail.config import PipelineConfig
from omnirail.testing.local_mesh import LocalMesh
from omnirail.wire.errors import Code, OmniError
from tests.unit.local_stages import CALLS, gate, stage

WAIT_S = 20.0  # only reached when something is broken


def pipeline(*stages: dict[str, Any]) -> PipelineConfig:
    return PipelineConfig.from_dict(
        {"name": "host-lifecycle", "abort_ack_timeout_s": 5, "stages": list(stages)}
    )


FAN = pipeline(
    stage("a", next=["b", "c"]),
    stage("b", next="d"),
    stage("c", next="d"),
    stage("d", wait_for=["b", "c"], merge_fn="tests.unit.local_stages:merge_paths", terminal=True),
)


async def until(check: Any, what: str) -> None:
    for _ in range(int(WAIT_S / 0.02)):
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting until {what}")


async def test_a_host_registers_each_stage_it_holds() -> None:
    both = pipeline(stage("a", next="b", process="ab"), stage("b", process="ab", terminal=True))
    async with LocalMesh(both) as mesh:
        (host,) = mesh.hosts.values()
        registry = mesh.coordinator.registry
        for name in ("a", "b"):
            (replica,) = registry.replicas(name)
            assert replica.replica_id == host.replica_id
            assert replica.address.startswith("unix://")
        async with mesh.async_client(timeout=WAIT_S) as client:
            # Between stages of one host, items go by reference (no gRPC, no relay).
            assert (await client.generate({})).output["path"] == ["a", "b"]


async def test_a_factory_that_fails_stops_start_up_and_leaves_nothing(tmp_path: Path) -> None:
    broken = pipeline(
        stage("a", next="b"),
        {
            "name": "b",
            "factory": "tests.unit.local_stages:make_broken",
            "factory_args": {"why": "no weights in /nowhere"},
            "terminal": True,
        },
    )
    mesh = LocalMesh(broken, run_dir=tmp_path / "run")
    with pytest.raises(RuntimeError, match="no weights in /nowhere"):
        await mesh.astart()
    assert mesh.hosts == {} and mesh.coordinator is None
    assert list((tmp_path / "run").iterdir()) == []  # every socket closed and removed


async def test_fan_in_holds_the_first_branch_until_the_second_arrives() -> None:
    async with LocalMesh(FAN) as mesh, mesh.async_client(timeout=WAIT_S) as client:
        d = mesh.hosts["stage-d"].stages["d"]
        key = uuid.uuid4().hex
        held = gate(key)
        call = asyncio.create_task(client.generate({"hold": {"b": key}}))
        assert await asyncio.to_thread(held.entered.wait, WAIT_S)
        await until(lambda: d.inflight == 1, "c's payload waits at d")
        held.release.set()
        await call
        assert d.inflight == 0


async def test_a_failed_branch_fails_the_request_and_drops_the_fan_in_state() -> None:
    async with LocalMesh(FAN) as mesh, mesh.async_client(timeout=WAIT_S) as client:
        d = mesh.hosts["stage-d"].stages["d"]
        key = uuid.uuid4().hex
        held = gate(key)
        tag = uuid.uuid4().hex
        call = asyncio.create_task(client.generate({"hold": {"b": key}, "fail": "c", "tag": tag}))
        with pytest.raises(OmniError) as err:
            await call
        assert err.value.stage == "c" and "c was asked to fail" in err.value.message
        held.release.set()
        await until(lambda: d.inflight == 0, "d forgets the failed request")
        await asyncio.sleep(0.1)
        assert ("d", tag) not in CALLS  # b's late payload started nothing at d


async def test_an_abort_stops_the_request_at_the_stage_holding_it() -> None:
    line = pipeline(stage("a", next="b"), stage("b", next="c"), stage("c", terminal=True))
    async with LocalMesh(line) as mesh, mesh.async_client(timeout=WAIT_S) as client:
        b = mesh.hosts["stage-b"].stages["b"]
        key, tag = uuid.uuid4().hex, uuid.uuid4().hex
        held = gate(key)
        call = asyncio.create_task(
            client.generate({"hold": {"b": key}, "tag": tag}, request_id=tag)
        )
        assert await asyncio.to_thread(held.entered.wait, WAIT_S)
        assert b.inflight == 1
        await client.abort(tag)
        with pytest.raises(OmniError) as err:
            await call
        assert err.value.code == Code.CANCELLED
        held.release.set()
        await until(lambda: b.inflight == 0, "b drops the aborted request")
        await asyncio.sleep(0.1)
        assert ("c", tag) not in CALLS


async def test_the_other_hosts_stop_routing_to_a_host_that_went() -> None:
    two = pipeline(stage("a", next="b"), stage("b", replicas=2, terminal=True))
    async with LocalMesh(two) as mesh, mesh.async_client(timeout=WAIT_S) as client:
        a_host = mesh.hosts["stage-a"]
        gone = mesh.hosts["stage-b-0"]
        (gone_address,) = [
            r.address
            for r in mesh.coordinator.registry.replicas("b")
            if r.replica_id == gone.replica_id
        ]
        assert gone_address in a_host.router.topology["b"]
        await mesh.stop_process("stage-b-0")
        await until(
            lambda: a_host.router.topology.get("b") == [left_address(mesh)], "a forgets b-0"
        )
        # Every request now goes to the replica that is left.
        for _ in range(8):
            assert (await client.generate({})).output["path"] == ["a", "b"]


def left_address(mesh: LocalMesh) -> str:
    (replica,) = mesh.coordinator.registry.replicas("b")
    return replica.address
