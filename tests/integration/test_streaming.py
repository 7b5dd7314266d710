"""Streaming through the same servers in one process (LocalMesh): order, windows, AR
batching, cancel, flow control."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from omnirail.client.sdk import AsyncClient, Chunk, Client
from omnirail.testing.local_mesh import LocalMesh
from omnirail.wire.errors import Code, OmniError
from tests.integration.conftest import (
    collect_stream,
    shm_names,
    start_local,
    wait_nothing_in_flight,
)


@pytest.fixture(scope="module")
def streaming_mesh() -> Iterator[LocalMesh]:
    mesh = start_local("streaming")
    yield mesh
    mesh.stop()
    assert shm_names(mesh.shm_prefix) == [], "shared memory left after shutdown"


def _windows(n: int, window: int, hop: int) -> list[tuple[list[float], bool]]:
    """What the vocoder should emit for n chunks: full windows, then one final flush."""
    out, pending, uncovered = [], [], 0
    for i in range(n):
        pending.append(float(i))
        uncovered += 1
        if len(pending) == window:
            out.append((list(pending), False))
            pending, uncovered = pending[hop:], 0
    if uncovered:
        out.append((pending, True))
    return out


def test_chunks_reach_the_client_in_order_through_three_stages(streaming_mesh: LocalMesh) -> None:
    with Client(streaming_mesh.address or "", timeout=60) as client:
        chunks, result = collect_stream(client.stream({"n": 9}))
    expected = _windows(9, 4, 2)
    assert [c.chunk_id for c in chunks] == list(range(len(expected)))
    assert {c.stage for c in chunks} == {"vocoder"}
    assert {c.modality for c in chunks} == {"audio"}
    assert [(c.data["ids"], c.data["final"]) for c in chunks] == expected
    assert result.outputs["thinker"]["tokens"] == 9
    assert result.outputs["talker"] == {"chunks": 9, "windows": 9}
    assert result.outputs["vocoder"]["chunks"] == 9
    assert result.outputs["vocoder"]["windows"] == len(expected)


@pytest.mark.parametrize("n", [1, 4, 5])
def test_window_edges(streaming_mesh: LocalMesh, n: int) -> None:
    with Client(streaming_mesh.address or "", timeout=60) as client:
        chunks, _ = collect_stream(client.stream({"n": n}))
    assert [(c.data["ids"], c.data["final"]) for c in chunks] == _windows(n, 4, 2)


def test_relayed_chunks(streaming_mesh: LocalMesh) -> None:
    """Chunks above the inline bound travel through shared memory on every edge."""
    with Client(streaming_mesh.address or "", timeout=60) as client:
        chunks, result = collect_stream(client.stream({"n": 12, "chunk_bytes": 256 << 10}))
    assert [(c.data["ids"], c.data["final"]) for c in chunks] == _windows(12, 4, 2)
    assert result.outputs["vocoder"]["chunks"] == 12


def test_32_concurrent_streams_are_complete_and_ordered(streaming_mesh: LocalMesh) -> None:
    async def one(client: AsyncClient, i: int) -> None:
        n = 6 + i % 7
        chunks: list[Chunk] = []
        result = None
        async for event in client.stream({"n": n, "step_ms": 2}, request_id=f"c32-{i}"):
            if isinstance(event, Chunk):
                chunks.append(event)
            else:
                result = event
        assert result is not None and result.request_id == f"c32-{i}"
        assert [(c.data["ids"], c.data["final"]) for c in chunks] == _windows(n, 4, 2)
        assert [c.chunk_id for c in chunks] == list(range(len(chunks)))

    async def main() -> None:
        async with AsyncClient(streaming_mesh.address or "", timeout=120) as client:
            await asyncio.gather(*(one(client, i) for i in range(32)))

    asyncio.run(main())


def test_ar_requests_join_and_leave_the_running_batch(streaming_mesh: LocalMesh) -> None:
    with Client(streaming_mesh.address or "", timeout=60) as client:
        long_events = client.stream({"n": 60, "step_ms": 10}, request_id="ar-long")
        first = next(long_events)  # the long request is running
        assert isinstance(first, Chunk)
        _, short = collect_stream(client.stream({"n": 3, "step_ms": 10}, request_id="ar-short"))
        _, long = collect_stream(long_events)
    lo, sh = long.outputs["thinker"], short.outputs["thinker"]
    assert (lo["tokens"], sh["tokens"]) == (60, 3)
    # The short one joined after the long one started and left before it ended.
    assert lo["joined_at"] < sh["joined_at"] <= sh["left_at"] < lo["left_at"]
    assert lo["max_batch"] == 2 and sh["max_batch"] == 2


def test_scheduler_error_mid_stream_fails_only_that_request(streaming_mesh: LocalMesh) -> None:
    results: dict[str, Any] = {}

    def run(rid: str, inputs: dict[str, Any]) -> None:
        with Client(streaming_mesh.address or "", timeout=60) as client:
            try:
                results[rid] = collect_stream(client.stream(inputs, request_id=rid))
            except OmniError as exc:
                results[rid] = exc

    threads = [
        threading.Thread(target=run, args=("poisoned", {"n": 40, "poison_at": 6, "step_ms": 5})),
        threading.Thread(target=run, args=("healthy", {"n": 40, "step_ms": 5})),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    err = results["poisoned"]
    assert isinstance(err, OmniError), err
    assert err.code == Code.INTERNAL and err.stage == "vocoder"
    assert "poisoned chunk" in err.message
    chunks, result = results["healthy"]
    assert result.outputs["thinker"]["tokens"] == 40
    assert [(c.data["ids"], c.data["final"]) for c in chunks] == _windows(40, 4, 2)


def test_abort_mid_stream_ends_the_stream_with_cancelled(streaming_mesh: LocalMesh) -> None:
    with Client(streaming_mesh.address or "", timeout=60) as client:
        events = client.stream({"n": 500, "step_ms": 10}, request_id="to-abort")
        assert isinstance(next(events), Chunk)
        ended = []

        def read_rest() -> None:
            try:
                for _ in events:
                    pass
            except OmniError as exc:
                ended.append((time.monotonic(), exc))

        reader = threading.Thread(target=read_rest)
        reader.start()
        t0 = time.monotonic()
        acked = client.abort("to-abort", "test abort")
        reader.join(30)
        assert ended, "the stream did not end"
        t_end, exc = ended[0]
        assert exc.code == Code.CANCELLED
        assert t_end - t0 < 5.0  # the benchmark reports the real figure; this must not flake
        assert {a.split("/")[0] for a in acked.acknowledged} == {"thinker", "talker", "vocoder"}
        assert client.status("to-abort").state == "aborted"
        # Nothing leaked on any edge: a full round of streams still gets through.
        chunks, _ = collect_stream(client.stream({"n": 9, "chunk_bytes": 128 << 10}))
        assert len(chunks) == len(_windows(9, 4, 2))


def test_client_closing_its_stream_aborts_the_request_everywhere(streaming_mesh: LocalMesh) -> None:
    with Client(streaming_mesh.address or "", timeout=60) as client:
        events = client.stream({"n": 500, "step_ms": 10}, request_id="walk-away")
        assert isinstance(next(events), Chunk)
        events.close()  # what `break` out of the loop does
        deadline = time.monotonic() + 10
        while client.status("walk-away").state != "aborted":
            assert time.monotonic() < deadline, client.status("walk-away")
            time.sleep(0.02)
        # Every stage dropped it: no replica reports work in flight once loads refresh.
        wait_nothing_in_flight(client)


def _stage_address(client: Client, stage: str) -> str:
    return next(s.replicas[0].address for s in client.describe().stages if s.name == stage)


def _deliver(address: str, items: list[Any], metadata: Any) -> None:
    import grpc

    from omnirail.v1 import mesh_pb2, mesh_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        call = mesh_pb2_grpc.StageStub(channel).Deliver(
            iter([mesh_pb2.DeliverBatch(sender="test", items=items)]),
            timeout=10,
            metadata=metadata,
        )
        try:
            for _ in call:
                pass
        except grpc.RpcError:
            pass


@pytest.mark.parametrize(
    ("source", "signal", "message"),
    [
        ("thinker", {"chunk_id": 10_000}, "out of order"),
        ("thinker", {"chunk_id": 0}, "out of order or a duplicate"),
        ("thinker", {"chunk_id": 3, "done": True}, "ended after 3 chunks"),
        ("vocoder", {"chunk_id": 0}, "does not list 'talker' in stream_to"),
    ],
    ids=["gap", "duplicate", "short-done", "not-in-stream_to"],
)
def test_bad_stream_items_fail_that_request_only(
    streaming_mesh: LocalMesh, source: str, signal: dict[str, Any], message: str
) -> None:
    from omnirail.v1 import mesh_pb2
    from omnirail.wire.payload import encode_inline

    tag = uuid.uuid4().hex[:8]
    with Client(streaming_mesh.address or "", timeout=60) as client:
        healthy = client.stream({"n": 150, "step_ms": 10}, request_id=f"ok-{tag}")
        victim = client.stream({"n": 150, "step_ms": 10}, request_id=f"bad-{tag}")
        assert isinstance(next(victim), Chunk)  # its stream is running through the talker
        item = mesh_pb2.DeliverItem(
            request_id=f"bad-{tag}",
            from_stage=source,
            to_stage="talker",
            stream=mesh_pb2.StreamSignal(**signal),
        )
        if not signal.get("done"):
            item.payload.CopyFrom(encode_inline(torch.zeros(1)))
        # Shown as the process of `source` (in this process: LocalMesh), as a stage of it
        # would send: a stranger's stream is refused before any item is looked at.
        (host,) = [h for h in streaming_mesh.hosts.values() if source in h.stage_names]
        creds = host.credentials()
        assert creds is not None
        _deliver(_stage_address(client, "talker"), [item], creds.metadata())
        with pytest.raises(OmniError) as info:
            for _ in victim:
                pass
        assert info.value.code == Code.INVALID_ARGUMENT
        assert info.value.stage == "talker" and message in info.value.message
        chunks, result = collect_stream(healthy)
        assert result.outputs["thinker"]["tokens"] == 150
        assert len(chunks) == len(_windows(150, 4, 2))


def test_generate_rpc_streams_chunks_then_result_and_cancel_aborts(
    streaming_mesh: LocalMesh,
) -> None:
    """The plain server-streaming RPC (what grpcurl uses), without the SDK's Session."""
    import grpc

    from omnirail.client.sdk import build_request, parse_chunk
    from omnirail.v1 import client_pb2_grpc
    from omnirail.wire.payload import decode_inline

    with grpc.insecure_channel(streaming_mesh.address or "") as channel:
        stub = client_pb2_grpc.OmnirailStub(channel)
        request = build_request({"n": 6}, "rpc-stream", 60, None, stream=True)
        events = list(stub.Generate(request, timeout=60))
        chunks = [parse_chunk("rpc-stream", e.chunk) for e in events[:-1]]
        assert all(e.HasField("chunk") for e in events[:-1]) and events[-1].HasField("result")
        assert [(c.data["ids"], c.data["final"]) for c in chunks] == _windows(6, 4, 2)
        vocoder = decode_inline(events[-1].result.outputs["vocoder"])
        assert vocoder["chunks"] == 6

        # Without `stream`, only the result comes back.
        plain = build_request({"n": 6}, "rpc-plain", 60, None)
        [only] = list(stub.Generate(plain, timeout=60))
        assert only.HasField("result")

        # Cancelling the call aborts the request on every stage.
        call = stub.Generate(
            build_request({"n": 500, "step_ms": 10}, "rpc-cancel", 60, None, stream=True),
            timeout=60,
        )
        assert next(call).HasField("chunk")
        call.cancel()
    with Client(streaming_mesh.address or "", timeout=30) as client:
        deadline = time.monotonic() + 10
        while client.status("rpc-cancel").state != "aborted":
            assert time.monotonic() < deadline, client.status("rpc-cancel")
            time.sleep(0.02)


