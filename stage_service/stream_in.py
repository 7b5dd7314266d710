"""Receiver side of stream edges: the per-request checks on chunk ids and end signals.

Chunks from each source must arrive numbered 0, 1, 2, ... and end with one done signal
whose count matches; anything else (a gap, a duplicate, a chunk after done, a wrong
count) is a protocol error that fails the request, never the stage.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from omnirail.relay.base import Relay, RelayError
from omnirail.relay.io import receive_payload
from omnirail.stage.scheduler import IncomingMessage
from omnirail.v1 import mesh_pb2
from omnirail.wire.payload import PayloadError


@dataclass(slots=True)
class InStreams:
    """One request's streams into this stage."""

    next_chunk: dict[str, int] = field(default_factory=dict)
    done_from: set[str] = field(default_factory=set)
    # Scheduler messages that wait for the request's payload (new_request) to go first.
    early: list[IncomingMessage] = field(default_factory=list)
    # Whether stream_done has been handed on (once every expected source ended).
    ended: bool = False

    def problem(self, source: str, signal: mesh_pb2.StreamSignal) -> str | None:
        """Why this chunk or done signal breaks the stream protocol; None if it fits."""
        expected = self.next_chunk.get(source, 0)
        if source in self.done_from:
            return f"stream item {signal.chunk_id} from {source!r} after its done"
        if signal.done and signal.chunk_id != expected:
            return (
                f"stream from {source!r} ended after {signal.chunk_id} chunks, "
                f"but {expected} arrived"
            )
        if not signal.done and signal.chunk_id != expected:
            return (
                f"stream chunk {signal.chunk_id} from {source!r} is out of order or "
                f"a duplicate (expected chunk {expected})"
            )
        return None

    def accept(self, source: str, signal: mesh_pb2.StreamSignal) -> None:
        """Records a chunk or done that passed `problem`."""
        if signal.done:
            self.done_from.add(source)
        else:
            self.next_chunk[source] = signal.chunk_id + 1


async def drain(
    item: mesh_pb2.DeliverItem,
    relays: Mapping[str, Relay],
    owners: frozenset[str] | None = None,
) -> None:
    """Releases the relay slot of a stream item that will not be used (only one its
    sender, of `owners`, may name: see `Relay.get`)."""
    if not item.payload.HasField("relay"):
        return
    try:
        received = await receive_payload(item.payload, relays, owners=owners)
    except (PayloadError, RelayError):
        return
    received.release()
