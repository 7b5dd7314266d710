"""What a stage keeps per request, what it reports to, and the plain helpers around it.

`RequestState` is one request's state at a stage: its metadata, the payloads it holds,
fan-in progress, its stream input and its tracing/metrics bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from omnirail.relay.io import ReceivedPayload
from omnirail.stage.scheduler import IncomingMessage
from omnirail.stage_service.stream_in import InStreams
from omnirail.telemetry.tracer import Span
from omnirail.v1 import common_pb2, mesh_pb2
from omnirail.wire.errors import Code, OmniError

AckFn = Callable[[OmniError | None], None]


class Reporter(Protocol):
    """Upward events to the coordinator (the stage's Attach stream)."""

    def complete(self, request_id: str, output: common_pb2.Payload, traceparent: str) -> None: ...

    def chunk(
        self, request_id: str, chunk_id: int, modality: str, data: common_pb2.Payload
    ) -> None: ...

    def fail(self, request_id: str, error: OmniError) -> None: ...


@dataclass(slots=True)
class RequestState:
    meta: mesh_pb2.RequestMeta
    traceparent: str
    # Received payloads and their acks; released once the result has been sent on.
    holds: list[tuple[ReceivedPayload, AckFn | None]] = field(default_factory=list)
    arrived: dict[str, Any] = field(default_factory=dict)
    active: frozenset[str] | None = None
    submitted: bool = False
    streams: InStreams = field(default_factory=InStreams)
    # Streams out to the client: next chunk id.
    client_chunks: int = 0
    # Tracing and metrics: this stage's span for the request (None when unsampled or
    # off), when the request went to the scheduler and the message it went in (its
    # `taken_ns` ends the queue wait), and stream counts.
    span: Span | None = None
    submitted_ns: int = 0
    new_msg: IncomingMessage | None = None
    chunks_in: int = 0
    chunks_out: int = 0

    def release(self) -> None:
        """Releases the held payloads (acking them) and the stream input held early."""
        for received, ack in self.holds:
            received.release()
            if ack is not None:
                ack(None)
        self.holds.clear()
        # Held chunks never reach the scheduler now: return their credit here.
        for msg in self.streams.early:
            if msg.on_taken is not None:
                msg.on_taken()
        self.streams.early.clear()


class Pending:
    """The type of `PENDING`: fan-in still waits for inputs."""

    __slots__ = ()


PENDING = Pending()


def as_error(exc: BaseException, stage: str) -> OmniError:
    """`exc` as an OmniError of `stage` (an OmniError keeps its code; others are INTERNAL)."""
    if isinstance(exc, OmniError):
        if not exc.stage:
            exc.stage = stage
        return exc
    return OmniError(Code.INTERNAL, f"{type(exc).__name__}: {exc}", stage)


def queue_full(stage: str, depth: int, max_queue: int) -> OmniError:
    """The refusal of a request that finds `max_queue` requests waiting at `stage`:
    queueing it would only make it miss its deadline."""
    return OmniError(
        Code.RESOURCE_EXHAUSTED,
        f"stage {stage!r} is overloaded: {depth} requests wait in its queue "
        f"(stages[{stage}].max_queue is {max_queue}); retry later",
        stage,
    )