def test_closing_the_async_client_ends_the_streams_being_read(streaming_mesh: LocalMesh) -> None:
    """`AsyncClient.close()` while streams are read: each ends at once with CANCELLED (it
    used to wait for its timeout, then say DEADLINE_EXCEEDED)."""

    async def main() -> list[BaseException | None]:
        client = AsyncClient(streaming_mesh.address or "", timeout=120)
        started = asyncio.Event()
        firsts = 0

        async def read(i: int) -> BaseException | None:
            nonlocal firsts
            try:
                async for event in client.stream({"n": 500, "step_ms": 10}, request_id=f"cl-{i}"):
                    if isinstance(event, Chunk) and event.chunk_id == 0:
                        firsts += 1
                        if firsts == 4:
                            started.set()
            except OmniError as exc:
                return exc
            return None

        readers = [asyncio.create_task(read(i)) for i in range(4)]
        await asyncio.wait_for(started.wait(), 60)
        t0 = time.monotonic()
        await client.close()
        ended = await asyncio.wait_for(asyncio.gather(*readers), 10)
        assert time.monotonic() - t0 < 5
        return ended

    ended = asyncio.run(main())
    assert len(ended) == 4
    assert all(isinstance(e, OmniError) and e.code == Code.CANCELLED for e in ended), ended
    # The mesh aborts what the closed session had running; a new client is served.
    with Client(streaming_mesh.address or "", timeout=60) as client:
        chunks, _ = collect_stream(client.stream({"n": 9}))
    assert len(chunks) == len(_windows(9, 4, 2))


