"""Clients' input streams into running requests (`GenerateRequest.input_stream`).

A Session's `InputChunk`s become stream items from source "@client" to the entry stage's
replica that took the request, on the coordinator's Deliver channel to it, behind the
request's payload (so in order). The entry stage sees them as it sees a stream from another
stage: `stream_chunk` messages, then `stream_done` once the client's done mark arrives.

Flow control is the stream edges' credit, per request: a chunk holds credit from the moment
it is forwarded until the entry stage's scheduler takes it (the stage acks stream items
then). While a request holds its pipeline's `input_stream.credits` chunks (or `credit_mb`),
the Session waits for one to come back before it reads on: a client that sends faster than
the entry stage consumes is held at HTTP/2 flow control, never buffered without bound.

A request started with `input_stream` on such a pipeline is never re-dispatched (its chunks
were consumed where it ran); one started without gets an empty input stream (its done mark
at once), so the entry stage's handling is the same for both.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from omnirail.stage.scheduler import CLIENT
from omnirail.v1 import client_pb2, mesh_pb2
from omnirail.wire.errors import Code, OmniError, invalid


@dataclass(slots=True, eq=False)
class InputStream:
    """One request's input stream at the coordinator: its next chunk id and its credit."""

    max_slots: int
    max_bytes: int
    max_chunk_bytes: int
    traceparent: str
    meta: mesh_pb2.RequestMeta
    next_chunk: int = 0
    ended: bool = False
    slots: int = 0
    nbytes: int = 0
    # Set when credit came back (or the request ended): what a waiting Session waits on.
    room: asyncio.Event = field(default_factory=asyncio.Event)

    def has_room(self, nbytes: int) -> bool:
        """Whether a chunk of `nbytes` may go now (one larger than credit_mb goes alone)."""
        if self.slots >= self.max_slots:
            return False
        return self.slots == 0 or self.nbytes + nbytes <= self.max_bytes

    def check(self, chunk: client_pb2.InputChunk) -> None:
        """Raises OmniError (INVALID_ARGUMENT / RESOURCE_EXHAUSTED) for a chunk that breaks
        the protocol: the request fails, the Session and other requests go on."""
        if self.ended:
            raise invalid(f"input chunk {chunk.chunk_id} after the input stream's done")
        if chunk.chunk_id != self.next_chunk:
            if chunk.done:
                raise invalid(
                    f"input stream ended after {chunk.chunk_id} chunks, but "
                    f"{self.next_chunk} were sent"
                )
            raise invalid(
                f"input chunk {chunk.chunk_id} is out of order or a duplicate (expected "
                f"chunk {self.next_chunk})"
            )
        if chunk.done:
            return
        if not chunk.HasField("data"):
            raise invalid(f"input chunk {chunk.chunk_id}: data: required (or set done)")
        if chunk.data.HasField("relay"):
            raise invalid(
                f"input chunk {chunk.chunk_id}: relay descriptors are not accepted from "
                "clients; send inline"
            )
        size = chunk.data.ByteSize()
        if size > self.max_chunk_bytes:
            raise OmniError(
                Code.RESOURCE_EXHAUSTED,
                f"input chunk {chunk.chunk_id}: {size} bytes exceed the pipeline's limit of "
                f"{self.max_chunk_bytes} bytes (max_input_mb)",
            )

    def item(self, wire_id: str, entry: str, chunk: client_pb2.InputChunk) -> mesh_pb2.DeliverItem:
        """The stream item that carries `chunk` (checked) to the entry stage."""
        signal = mesh_pb2.StreamSignal(
            chunk_id=chunk.chunk_id, done=chunk.done, modality=chunk.modality
        )
        item = mesh_pb2.DeliverItem(
            request_id=wire_id,
            from_stage=CLIENT,
            to_stage=entry,
            traceparent=self.traceparent,
            meta=self.meta,
            stream=signal,
        )
        if chunk.done:
            self.ended = True
        else:
            item.payload.CopyFrom(chunk.data)
            self.next_chunk += 1
        return item

    def close(self) -> None:
        """The request ended: a Session waiting for its credit reads on."""
        self.ended = True
        self.room.set()


class ChunkCredit:
    """Rides with a forwarded chunk; the entry stage's ack (or a broken stream, or the
    request's abort) releases it."""

    __slots__ = ("_released", "_stream", "nbytes")
    acked_in_band = True

    def __init__(self, stream: InputStream, nbytes: int) -> None:
        self._stream = stream
        self.nbytes = nbytes
        self._released = False
        stream.slots += 1
        stream.nbytes += nbytes

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._stream.slots -= 1
        self._stream.nbytes -= self.nbytes
        self._stream.room.set()


def empty_stream(
    wire_id: str, entry: str, traceparent: str, meta: mesh_pb2.RequestMeta
) -> mesh_pb2.DeliverItem:
    """The done mark of an input stream with no chunks (a request that streams nothing)."""
    return mesh_pb2.DeliverItem(
        request_id=wire_id,
        from_stage=CLIENT,
        to_stage=entry,
        traceparent=traceparent,
        meta=meta,
        stream=mesh_pb2.StreamSignal(chunk_id=0, done=True),
    )
