"""The client SDK's own span: a CLIENT span in the caller's OpenTelemetry setup.

When the application has configured an OpenTelemetry SDK, each request gets a span
`omnirail <method>` under the caller's current span, and its W3C traceparent goes to the
coordinator, so one trace runs from the caller through every stage. Without an SDK the
API hands out non-recording spans and nothing is propagated (an explicit `traceparent`
argument always wins).
"""

from __future__ import annotations

from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

_tracer = trace.get_tracer("omnirail.client.sdk")


class ClientSpan:
    """Wraps one request's client span; `traceparent` is what to send (or None)."""

    __slots__ = ("_span", "traceparent")

    def __init__(self, method: str, request_id: str, explicit: str | None) -> None:
        self._span: Any = None
        self.traceparent = explicit
        if explicit:
            return
        span = _tracer.start_span(
            f"omnirail {method}",
            kind=SpanKind.CLIENT,
            attributes={"omnirail.request_id": request_id, "rpc.system": "grpc"},
        )
        if not span.get_span_context().is_valid:
            return
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        self._span = span
        self.traceparent = carrier.get("traceparent")

    def end(self, error: BaseException | None = None) -> None:
        span, self._span = self._span, None
        if span is None:
            return
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, str(error)))
        span.end()
