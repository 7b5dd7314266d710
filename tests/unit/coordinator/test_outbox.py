"""ClientOutbox: what waits for one client call, bounded in bytes and messages."""

from __future__ import annotations

import asyncio
from typing import Any

from omnirail.coordinator.outbox import MAX_WRITE_BYTES, ClientOutbox
from omnirail.v1 import client_pb2


def event(rid: str, pad: int = 0) -> client_pb2.SessionEvent:
    return client_pb2.SessionEvent(request_id=rid + "x" * pad)


def batch(events: list[client_pb2.SessionEvent]) -> client_pb2.SessionEvents:
    return client_pb2.SessionEvents(events=events)


class Writes:
    """A client call's write side: records what was written; `hold` makes writes wait."""

    def __init__(self) -> None:
        self.written: list[Any] = []
        self.hold: asyncio.Event | None = None

    async def __call__(self, message: Any) -> None:
        if self.hold is not None:
            await self.hold.wait()
        self.written.append(message)


async def test_full_at_either_bound_and_room_again_at_half() -> None:
    fulls: list[int] = []
    box: ClientOutbox[client_pb2.SessionEvent] = ClientOutbox(
        "session", 1 << 20, 4, batch, on_full=lambda: fulls.append(1)
    )
    for i in range(3):
        box.push(event(str(i)))
    assert box.room.is_set() and not box.full()
    box.push(event("3"))
    assert box.full() and not box.room.is_set() and fulls == [1]
    box.push(event("4"))  # still full: counted once per pause
    assert fulls == [1] and box.messages == 5 and not box.full(2)
    writes = Writes()
    assert await box.write_next(writes)
    assert [e.request_id for e in writes.written[0].events] == ["0", "1", "2", "3", "4"]
    assert (box.bytes, box.messages) == (0, 0) and box.room.is_set()
    assert not await box.write_next(writes)


async def test_the_byte_bound_counts_the_write_in_flight() -> None:
    box: ClientOutbox[client_pb2.SessionEvent] = ClientOutbox("generate", 1000, 100)
    writes = Writes()
    writes.hold = asyncio.Event()
    box.push(event("a", pad=600))
    writing = asyncio.get_running_loop().create_task(box.write_next(writes))
    await asyncio.sleep(0)
    assert len(box) == 0 and box.bytes > 600  # out of the queue, not yet written
    box.push(event("b", pad=600))
    assert box.full() and "client_buffer_mb" in box.describe()
    writes.hold.set()
    await writing
    # Below the bound, but reading resumes only once half of it is written.
    assert not box.full() and not box.room.is_set()
    assert await box.write_next(writes)
    assert box.room.is_set() and [m.request_id[0] for m in writes.written] == ["a", "b"]


async def test_a_burst_is_written_in_messages_a_client_accepts() -> None:
    box: ClientOutbox[client_pb2.SessionEvent] = ClientOutbox("session", 64 << 20, 1000, batch)
    for i in range(5):
        box.push(event(str(i), pad=MAX_WRITE_BYTES // 2 - 100))
    writes = Writes()
    while await box.write_next(writes):
        pass
    assert [len(m.events) for m in writes.written] == [2, 2, 1]
    assert all(m.ByteSize() <= MAX_WRITE_BYTES + 64 for m in writes.written)


async def test_pump_writes_until_the_reader_ended_and_the_call_is_done() -> None:
    """A half-closed call: the reader has ended, but the writer goes on until every
    request has answered (`done`)."""
    box: ClientOutbox[client_pb2.SessionEvent] = ClientOutbox("session", 1 << 20, 100, batch)
    pending = {"a", "b"}
    reader = asyncio.get_running_loop().create_task(asyncio.sleep(0))
    writes = Writes()
    pump = asyncio.get_running_loop().create_task(box.pump(writes, reader, lambda: not pending))
    await asyncio.sleep(0.01)
    assert reader.done() and not pump.done()
    for rid in ("a", "b"):
        pending.discard(rid)
        box.push(event(rid))
        await asyncio.sleep(0.01)
    await asyncio.wait_for(pump, 5)
    assert [e.request_id for m in writes.written for e in m.events] == ["a", "b"]


async def test_pump_ends_when_the_reader_fails() -> None:
    box: ClientOutbox[client_pb2.SessionEvent] = ClientOutbox("session", 1 << 20, 100, batch)

    async def broken() -> None:
        raise RuntimeError("stream broke")

    reader = asyncio.get_running_loop().create_task(broken())
    await asyncio.wait_for(box.pump(Writes(), reader, lambda: False), 5)
