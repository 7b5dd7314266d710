"""Sender side of stream edges: chunk ids and end signals.

Each chunk of a (request, target) stream gets the next chunk id; `done` ends the stream
after the chunks queued so far, `error` tells every target of a failed request's streams
at once. Sending, order per (request, edge), stream credit and round-robin fairness are
the edge's `EdgeSender`'s (`edge_sender.py`): a chunk holds credit on its edge (this stage
-> one target stage) from the moment it is sent until the receiving scheduler takes it,
and a request's chunks, then its done signal, leave in sequence.
"""

from __future__ import annotations

from omnirail.stage_service.edge_sender import EdgeSenders, LocalValue, Outgoing, SentToken
from omnirail.v1 import mesh_pb2
from omnirail.wire.errors import OmniError
from omnirail.wire.payload import Packed


class StreamSender:
    """The stream edges out of one stage."""

    def __init__(self, senders: EdgeSenders) -> None:
        self._senders = senders
        # request -> target -> next chunk id, while the stream is open (keyed by request
        # first: a request's end drops its streams without scanning everyone else's).
        self._next_id: dict[str, dict[str, int]] = {}

    def chunk(
        self,
        request_id: str,
        target: str,
        packed: Packed | LocalValue,
        modality: str,
        meta: mesh_pb2.RequestMeta,
        traceparent: str,
        token: SentToken | None,
    ) -> None:
        streams = self._next_id.get(request_id)
        if streams is None:
            streams = self._next_id[request_id] = {}
        chunk_id = streams.get(target, 0)
        streams[target] = chunk_id + 1
        signal = mesh_pb2.StreamSignal(chunk_id=chunk_id, modality=modality)
        self._senders[target].stream(Outgoing(request_id, packed, signal, meta, traceparent, token))

    def done(
        self, request_id: str, target: str, meta: mesh_pb2.RequestMeta, traceparent: str
    ) -> None:
        """Ends the (request, target) stream after the chunks queued so far."""
        count = self._next_id.get(request_id, {}).pop(target, 0)
        signal = mesh_pb2.StreamSignal(chunk_id=count, done=True)
        self._senders[target].stream(Outgoing(request_id, None, signal, meta, traceparent))

    def error(
        self, request_id: str, error: OmniError, meta: mesh_pb2.RequestMeta, traceparent: str
    ) -> None:
        """Tells every target this request streamed to that the stream failed, at once."""
        targets = self.streamed_to(request_id)
        self._senders.forget(request_id)
        self.close_request(request_id)
        for target in targets:
            signal = mesh_pb2.StreamSignal(error=error.to_proto())
            self._senders[target].send_now(Outgoing(request_id, None, signal, meta, traceparent))

    def close_request(self, request_id: str) -> None:
        """Forgets the request's open stream counters (its done signals are queued)."""
        self._next_id.pop(request_id, None)

    def streamed_to(self, request_id: str) -> list[str]:
        """Targets with an open (not yet done) stream of `request_id`."""
        return list(self._next_id.get(request_id, ()))
