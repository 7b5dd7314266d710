"""Stages in one process hand each other results in the process (seed 003's local dispatch).

The same pipelines as test_topologies' fan-out and test_streaming's three streaming stages,
with their stages fused into one process (every edge local) or split over two (local and
cross-process edges mixed): the same outputs as one process per stage, no relay spans on
local edges, and fan-in, streaming and aborts behaving as across processes.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from omnirail.client.sdk import AsyncClient, Chunk, Client
from omnirail.ops.launcher import Mesh
from omnirail.wire.errors import Code, OmniError
from tests.integration.conftest import (
    collect_stream,
    shm_names,
    start_mesh,
    wait_nothing_in_flight,
)
from tests.integration.test_streaming import _windows
from tests.otlp_receiver import OtlpReceiver

TRACED = {"OTEL_TRACES_SAMPLER": "always_on", "OTEL_SDK_DISABLED": "false"}


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as rx:
        yield rx


@pytest.fixture(scope="module")
def fanouts(receiver: OtlpReceiver) -> Iterator[dict[str, Mesh]]:
    env = {**TRACED, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}
    meshes: dict[str, Mesh] = {}
    try:
        for name in ("fanout", "fanout_fused", "fanout_mixed"):
            meshes[name] = start_mesh(name, env=env)
        yield meshes
    finally:
        for mesh in meshes.values():
            mesh.stop()
    for mesh in meshes.values():
        assert shm_names(mesh.shm_prefix) == [], "shared memory left after shutdown"


def _run(mesh: Mesh, inputs: dict[str, Any], request_id: str) -> dict[str, Any]:
    with Client(mesh.address or "", timeout=60) as client:
        return client.generate(inputs, request_id=request_id).output


def test_fused_and_mixed_processes_give_what_one_process_per_stage_gives(
    fanouts: dict[str, Mesh],
) -> None:
    # One stage process for the fused pipeline, two for the mixed one (plus the
    # coordinator), four for the plain one.
    assert len(fanouts["fanout"].processes()) == 5
    assert len(fanouts["fanout_fused"].processes()) == 2
    assert len(fanouts["fanout_mixed"].processes()) == 3
    for n in (1, 5, 20000):  # 20000: both projections far over the inline bound (256 B)
        want = _run(fanouts["fanout"], {"n": n}, f"plain-{n}")
        assert want["left_sum"] == n * (n + 1) // 2 and want["right_sum"] == 3.0 * n
        for name in ("fanout_fused", "fanout_mixed"):
            got = _run(fanouts[name], {"n": n}, f"{name}-{n}")
            assert {k: got[k] for k in ("left_sum", "right_sum")} == {
                k: want[k] for k in ("left_sum", "right_sum")
            }, name
            assert sorted(got["order"]) == ["left", "right"]


def test_concurrent_requests_through_local_edges(fanouts: dict[str, Mesh]) -> None:
    async def main(mesh: Mesh) -> list[Any]:
        async with AsyncClient(mesh.address or "", timeout=60) as client:
            return await asyncio.gather(
                *(client.generate({"n": 100 + i}, request_id=f"many-{i}") for i in range(48))
            )

    for name in ("fanout_fused", "fanout_mixed"):
        results = asyncio.run(main(fanouts[name]))
        for i, result in enumerate(results):
            n = 100 + i
            assert result.output["left_sum"] == n * (n + 1) // 2, (name, i)
            assert result.output["right_sum"] == 3.0 * n, (name, i)


def _trace(rx: OtlpReceiver, request_id: str, stages: int) -> list[dict[str, Any]]:
    def ready(spans: list[dict[str, Any]]) -> bool:
        ours = {
            s["trace_id"] for s in spans if s["attributes"].get("omnirail.request_id") == request_id
        }
        return (
            len([s for s in spans if s["trace_id"] in ours and s["name"].startswith("stage ")])
            >= stages
        )

    spans = rx.wait_for(ready, timeout=30)
    [trace] = {
        s["trace_id"] for s in spans if s["attributes"].get("omnirail.request_id") == request_id
    }
    return [s for s in spans if s["trace_id"] == trace]


def test_local_edges_have_no_relay_spans(fanouts: dict[str, Mesh], receiver: OtlpReceiver) -> None:
    _run(fanouts["fanout_fused"], {"n": 20000}, "traced-fused")
    _run(fanouts["fanout_mixed"], {"n": 20000}, "traced-mixed")

    fused = _trace(receiver, "traced-fused", 4)
    stage_spans = {s["name"]: s for s in fused if s["name"].startswith("stage ")}
    assert set(stage_spans) == {"stage split", "stage left", "stage right", "stage join"}
    # Each stage keeps its own span, its queue and compute, and fan-in links both producers.
    for span in stage_spans.values():
        children = {c["name"] for c in fused if c["parent_span_id"] == span["span_id"]}
        assert {"queue", "compute"} <= children, (span["name"], children)
    links = {link["span_id"] for link in stage_spans["stage join"]["links"]}
    assert links == {stage_spans["stage left"]["span_id"], stage_spans["stage right"]["span_id"]}
    assert not [s for s in fused if s["name"].startswith("relay.")], "relay span on a local edge"

    # Mixed: relay spans on the cross-process edges only (the inline bound is 256 bytes).
    mixed = _trace(receiver, "traced-mixed", 4)
    edges = sorted(
        (s["name"], s["attributes"]["omnirail.edge"])
        for s in mixed
        if s["name"].startswith("relay.")
    )
    assert edges == [
        ("relay.get", "left->join"),
        ("relay.get", "split->right"),
        ("relay.put", "left->join"),
        ("relay.put", "split->right"),
    ]


def test_fused_linear_stages_equal_separate_processes() -> None:
    """seed 003's fused_stages (a linear run of next edges): one process, same results,
    and a stage's error still names it and leaves the mesh serving."""
    plain, fused = start_mesh("linear"), start_mesh("linear_fused")
    try:
        assert len(fused.processes()) == 2
        with (
            Client(plain.address or "", timeout=60) as a,
            Client(fused.address or "", timeout=60) as b,
        ):
            for n in (4, 3000, 1 << 20):  # inline and far over the 1 KiB inline bound
                want, got = a.generate({"n": n}).output, b.generate({"n": n}).output
                assert (got["sum"], got["n"]) == (want["sum"], want["n"])
            pids = {b.generate({"n": 5}).output["pid"] for _ in range(3)}
            assert pids == {
                fused.processes()[next(k for k in fused.processes() if k != "coordinator")]
            }
            with pytest.raises(OmniError) as info:
                b.generate({"n": 4, "fail": "boom"})
            assert info.value.code == Code.INTERNAL and info.value.stage == "double"
            assert b.generate({"n": 4}).output["sum"] == 12.0
    finally:
        plain.stop()
        fused.stop()


