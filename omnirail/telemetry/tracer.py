"""Span recording on the request path: W3C trace context in, small span records out.

Why not the SDK's span API: on this machine kind a span through `Tracer.start_span`, a
`BatchSpanProcessor` and the OTLP exporter costs 35-55 µs of CPU, and a request makes a
dozen spans across the mesh, more than the rest of its CPU. Here a span is a slotted
record (about 1-2 µs to make and finish); the exporter thread encodes batches straight to
OTLP protobuf (about 4 µs per span, see `omnirail.telemetry.export`). The SDK still
decides what it is good at: the sampler (`OTEL_TRACES_SAMPLER`, `..._ARG`) and the
resource (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`).

Context crosses processes as a W3C `traceparent` string inside each Deliver/Attach item.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

# OTLP span kinds and status codes (opentelemetry/proto/trace/v1/trace.proto).
KIND_INTERNAL, KIND_SERVER, KIND_CLIENT = 1, 2, 3
STATUS_UNSET, STATUS_OK, STATUS_ERROR = 0, 1, 2

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_rand = random.Random()


class SpanContext:
    """Trace id, span id and the sampled flag: what a traceparent carries."""

    __slots__ = ("_traceparent", "sampled", "span_id", "trace_id")

    def __init__(self, trace_id: int, span_id: int, sampled: bool) -> None:
        self.trace_id = trace_id
        self.span_id = span_id
        self.sampled = sampled
        self._traceparent = ""

    @property
    def traceparent(self) -> str:
        if not self._traceparent:  # every item of the request carries it: format once
            flags = "01" if self.sampled else "00"
            self._traceparent = f"00-{self.trace_id:032x}-{self.span_id:016x}-{flags}"
        return self._traceparent


def parse_traceparent(value: str | None) -> SpanContext | None:
    """The context in a W3C traceparent header; None when absent or malformed."""
    if not value:
        return None
    m = _TRACEPARENT.fullmatch(value)  # the form every peer of ours sends
    if m is None:
        m = _TRACEPARENT.fullmatch(value.strip().lower())
        if m is None:
            return None
    version, trace_hex, span_hex, flags = m.group(1, 2, 3, 4)
    if version == "ff":
        return None
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if not trace_id or not span_id:
        return None
    return SpanContext(trace_id, span_id, bool(int(flags, 16) & 1))


class Span:
    """One finished or running span; `end` hands it to the exporter."""

    __slots__ = (
        "_sink",
        "attributes",
        "children",
        "context",
        "end_ns",
        "events",
        "kind",
        "links",
        "name",
        "parent_span_id",
        "start_ns",
        "status_code",
        "status_message",
    )

    def __init__(
        self,
        sink: Callable[[Span], None],
        name: str,
        context: SpanContext,
        parent_span_id: int,
        kind: int,
        start_ns: int,
        attributes: dict[str, Any],
    ) -> None:
        self._sink = sink
        self.name = name
        self.context = context
        self.parent_span_id = parent_span_id
        self.kind = kind
        self.start_ns = start_ns
        self.end_ns = 0
        self.attributes = attributes
        # Empty tuples until first used: most spans never get an event or a link.
        self.events: list[tuple[str, int, dict[str, Any]]] | tuple[()] = ()
        self.links: list[SpanContext] | tuple[()] = ()
        self.status_code = STATUS_UNSET
        self.status_message = ""
        # Finished children recorded with `Tracer.record`, exported with this span:
        # (name, span_id, start_ns, end_ns, attributes).
        self.children: list[tuple[str, int, int, int, dict[str, Any] | None]] | tuple[()] = ()

    @property
    def traceparent(self) -> str:
        return self.context.traceparent

    def set(self, key: str, value: Any) -> None:
        self.attributes[key] = value

    def event(self, name: str, attributes: dict[str, Any] | None = None) -> None:
        if not self.events:
            self.events = []
        self.events.append((name, time.time_ns(), attributes or {}))  # type: ignore[union-attr]

    def link(self, context: SpanContext | None) -> None:
        if context is not None:
            if not self.links:
                self.links = []
            self.links.append(context)  # type: ignore[union-attr]

    def error(self, message: str) -> None:
        self.status_code = STATUS_ERROR
        self.status_message = message

    def end(self, end_ns: int | None = None) -> None:
        """Finishes the span (once) and queues it for export."""
        if self.end_ns:
            return
        self.end_ns = end_ns or time.time_ns()
        self._sink(self)


class Tracer:
    """Makes spans for one process. Disabled (every call returns None) without a sink."""

    def __init__(
        self,
        sink: Callable[[Span], None] | None = None,
        root_sampler: Callable[[SpanContext | None, int, str], bool] | None = None,
    ) -> None:
        self._sink = sink
        self._root_sampler = root_sampler
        self.enabled = sink is not None

    def start(
        self,
        name: str,
        parent: SpanContext | Span | None,
        attributes: dict[str, Any] | None = None,
        *,
        kind: int = KIND_INTERNAL,
        start_ns: int | None = None,
        root: bool = False,
    ) -> Span | None:
        """A new span under `parent`; None when tracing is off or the trace unsampled.

        Spans follow their parent's sampled flag. With `root`, a request enters the mesh
        here and the sampler decides (it sees the caller's context, if any).
        """
        if self._sink is None:
            return None
        ctx = parent.context if isinstance(parent, Span) else parent
        trace_id = ctx.trace_id if ctx is not None else _rand.getrandbits(128) or 1
        if root and self._root_sampler is not None:
            sampled = self._root_sampler(ctx, trace_id, name)
        else:
            sampled = ctx.sampled if ctx is not None else True
        if not sampled:
            return None
        context = SpanContext(trace_id, _rand.getrandbits(64) or 1, True)
        return Span(
            self._sink,
            name,
            context,
            ctx.span_id if ctx is not None else 0,
            kind,
            start_ns or time.time_ns(),
            attributes if attributes is not None else {},
        )

    def record(
        self,
        name: str,
        parent: Span | None,
        start_ns: int,
        end_ns: int,
        attributes: dict[str, Any] | None = None,
    ) -> int:
        """A finished child of `parent` with known start and end (queue wait, compute, ...).

        Returns its span id (0 when not recorded). Children ride with their parent to the
        exporter as plain tuples: a stage records several per request, and a span object
        and queue hop each would cost more than the rest of their tracing.
        """
        if parent is None or self._sink is None:
            return 0
        span_id = _rand.getrandbits(64) or 1
        end_ns = max(end_ns, start_ns)  # clocks step; a span never ends before it starts
        if not parent.end_ns:
            if not parent.children:
                parent.children = []
            parent.children.append((name, span_id, start_ns, end_ns, attributes))  # type: ignore[union-attr]
            return span_id
        late = Span(  # the parent has gone to the exporter already: send this one alone
            self._sink,
            name,
            SpanContext(parent.context.trace_id, span_id, True),
            parent.context.span_id,
            KIND_INTERNAL,
            start_ns,
            attributes if attributes is not None else {},
        )
        late.end(end_ns)
        return span_id


def sdk_root_sampler() -> Callable[[SpanContext | None, int, str], bool]:
    """The sampler the OTEL_TRACES_SAMPLER variables configure, as a plain predicate."""
    from opentelemetry import trace as otel_trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import Decision

    sampler = TracerProvider().sampler

    def should_sample(parent: SpanContext | None, trace_id: int, name: str) -> bool:
        ctx = None
        if parent is not None:
            remote = otel_trace.NonRecordingSpan(
                otel_trace.SpanContext(
                    parent.trace_id,
                    parent.span_id,
                    is_remote=True,
                    trace_flags=otel_trace.TraceFlags(1 if parent.sampled else 0),
                )
            )
            ctx = otel_trace.set_span_in_context(remote)
        result = sampler.should_sample(ctx, trace_id, name)
        return result.decision == Decision.RECORD_AND_SAMPLE

    return should_sample


def attributes_of(items: Mapping[str, Any]) -> dict[str, Any]:
    """Span attributes keep str, bool, int and float values; anything else as str."""
    return {k: v if isinstance(v, (str, bool, int, float)) else str(v) for k, v in items.items()}