def test_closing_the_blocking_client_ends_the_streams_being_read(streaming_mesh: LocalMesh) -> None:
    """`Client.close()` from one thread while 4 others read streams: all 4 end at once
    with CANCELLED, and the mesh aborts their requests."""
    client = Client(streaming_mesh.address or "", timeout=120)
    started = threading.Barrier(5)
    ended: list[BaseException | None] = []

    def read(i: int) -> None:
        first = True
        try:
            for event in client.stream({"n": 500, "step_ms": 10}, request_id=f"scl-{i}"):
                if first and isinstance(event, Chunk):
                    first = False
                    started.wait(60)
        except OmniError as exc:
            ended.append(exc)
            return
        ended.append(None)

    readers = [threading.Thread(target=read, args=(i,)) for i in range(4)]
    for t in readers:
        t.start()
    started.wait(60)
    t0 = time.monotonic()
    client.close()
    for t in readers:
        t.join(10)
    assert time.monotonic() - t0 < 5 and len(ended) == 4, ended
    assert all(isinstance(e, OmniError) and e.code == Code.CANCELLED for e in ended), ended
    with Client(streaming_mesh.address or "", timeout=30) as fresh:
        deadline = time.monotonic() + 10
        while {fresh.status(f"scl-{i}").state for i in range(4)} != {"aborted"}:
            assert time.monotonic() < deadline
            time.sleep(0.05)
