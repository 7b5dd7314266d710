"""Clients stream input into running requests (`input_stream`), on the in-process mesh.

The entry stage `listen` (tests/integration/inputfns.py) answers each chunk as it takes
it, so a test can see output before its input has ended, a slow stage holding a fast
client back, and what an abort, a deadline or a broken protocol leave behind (nothing).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import grpc
import numpy as np
import pytest

from omnirail.client.sdk import Chunk, GenerateResult
from omnirail.testing.local_mesh import LocalMesh
from omnirail.v1 import client_pb2, client_pb2_grpc
from omnirail.wire.errors import Code, OmniError
from omnirail.wire.payload import encode_inline
from tests.integration.conftest import PIPELINES

CREDITS = 4  # input_stream.credits of the pipeline
CHUNK = 256 << 10  # bytes per chunk in the flow-control test


@pytest.fixture(scope="module")
def mesh() -> Iterator[LocalMesh]:
    with LocalMesh(PIPELINES / "input_stream.yaml", timeout=120) as local:
        yield local


def _stage(mesh: LocalMesh):
    return mesh.hosts["stage-listen"].stages["listen"]


def _nothing_left(mesh: LocalMesh, timeout: float = 10.0) -> None:
    """Until neither the coordinator nor the stage (nor its scheduler) holds a request."""
    deadline = time.monotonic() + timeout
    while True:
        coordinator = mesh.coordinator
        assert coordinator is not None
        stage = _stage(mesh)
        held = (len(coordinator.requests.live), stage.inflight, stage.scheduler.held_requests)
        pending = sum(c.inflight for c in coordinator._channels.values())
        if held == (0, 0, 0) and pending == 0:
            return
        assert time.monotonic() < deadline, f"left behind: {held}, {pending} unacked chunks"
        time.sleep(0.02)


def test_output_comes_before_the_input_ends(mesh: LocalMesh) -> None:
    async def run() -> tuple[list[Chunk], GenerateResult]:
        async with mesh.async_client(timeout=60) as client:
            async with client.input_stream({}) as request:
                events = aiter(request)
                await request.send(np.ones(4, np.float32), modality="audio")
                # The stage answered chunk 0 while the rest of the input is still to come.
                first = await anext(events)
                for i in range(1, 6):
                    await request.send(np.full(4, i, np.float32))
                await request.end()
                rest = [event async for event in events]
        return [first, *rest[:-1]], rest[-1]

    chunks, result = mesh.run(run(), timeout=60)
    assert [c.data["index"] for c in chunks] == list(range(6))
    assert [c.data["sum"] for c in chunks] == [4.0, 4.0, 8.0, 12.0, 16.0, 20.0]
    assert result.outputs["listen"] == {"chunks": 6, "total": 64.0}
    _nothing_left(mesh)


def test_a_request_without_input_has_an_empty_stream(mesh: LocalMesh) -> None:
    with mesh.client(timeout=60) as client:
        assert client.generate({}).outputs["listen"] == {"chunks": 0, "total": 0.0}


def test_blocking_client_streams_input(mesh: LocalMesh) -> None:
    with mesh.client(timeout=60) as client, client.input_stream({}) as request:
        for i in range(3):
            request.send(np.full(2, i, np.float32))
        request.end()
        events = list(request)
    assert [e.data["sum"] for e in events[:-1]] == [0.0, 2.0, 4.0]
    assert isinstance(events[-1], GenerateResult)
    assert events[-1].outputs["listen"]["chunks"] == 3
    with pytest.raises(OmniError) as err:
        request.send(np.zeros(1))
    assert err.value.code == Code.FAILED_PRECONDITION


def test_a_fast_client_is_held_back(mesh: LocalMesh) -> None:
    """The stage takes a chunk every 20 ms; the client could send 64 x 256 KiB at once.
    It is slowed to the stage's pace: the coordinator never has more than the credit in
    flight, and when the client's last send returns most chunks have been consumed."""
    n, chunk_ms = 64, 20.0
    samples: list[tuple[int, int]] = []

    async def run() -> tuple[int, float, GenerateResult]:
        coordinator = mesh.coordinator
        assert coordinator is not None
        async with mesh.async_client(timeout=120) as client:
            async with client.input_stream({"chunk_ms": chunk_ms}) as request:
                answers: list[int] = []
                rec = None

                async def read() -> GenerateResult:
                    async for event in request:
                        if isinstance(event, GenerateResult):
                            return event
                        answers.append(event.data["index"])
                    raise AssertionError("no result")

                reader = asyncio.get_running_loop().create_task(read())
                began = time.monotonic()
                for i in range(n):
                    await request.send(np.full(CHUNK // 4, i, np.float32))
                    rec = rec or coordinator.requests.live.get(request.request_id)
                    if rec is not None and rec.input is not None:
                        samples.append((rec.input.slots, rec.input.nbytes))
                sent_s = time.monotonic() - began
                taken_when_sent = len(answers)
                await request.end()
                result = await asyncio.wait_for(reader, 60)
        return taken_when_sent, sent_s, result

    taken, sent_s, result = mesh.run(run(), timeout=120)
    assert result.outputs["listen"]["chunks"] == n
    # Never more than the credit in flight at the coordinator (1 MiB: 4 chunks).
    assert max(s for s, _ in samples) <= CREDITS
    assert max(b for _, b in samples) <= (1 << 20) + CHUNK
    # The client waited for the stage: what it got ahead by is bounded (the credit, the
    # session's 1 MiB queue, HTTP/2 windows), not the whole input.
    assert taken >= n // 3, (taken, sent_s)
    assert sent_s >= (n // 3) * chunk_ms / 1000.0
    _nothing_left(mesh)


def test_abort_mid_input_leaves_nothing(mesh: LocalMesh) -> None:
    async def run() -> None:
        async with mesh.async_client(timeout=60) as client:
            request = client.input_stream({"chunk_ms": 50})
            for i in range(CREDITS + 2):  # some taken, some in flight, some queued
                await request.send(np.full(CHUNK // 4, i, np.float32))
            request.abort("the user hung up")
            with pytest.raises(OmniError) as err:
                await request.send(np.zeros(1))
            assert err.value.code == Code.FAILED_PRECONDITION

    mesh.run(run(), timeout=60)
    _nothing_left(mesh)


def test_deadline_ends_an_unfinished_input(mesh: LocalMesh) -> None:
    async def run() -> None:
        async with mesh.async_client() as client:
            async with client.input_stream({}, timeout=0.5) as request:
                await request.send(np.ones(2, np.float32))
                with pytest.raises(OmniError) as err:
                    async for _ in request:
                        pass
                assert err.value.code == Code.DEADLINE_EXCEEDED

    mesh.run(run(), timeout=60)
    _nothing_left(mesh)


# ---- the protocol, on a raw Session ------------------------------------------------


def _chunk(rid: str, chunk_id: int, value: float = 1.0) -> client_pb2.InputChunk:
    data = encode_inline(np.full(2, value, np.float32))
    return client_pb2.InputChunk(request_id=rid, chunk_id=chunk_id, data=data)


def _start(rid: str, **fields: object) -> client_pb2.GenerateRequest:
    return client_pb2.GenerateRequest(
        request_id=rid, inputs=encode_inline({}), input_stream=True, stream=True, **fields
    )


async def _session(
    address: str, messages: list[client_pb2.SessionRequest]
) -> AsyncIterator[client_pb2.SessionEvent]:
    async with grpc.aio.insecure_channel(address) as channel:
        call = client_pb2_grpc.OmnirailStub(channel).Session()
        for message in messages:
            await call.write(message)
        await call.done_writing()
        async for batch in call:
            for event in batch.events:
                yield event


def _ends(mesh: LocalMesh, messages: list[client_pb2.SessionRequest]) -> dict[str, object]:
    """Each request's end on a raw Session: its result's output, or (code, message)."""

    async def run() -> dict[str, object]:
        ends: dict[str, object] = {}
        assert mesh.address is not None
        async for event in _session(mesh.address, messages):
            if event.HasField("result"):
                ends[event.request_id] = dict(event.result.outputs)
            elif event.HasField("error"):
                ends[event.request_id] = (event.error.code, event.error.message)
        return ends

    return mesh.run(run(), timeout=60)


@pytest.mark.parametrize(
    ("chunks", "expected"),
    [
        ([_chunk("r", 1)], "input chunk 1 is out of order or a duplicate (expected chunk 0)"),
        ([_chunk("r", 0), _chunk("r", 0)], "input chunk 0 is out of order or a duplicate"),
        (
            [_chunk("r", 0), client_pb2.InputChunk(request_id="r", chunk_id=3, done=True)],
            "input stream ended after 3 chunks, but 1 were sent",
        ),
        (
            [client_pb2.InputChunk(request_id="r", chunk_id=0, done=True), _chunk("r", 0)],
            "",  # the request may end first (nothing to read): either way, no crash
        ),
        ([client_pb2.InputChunk(request_id="r", chunk_id=0)], "input chunk 0: data: required"),
    ],
)
def test_protocol_errors_fail_only_that_request(
    mesh: LocalMesh, chunks: list[client_pb2.InputChunk], expected: str
) -> None:
    good = [_chunk("ok", 0, 5.0), client_pb2.InputChunk(request_id="ok", chunk_id=1, done=True)]
    ends = _ends(
        mesh,
        [client_pb2.SessionRequest(generate=[_start("r"), _start("ok")], input=[*chunks, *good])],
    )
    assert ends["ok"] == {"listen": ends["ok"]["listen"]}  # type: ignore[index]
    if expected:
        code, message = ends["r"]  # type: ignore[misc]
        assert code == Code.INVALID_ARGUMENT and expected in message, ends["r"]
    _nothing_left(mesh)


def test_input_for_an_unknown_request_is_not_found(mesh: LocalMesh) -> None:
    ends = _ends(mesh, [client_pb2.SessionRequest(input=[_chunk("nobody", 0)])])
    code, message = ends["nobody"]  # type: ignore[misc]
    assert code == Code.NOT_FOUND and "not a live request of this Session" in message


def test_relayed_input_is_refused(mesh: LocalMesh) -> None:
    chunk = client_pb2.InputChunk(request_id="r", chunk_id=0)
    chunk.data.header = b"\x80"
    chunk.data.relay.backend = "shm"
    ends = _ends(mesh, [client_pb2.SessionRequest(generate=[_start("r")], input=[chunk])])
    code, message = ends["r"]  # type: ignore[misc]
    assert code == Code.INVALID_ARGUMENT and "relay descriptors are not accepted" in message


def test_input_stream_needs_a_session(mesh: LocalMesh) -> None:
    async def run() -> grpc.StatusCode:
        assert mesh.address is not None
        async with grpc.aio.insecure_channel(mesh.address) as channel:
            stub = client_pb2_grpc.OmnirailStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Submit(_start("g"))
            assert "sent on a Session" in (err.value.details() or "")
            return err.value.code()

    assert mesh.run(run(), timeout=30) == grpc.StatusCode.INVALID_ARGUMENT


def test_a_pipeline_without_input_stream_refuses_it(linear_mesh: LocalMesh) -> None:
    ends = _ends(linear_mesh, [client_pb2.SessionRequest(generate=[_start("x")])])
    code, message = ends["x"]  # type: ignore[misc]
    assert code == Code.INVALID_ARGUMENT and "takes no input streams" in message
