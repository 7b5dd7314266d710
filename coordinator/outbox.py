"""What waits to be written to one client call, bounded: `ClientOutbox`.

A client that does not read its stream must not make the coordinator buffer without bound.
Every client call that streams (a Session, a KServe stream, a streaming Generate) writes
through an outbox: messages wait in order, and what waits (the queued messages and the
write in flight) is counted in bytes and in messages. The call is *full* at `max_bytes`
(`client_buffer_mb`) or `max_messages` (`client_stream_buffer`):

- calls that read requests (Session, KServe stream) stop reading while full: the client's
  sends then stop at HTTP/2 flow control, and nothing new starts for a client that does not
  read. Reading resumes once half of the bound has been written;
- a stream chunk that finds the call past twice its bound (a streaming Generate: past its
  bound, since it has no requests to stop reading) fails its request with
  RESOURCE_EXHAUSTED. Results and errors always wait: each belongs to a request admitted
  before the call was full, so what waits stays bounded by the admission limit.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar


class _Sized(Protocol):
    def ByteSize(self) -> int: ...


log = logging.getLogger(__name__)

M = TypeVar("M", bound=_Sized)

# One write of a batching call never exceeds this (a client's message limit is 4 MiB in
# generic gRPC clients): a burst of results goes out as several messages, not one the
# client must refuse.
MAX_WRITE_BYTES = 2 << 20


class ClientOutbox(Generic[M]):
    """Messages waiting for one client call, with what they weigh.

    `combine`, when given, joins waiting messages into one write (a Session's batch of
    events); without it each message is a write of its own.
    """

    def __init__(
        self,
        call: str,
        max_bytes: int,
        max_messages: int,
        combine: Callable[[list[M]], Any] | None = None,
        on_full: Callable[[], None] | None = None,
    ) -> None:
        self.call = call  # what kind of call: session, kserve_stream, generate
        self.max_bytes = max_bytes
        self.max_messages = max_messages
        self._combine = combine
        self._on_full = on_full
        self._queue: deque[tuple[M, int]] = deque()
        # Bytes and messages queued or in the write in flight.
        self.bytes = 0
        self.messages = 0
        self.wake = asyncio.Event()
        # Set while the call has room: readers of requests wait on it.
        self.room = asyncio.Event()
        self.room.set()

    def __len__(self) -> int:
        return len(self._queue)

    def push(self, message: M, size: int | None = None) -> None:
        size = message.ByteSize() if size is None else size
        self._queue.append((message, size))
        self.bytes += size
        self.messages += 1
        self.wake.set()
        if self.room.is_set() and self.full():
            self.room.clear()
            if self._on_full is not None:
                self._on_full()

    def full(self, factor: int = 1) -> bool:
        """Whether what waits has reached `factor` times the call's bound."""
        return self.bytes >= factor * self.max_bytes or self.messages >= factor * self.max_messages

    def describe(self) -> str:
        """What waits, against the bounds (for errors that explain a refusal)."""
        return (
            f"{self.messages} messages and {self.bytes} bytes wait for it "
            f"(client_stream_buffer is {self.max_messages}, client_buffer_mb "
            f"{self.max_bytes / (1 << 20):g})"
        )

    async def write_next(self, write: Callable[[Any], Any]) -> bool:
        """Writes what waits (with `combine`, as many messages as one write holds; else the
        oldest). False when nothing waits."""
        if not self._queue:
            return False
        if self._combine is None:
            message, size = self._queue.popleft()
            count = 1
        else:
            batch: list[M] = []
            size = 0
            while self._queue and (not batch or size + self._queue[0][1] <= MAX_WRITE_BYTES):
                item, item_size = self._queue.popleft()
                batch.append(item)
                size += item_size
            message, count = self._combine(batch), len(batch)
        try:
            await write(message)
        finally:
            self.bytes -= size
            self.messages -= count
            self._settle()
        return True

    def _settle(self) -> None:
        # Half the bound written before reading resumes: a client at the edge does not
        # flip its call between reading and not at every write.
        if not self.room.is_set() and (
            2 * self.bytes <= self.max_bytes and 2 * self.messages <= self.max_messages
        ):
            self.room.set()

    async def pump(
        self, write: Callable[[Any], Any], reader: asyncio.Task[Any], done: Callable[[], bool]
    ) -> None:
        """Writes until `reader` has ended, nothing waits and `done()` holds (or the reader
        failed). Whoever pushes wakes it, so a burst goes out in few writes."""
        reader.add_done_callback(lambda _: self.wake.set())
        while True:
            if await self.write_next(write):
                continue
            if reader.done():
                if not reader.cancelled() and reader.exception() is not None:
                    log.warning("client stream reader ended: %s", reader.exception())
                    return
                if reader.cancelled() or done():
                    return
            self.wake.clear()
            await self.wake.wait()
