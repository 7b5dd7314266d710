"""The local span file format: length-prefixed msgpack records of span tuples.

Spans that stay on this host (`omnirail up` without an OTLP endpoint, read back by
`omnirail trace`) skip OTLP protobuf: packing a span as a msgpack tuple costs about a
third of building its protobuf message, and the exporter thread shares the CPU with the
services it traces. A record is `[FORMAT, resource, scope, [span, ...]]`; a span is

    [name, trace_id (16 bytes), span_id, parent_span_id, kind, start_ns, end_ns,
     attributes | None, events | None, links | None, status_code, status_message,
     children | None]

with events `[name, time_ns, attributes]`, links `[trace_id, span_id, sampled]` and
children `[name, span_id, start_ns, end_ns, attributes | None]` (INTERNAL, parent: the
span). Decoded spans are the same dicts `otlp.decode_request` makes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import msgpack

from omnirail.telemetry.tracer import KIND_INTERNAL, Span

FORMAT = "omnirail-spans/1"
# msgpack's fixarray of 4 elements: how every record of this format starts (OTLP
# protobuf records start with 0x0a), so readers can tell the two apart.
MARKER = 0x94
_STATUS = {0: "unset", 1: "ok", 2: "error"}


def _span(span: Span) -> list[Any]:
    return [
        span.name,
        span.context.trace_id.to_bytes(16, "big"),
        span.context.span_id,
        span.parent_span_id,
        span.kind,
        span.start_ns,
        span.end_ns,
        span.attributes or None,
        span.events or None,
        [(lk.trace_id.to_bytes(16, "big"), lk.span_id, lk.sampled) for lk in span.links]
        if span.links
        else None,
        span.status_code,
        span.status_message,
        span.children or None,
    ]


def pack_spans(spans: list[Span], resource: Mapping[str, Any], scope: str) -> bytes:
    """One record holding `spans` (and their children)."""
    return msgpack.packb([FORMAT, dict(resource), scope, [_span(s) for s in spans]])


def unpack_spans(data: bytes) -> Iterator[dict[str, Any]]:
    """The spans of one record as dicts; raises ValueError for anything else."""
    try:
        record = msgpack.unpackb(data, strict_map_key=False)
        fmt, resource, _scope, spans = record
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError) as exc:
        raise ValueError(f"not a span record: {exc}") from None
    if fmt != FORMAT:
        raise ValueError(f"unknown span record format {fmt!r}")
    service = str(resource.get("service.name", ""))
    for s in spans:
        (name, trace_id, span_id, parent, kind, start, end, attrs, events, links,
         status, message, children) = s  # fmt: skip
        trace_hex = trace_id.hex()
        span_hex = f"{span_id:016x}"
        yield {
            "service": service,
            "name": name,
            "kind": kind,
            "trace_id": trace_hex,
            "span_id": span_hex,
            "parent_span_id": f"{parent:016x}" if parent else "",
            "start_ns": start,
            "end_ns": end,
            "attributes": attrs or {},
            "events": [
                {"name": n, "time_ns": t, "attributes": a or {}} for n, t, a in events or ()
            ],
            "links": [{"trace_id": t.hex(), "span_id": f"{i:016x}"} for t, i, _ in links or ()],
            "status": _STATUS.get(status, str(status)),
            "status_message": message,
        }
        for c_name, c_id, c_start, c_end, c_attrs in children or ():
            yield {
                "service": service,
                "name": c_name,
                "kind": KIND_INTERNAL,
                "trace_id": trace_hex,
                "span_id": f"{c_id:016x}",
                "parent_span_id": span_hex,
                "start_ns": c_start,
                "end_ns": c_end,
                "attributes": c_attrs or {},
                "events": [],
                "links": [],
                "status": "unset",
                "status_message": "",
            }
