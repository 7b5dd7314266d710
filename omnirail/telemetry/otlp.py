"""OTLP protobuf for spans: `Span` records to `ExportTraceServiceRequest` and back to dicts.

Encoding builds messages with `.add()` and field assignment: constructing nested messages
with keyword lists costs about twice as much per span.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from omnirail.telemetry.tracer import KIND_INTERNAL, Span

_STATUS_NAMES = {0: "unset", 1: "ok", 2: "error"}


def _set_value(value: AnyValue, v: Any) -> None:
    t = type(v)
    # bool before int: bool is an int subclass, and `type` keeps them apart.
    if t is str:
        value.string_value = v
    elif t is bool:
        value.bool_value = v
    elif t is int:
        try:
            value.int_value = v
        except ValueError:  # beyond int64
            value.string_value = str(v)
    elif t is float:
        value.double_value = v
    elif isinstance(v, (list, tuple)):
        array = value.array_value
        for item in v:
            _set_value(array.values.add(), item)
    elif isinstance(v, bytes):
        value.bytes_value = v
    else:
        value.string_value = str(v)


def _add_attributes(target: Any, attributes: Mapping[str, Any]) -> None:
    add = target.add
    for key, v in attributes.items():
        kv = add()
        kv.key = key
        _set_value(kv.value, v)


def encode(
    spans: list[Span], resource: Mapping[str, Any], scope: str = "omnirail"
) -> ExportTraceServiceRequest:
    """One OTLP request holding `spans` under one resource and instrumentation scope."""
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    _add_attributes(resource_spans.resource.attributes, resource)
    scope_spans = resource_spans.scope_spans.add()
    scope_spans.scope.name = scope
    add = scope_spans.spans.add
    for span in spans:
        s = add()
        ctx = span.context
        s.trace_id = ctx.trace_id.to_bytes(16, "big")
        s.span_id = ctx.span_id.to_bytes(8, "big")
        if span.parent_span_id:
            s.parent_span_id = span.parent_span_id.to_bytes(8, "big")
        s.flags = 1  # only sampled spans are ever recorded
        s.name = span.name
        s.kind = span.kind
        s.start_time_unix_nano = span.start_ns
        s.end_time_unix_nano = span.end_ns
        if span.attributes:
            _add_attributes(s.attributes, span.attributes)
        for name, time_ns, attrs in span.events:
            e = s.events.add()
            e.name = name
            e.time_unix_nano = time_ns
            if attrs:
                _add_attributes(e.attributes, attrs)
        for link in span.links:
            lk = s.links.add()
            lk.trace_id = link.trace_id.to_bytes(16, "big")
            lk.span_id = link.span_id.to_bytes(8, "big")
            lk.flags = 1 if link.sampled else 0
        if span.status_code:
            s.status.code = span.status_code
            if span.status_message:
                s.status.message = span.status_message
        if span.children:
            trace_id, parent_id = s.trace_id, s.span_id
            for name, span_id, start_ns, end_ns, attributes in span.children:
                c = add()
                c.trace_id = trace_id
                c.span_id = span_id.to_bytes(8, "big")
                c.parent_span_id = parent_id
                c.flags = 1
                c.name = name
                c.kind = KIND_INTERNAL
                c.start_time_unix_nano = start_ns
                c.end_time_unix_nano = end_ns
                if attributes:
                    _add_attributes(c.attributes, attributes)
    return request


def _value_of(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [_value_of(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value_of(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, which)


def _attributes_of(kvs: Iterable[Any]) -> dict[str, Any]:
    return {kv.key: _value_of(kv.value) for kv in kvs}


def decode_request(request: ExportTraceServiceRequest) -> Iterator[dict[str, Any]]:
    """The spans of an OTLP request as plain dicts (see `read_span_files`)."""
    for resource_spans in request.resource_spans:
        resource = _attributes_of(resource_spans.resource.attributes)
        service = str(resource.get("service.name", ""))
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                yield {
                    "service": service,
                    "name": s.name,
                    "kind": s.kind,
                    "trace_id": s.trace_id.hex(),
                    "span_id": s.span_id.hex(),
                    "parent_span_id": s.parent_span_id.hex(),
                    "start_ns": s.start_time_unix_nano,
                    "end_ns": s.end_time_unix_nano,
                    "attributes": _attributes_of(s.attributes),
                    "events": [
                        {
                            "name": e.name,
                            "time_ns": e.time_unix_nano,
                            "attributes": _attributes_of(e.attributes),
                        }
                        for e in s.events
                    ],
                    "links": [
                        {"trace_id": lk.trace_id.hex(), "span_id": lk.span_id.hex()}
                        for lk in s.links
                    ],
                    "status": _STATUS_NAMES.get(s.status.code, str(s.status.code)),
                    "status_message": s.status.message,
                }
