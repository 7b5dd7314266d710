"""A stage's tracing and metrics: what `Stage` records at each point of a request.

`StageObserver` owns the stage's `Tracer`, its span name and its bound `StageRecorder`.
The stage calls one small method wherever a request's span, a child span, an event, a
link or a metric is recorded. Timestamps the stage takes around its IO are passed in;
span methods do nothing (and make no clock calls) for requests without a span.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from omnirail.stage.scheduler import OutgoingMessage
from omnirail.stage_service.request_state import RequestState
from omnirail.telemetry.metrics import StageMetrics
from omnirail.telemetry.tracer import STATUS_OK, Tracer, parse_traceparent
from omnirail.v1 import common_pb2, mesh_pb2
from omnirail.wire.errors import OmniError
from omnirail.wire.payload import Packed


class StageObserver:
    __slots__ = ("_fan_in", "_metrics", "_name", "_span_name", "_tracer", "tracing")

    def __init__(
        self,
        name: str,
        tracer: Tracer | None,
        metrics: StageMetrics | None,
        *,
        queue_depth: Callable[[], int],
        inflight: Callable[[], int],
        fan_in: bool,
        held: Callable[[], int] | None = None,
        engine: Callable[[], object] | None = None,
        conversations: Callable[[], object] | None = None,
    ) -> None:
        self._name = name
        self._fan_in = fan_in  # the stage waits for several producers: link them all
        self._tracer = tracer or Tracer()
        self._span_name = f"stage {name}"
        # Whether requests get spans at all; checked before `open_span`.
        self.tracing = self._tracer.enabled
        self._metrics = (metrics or StageMetrics()).stage(
            name,
            queue_depth=queue_depth,
            inflight=inflight,
            held=held,
            engine=engine,
            conversations=conversations,
        )

    def open_span(
        self, req: RequestState, item: mesh_pb2.DeliverItem, start_ns: int | None
    ) -> None:
        """Starts the stage's span for a request from its first item (when sampled)."""
        span = self._tracer.start(
            self._span_name,
            parse_traceparent(item.traceparent),
            {"omnirail.request_id": item.request_id, "omnirail.stage": self._name},
            start_ns=start_ns,
        )
        if span is not None:
            req.span = span
            req.traceparent = span.traceparent  # downstream spans are children of ours

    # ---- input ---------------------------------------------------------------

    def relay_get(self, desc: common_pb2.RelayDescriptor, source: str, get_ns: int) -> int:
        """Metrics of a relay read that started at `get_ns`; returns when it ended (unix
        ns), the end of its `relay.get` span."""
        end_ns = time.time_ns()
        self._metrics.relay_get(desc.backend, source, desc.nbytes, (end_ns - get_ns) / 1e9)
        return end_ns

    def received(
        self,
        req: RequestState,
        item: mesh_pb2.DeliverItem,
        source: str,
        get_ns: int,
        got_ns: int,
    ) -> None:
        """An input payload arrived: the fan-in link, and for a relayed one (`got_ns` set)
        the `relay.get` child from `get_ns` to `got_ns`."""
        span = req.span
        if span is None:
            return
        if self._fan_in:  # fan-in: the span links every producer
            span.link(parse_traceparent(item.traceparent))
        if got_ns:
            desc = item.payload.relay
            self._tracer.record(
                "relay.get",
                span,
                get_ns,
                got_ns,
                {
                    "omnirail.relay.backend": desc.backend,
                    "omnirail.relay.bytes": desc.nbytes,
                    "omnirail.edge": f"{source}->{self._name}",
                },
            )

    def chunk_in(self, req: RequestState, source: str) -> None:
        req.chunks_in += 1
        if req.chunks_in == 1 and req.span is not None:
            req.span.event("first_chunk_in", {"omnirail.source": source})

    # ---- output --------------------------------------------------------------

    def computed(self, req: RequestState, msg: OutgoingMessage) -> None:
        """Queue wait and compute of the result `msg` (metrics, and child spans)."""
        new = req.new_msg
        if new is None or not new.taken_ns:
            return
        done_ns = msg.created_ns or time.time_ns()
        self._metrics.computed(req.submitted_ns, new.taken_ns, done_ns)
        span = req.span
        if span is not None:
            self._tracer.record("queue", span, req.submitted_ns, new.taken_ns)
            self._tracer.record("compute", span, new.taken_ns, done_ns)

    def sent(self, req: RequestState, send_ns: int) -> None:
        """The `send` child: handing the result on, from `send_ns` until now."""
        if req.span is not None:
            self._tracer.record("send", req.span, send_ns, time.time_ns())

    def relay_put(
        self,
        req: RequestState | None,
        target: str,
        backend: str,
        packed: Packed,
        put_ns: int,
        forwarded: bool = False,
    ) -> None:
        """A payload was put into `backend` for `target`, starting at `put_ns`
        (`forwarded`: bytes this stage received were handed on, not copied). `req`: the
        request of a result, whose span records the put; None for a stream chunk (its
        puts are counted, not traced)."""
        end_ns = time.time_ns()
        self._metrics.relay_put(backend, target, packed.nbytes, (end_ns - put_ns) / 1e9)
        if req is not None and req.span is not None:
            attrs = {
                "omnirail.relay.backend": backend,
                "omnirail.relay.bytes": packed.nbytes,
                "omnirail.edge": f"{self._name}->{target}",
            }
            if forwarded:
                attrs["omnirail.relay.forwarded"] = True
            self._tracer.record("relay.put", req.span, put_ns, end_ns, attrs)

    def chunk_out(self, req: RequestState) -> None:
        req.chunks_out += 1
        if req.chunks_out == 1 and req.span is not None:
            req.span.event("first_chunk_out")

    # ---- endings -------------------------------------------------------------

    def ended(self, req: RequestState, outcome: str) -> None:
        """The request ended here: its outcome, and the span finishes."""
        self._metrics.ended(outcome)
        span = req.span
        if span is not None:
            if req.chunks_in:
                span.set("omnirail.stream.chunks_in", req.chunks_in)
            if req.chunks_out:
                span.set("omnirail.stream.chunks_out", req.chunks_out)
            if not span.status_code:
                span.status_code = STATUS_OK
            span.end()

    def failed(self, req: RequestState, error: OmniError) -> None:
        if req.span is not None:
            req.span.error(f"{error.code_name}: {error.message}")

    def aborted(self, req: RequestState, reason: str) -> None:
        if req.span is not None and not req.span.status_code:
            req.span.error(f"aborted: {reason}" if reason else "aborted")