# ---- streaming through local edges ---------------------------------------------------------


@pytest.fixture(scope="module")
def fused_streaming() -> Iterator[Mesh]:
    mesh = start_mesh("streaming_fused")
    yield mesh
    mesh.stop()


def test_local_stream_edges_carry_every_chunk_in_order(fused_streaming: Mesh) -> None:
    assert len(fused_streaming.processes()) == 2
    with Client(fused_streaming.address or "", timeout=60) as client:
        for inputs in ({"n": 9}, {"n": 12, "chunk_bytes": 256 << 10}):
            chunks, result = collect_stream(client.stream(inputs))
            n = inputs["n"]
            assert [(c.data["ids"], c.data["final"]) for c in chunks] == _windows(n, 4, 2)
            assert [c.chunk_id for c in chunks] == list(range(len(chunks)))
            assert result.outputs["thinker"]["tokens"] == n
            assert result.outputs["talker"] == {"chunks": n, "windows": n}
            assert result.outputs["vocoder"]["chunks"] == n


def test_concurrent_local_streams_are_complete_and_ordered(fused_streaming: Mesh) -> None:
    async def one(client: AsyncClient, i: int) -> None:
        n = 6 + i % 7
        chunks: list[Chunk] = []
        async for event in client.stream({"n": n, "step_ms": 2}, request_id=f"local-{i}"):
            if isinstance(event, Chunk):
                chunks.append(event)
        assert [(c.data["ids"], c.data["final"]) for c in chunks] == _windows(n, 4, 2)

    async def main() -> None:
        async with AsyncClient(fused_streaming.address or "", timeout=120) as client:
            await asyncio.gather(*(one(client, i) for i in range(24)))

    asyncio.run(main())


def test_abort_through_local_edges(fused_streaming: Mesh) -> None:
    with Client(fused_streaming.address or "", timeout=60) as client:
        events = client.stream({"n": 500, "step_ms": 10}, request_id="local-abort")
        assert isinstance(next(events), Chunk)
        ended: list[OmniError] = []

        def read_rest() -> None:
            try:
                for _ in events:
                    pass
            except OmniError as exc:
                ended.append(exc)

        reader = threading.Thread(target=read_rest)
        reader.start()
        acked = client.abort("local-abort", "test abort")
        reader.join(30)
        assert ended and ended[0].code == Code.CANCELLED
        assert {a.split("/")[0] for a in acked.acknowledged} == {"thinker", "talker", "vocoder"}
        # Nothing is left in flight at any stage, and the edges still carry a full stream.
        wait_nothing_in_flight(client)
        chunks, _ = collect_stream(client.stream({"n": 9}))
        assert [(c.data["ids"], c.data["final"]) for c in chunks] == _windows(9, 4, 2)


def test_a_failing_stream_fails_only_its_request(fused_streaming: Mesh) -> None:
    with Client(fused_streaming.address or "", timeout=60) as client:
        with pytest.raises(OmniError):
            collect_stream(client.stream({"n": 20, "poison_at": 3}, request_id="local-poison"))
        chunks, result = collect_stream(client.stream({"n": 10}))
        assert len(chunks) == len(_windows(10, 4, 2))
        assert result.outputs["thinker"]["tokens"] == 10
