"""Sender side of a Deliver stream: one long-lived bidi stream per receiver address.

Items queue up while a write is in flight and go out together in the next `DeliverBatch`,
so a burst of N results costs one write, not N. Acks come back on the same stream for
relayed items only: each names an item's `seq` and returns its relay handle (credit).
Inline items hold nothing on the sender, so they are not acked; if their receiver dies,
the coordinator learns it from the receiver's broken Attach stream and fails them.

Each stream shows the sender's member credentials in its metadata (`credentials`, see
omnirail/transport/members.py): receivers refuse streams of senders they cannot
authenticate.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc

from omnirail.relay.base import Releasable
from omnirail.transport.batching import take_batch, wait_until
from omnirail.transport.members import MemberCredentials
from omnirail.transport.security import MeshSecurity, mesh_channel
from omnirail.v1 import common_pb2, mesh_pb2, mesh_pb2_grpc

log = logging.getLogger(__name__)

# Bound on one write so a burst of large inline payloads stays under the message limit.
_MAX_BATCH_ITEMS = 256
_MAX_BATCH_BYTES = 8 << 20


@dataclass(slots=True)
class _Pending:
    request_id: str
    handle: Releasable | None


# Called with the request ids whose items were lost when a stream broke.
LostCallback = Callable[[list[str], str], None]
# The sender's member credentials as of now (None: it has none yet); read per stream, so a
# stream opened after the sender registered again shows its new token.
CredentialsFn = Callable[[], MemberCredentials | None]


def channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Unix-socket and loopback peers: favour latency over coalescing.
        ("grpc.http2.write_buffer_size", 0),
    ]


class DeliverChannel:
    """Queues items for one receiver and keeps a Deliver stream open to it."""

    def __init__(
        self,
        address: str,
        sender: str,
        on_lost: LostCallback,
        *,
        max_message_bytes: int = 64 << 20,
        security: MeshSecurity | None = None,
        credentials: CredentialsFn | None = None,
    ) -> None:
        self.address = address
        self._sender = sender
        self._security = security
        self._credentials = credentials
        self._on_lost = on_lost
        self._max_message_bytes = max_message_bytes
        self._queue: deque[mesh_pb2.DeliverItem] = deque()
        self._pending: dict[int, _Pending] = {}
        self._seq = 0
        self._wake = asyncio.Event()
        self._channel: grpc.aio.Channel | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def inflight(self) -> int:
        return len(self._pending)

    def send(self, item: mesh_pb2.DeliverItem, handle: Releasable | None = None) -> None:
        """Queues `item`; `handle` is released when the receiver acks it."""
        if self._closed:
            if handle is not None:
                handle.release()
            self._on_lost([item.request_id], f"channel to {self.address} is closed")
            return
        self._seq += 1
        item.seq = self._seq
        if handle is not None and handle.acked_in_band:
            self._pending[self._seq] = _Pending(item.request_id, handle)
        self._queue.append(item)
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
            self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        # Never expected: say so loudly; the next send() starts a new task.
        if not task.cancelled() and task.exception() is not None:
            log.error("deliver channel to %s stopped: %r", self.address, task.exception())

    def forget_request(self, request_id: str) -> None:
        """Drops queued, unsent items of an aborted request and releases their handles."""
        kept: deque[mesh_pb2.DeliverItem] = deque()
        dropped: list[_Pending] = []
        for item in self._queue:
            if item.request_id == request_id:
                pending = self._pending.pop(item.seq, None)
                if pending is not None:
                    dropped.append(pending)
            else:
                kept.append(item)
        self._queue = kept
        # Only now: a release may hand its credit to a waiting chunk, which calls send().
        _release(dropped)

    async def close(self, reason: str = "sender is shutting down") -> None:
        """Stops the channel; items not yet acked fail with `reason`."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
        self._fail_all(reason)
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def _run(self) -> None:
        while not self._closed:
            try:
                await self._stream_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("deliver stream to %s broke: %s", self.address, exc)
            self._fail_all(f"stream to {self.address} broke")
            if self._channel is not None:
                await self._channel.close()
                self._channel = None
            # Reconnect only when there is something to send again.
            self._wake.clear()
            if not self._queue:
                await self._wake.wait()
            else:
                await asyncio.sleep(0.05)

    async def _stream_once(self) -> None:
        self._channel, metadata = mesh_channel(
            self._security, self.address, channel_options(self._max_message_bytes), aio=True
        )
        creds = self._credentials() if self._credentials is not None else None
        if creds is not None:
            metadata = (*metadata, *creds.metadata())
        stub = mesh_pb2_grpc.StageStub(self._channel)
        call = stub.Deliver(metadata=metadata)
        acks = asyncio.get_running_loop().create_task(self._read_acks(call))
        # One wake-up source for "items queued" and "ack stream ended": cheaper per write
        # than asyncio.wait over fresh futures.
        acks.add_done_callback(lambda _: self._wake.set())
        first = True
        try:
            while True:
                await wait_until(self._wake, lambda: self._queue or acks.done())
                if not self._queue:
                    acks.result()  # raises the stream error, if any
                    return
                batch = mesh_pb2.DeliverBatch(
                    items=take_batch(self._queue, _item_size, _MAX_BATCH_ITEMS, _MAX_BATCH_BYTES)
                )
                if first:
                    batch.sender = self._sender
                    first = False
                await call.write(batch)
        finally:
            acks.cancel()
            call.cancel()

    async def _read_acks(self, call: Any) -> None:
        while (ack_batch := await call.read()) is not grpc.aio.EOF:
            for ack in ack_batch.acks:
                pending = self._pending.pop(ack.seq, None)
                if pending is not None and pending.handle is not None:
                    pending.handle.release()
        raise ConnectionError(f"receiver {self.address} closed the stream")

    def _fail_all(self, reason: str) -> None:
        # Swap before releasing: a release may hand its credit to a waiting chunk, whose
        # send() lands in the fresh queue (mutating these while iterating them would kill
        # this channel's task and strand every credit it holds).
        pending, self._pending = self._pending, {}
        self._queue = deque()
        if not pending:
            return
        lost = sorted({p.request_id for p in pending.values()})
        _release(pending.values())
        self._on_lost(lost, reason)


def error_ack(seq: int, code: int, message: str, stage: str = "") -> mesh_pb2.Ack:
    return mesh_pb2.Ack(seq=seq, error=common_pb2.Error(code=code, message=message, stage=stage))


def _release(pending: Iterable[_Pending]) -> None:
    for p in pending:
        if p.handle is not None:
            p.handle.release()


def _item_size(item: mesh_pb2.DeliverItem) -> int:
    return item.ByteSize()
