"""A streaming client that stops reading: its request fails, the coordinator stays bounded."""

from __future__ import annotations

import asyncio
from typing import Any

from grpc_health.v1 import health

from omnirail.config import PipelineConfig
from omnirail.coordinator.requests import RequestRecord, State
from omnirail.coordinator.service import Coordinator
from omnirail.coordinator.session import stream_chunks
from omnirail.v1 import client_pb2, common_pb2
from omnirail.wire.errors import Code

HERE = "tests.unit.coordinator.test_slow_client"


def make_stage() -> Any:
    return lambda payload: payload


class StalledContext:
    """A servicer context whose client never reads: every write waits forever."""

    def __init__(self) -> None:
        self.writes = 0

    async def write(self, message: Any) -> None:
        self.writes += 1
        await asyncio.Event().wait()


def streaming_generate(**limits: int) -> tuple[RequestRecord, StalledContext, asyncio.Task[None]]:
    """A streaming Generate of one running request, to a client that never reads, on a
    coordinator with `limits` (client_stream_buffer, client_buffer_mb)."""
    pipeline = PipelineConfig.from_dict(
        {
            "name": "slow-client",
            **limits,
            "stages": [{"name": "a", "factory": f"{HERE}:make_stage", "terminal": True}],
        }
    )
    coordinator = Coordinator(pipeline, health.aio.HealthServicer())
    rec = RequestRecord("r", ("a",), frozenset({"a"}), deadline=0.0)
    rec.state = State.RUNNING
    coordinator.requests.add(rec)
    context = StalledContext()
    writer = asyncio.get_running_loop().create_task(stream_chunks(coordinator, rec, context))
    return rec, context, writer


async def test_generate_stream_fails_a_request_whose_client_stops_reading() -> None:
    rec, context, writer = streaming_generate(client_stream_buffer=8)
    await asyncio.sleep(0)  # the writer subscribes to the request's chunks
    for i in range(20):
        for on_chunk in list(rec.on_chunk):
            on_chunk(client_pb2.Chunk(stage="a", chunk_id=i))
        for _ in range(3):  # let the writer run: it blocks on its first write
            await asyncio.sleep(0)
    assert rec.state == State.FAILED
    assert rec.error is not None and rec.error.code == Code.RESOURCE_EXHAUSTED
    assert "not reading its stream" in rec.error.message
    # Once failed, nothing more is queued for it (chunks stop reaching the call).
    assert rec.on_chunk == []
    assert context.writes == 1  # stuck on the first write; the rest was never attempted
    writer.cancel()


async def test_generate_stream_bounds_the_bytes_waiting_too() -> None:
    """Few, large chunks: the byte bound (client_buffer_mb) fails the request where the
    message bound would not."""
    rec, _, writer = streaming_generate(client_buffer_mb=1)
    await asyncio.sleep(0)
    data = common_pb2.Payload(inline_data=b"x" * (300 << 10))
    for i in range(5):
        for on_chunk in list(rec.on_chunk):
            on_chunk(client_pb2.Chunk(stage="a", chunk_id=i, data=data))
        await asyncio.sleep(0)
    assert rec.state == State.FAILED and rec.error is not None
    assert rec.error.code == Code.RESOURCE_EXHAUSTED
    assert "client_buffer_mb 1" in rec.error.message, rec.error.message
    writer.cancel()
