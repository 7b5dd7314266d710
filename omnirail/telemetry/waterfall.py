"""`omnirail trace`: one request's spans from a local mesh's span files, as a waterfall.

Spans are the dicts of `omnirail.telemetry.export.read_span_files`. A request is found by
its `omnirail.request_id` attribute; the waterfall then shows every span of its trace(s),
including the spans of stages that never saw the request id.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TextIO

from omnirail.telemetry.export import read_span_files

REQUEST_ID_ATTR = "omnirail.request_id"
BAR_WIDTH = 40


def find_trace(spans: Iterable[dict[str, Any]], request_id: str) -> list[dict[str, Any]]:
    """Every span of every trace holding a span with `omnirail.request_id == request_id`."""
    seen: set[tuple[str, str]] = set()
    unique = []
    traces = set()
    for span in spans:
        key = (span["trace_id"], span["span_id"])
        if key in seen:  # the same file read twice
            continue
        seen.add(key)
        unique.append(span)
        if span["attributes"].get(REQUEST_ID_ATTR) == request_id:
            traces.add(span["trace_id"])
    return [s for s in unique if s["trace_id"] in traces]


def _tree(spans: Iterable[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """(depth, span) with children after their parent, siblings by start time.

    A span whose parent is not in the set (the client's span lives in another process)
    sits at the top level.
    """
    spans = list(spans)
    by_id = {(s["trace_id"], s["span_id"]): s for s in spans}
    children: dict[tuple[str, str], list[dict[str, Any]]] = {}
    roots = []
    for s in spans:
        parent = (s["trace_id"], s["parent_span_id"])
        if s["parent_span_id"] and parent in by_id and parent != (s["trace_id"], s["span_id"]):
            children.setdefault(parent, []).append(s)
        else:
            roots.append(s)

    def order(s: dict[str, Any]) -> tuple[int, int, str]:
        return (s["start_ns"], -s["end_ns"], s["name"])

    out: list[tuple[int, dict[str, Any]]] = []
    done: set[tuple[str, str]] = set()

    def walk(top: list[dict[str, Any]]) -> None:
        stack = [(0, s) for s in sorted(top, key=order, reverse=True)]
        while stack:
            depth, s = stack.pop()
            key = (s["trace_id"], s["span_id"])
            if key in done:
                continue
            done.add(key)
            out.append((depth, s))
            kids = sorted(children.get(key, ()), key=order, reverse=True)
            stack.extend((depth + 1, k) for k in kids)

    walk(roots)
    # Spans caught in a parent cycle (corrupt ids) are never reached from a root.
    walk([s for s in spans if (s["trace_id"], s["span_id"]) not in done])
    return out


def _bounds(spans: list[dict[str, Any]]) -> tuple[int, int]:
    t0 = min(s["start_ns"] for s in spans)
    t1 = max(max(s["end_ns"], s["start_ns"]) for s in spans)
    return t0, t1


def _status(span: dict[str, Any]) -> str:
    if span["status"] == "error":
        return f"error: {span['status_message']}" if span["status_message"] else "error"
    return "ok" if span["status"] == "ok" else ""


def waterfall_json(spans: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The waterfall rows as dicts, in display order."""
    spans = list(spans)
    if not spans:
        return []
    t0, _ = _bounds(spans)
    return [
        {
            "service": s["service"],
            "name": s["name"],
            "trace_id": s["trace_id"],
            "span_id": s["span_id"],
            "parent_span_id": s["parent_span_id"],
            "depth": depth,
            "start_offset_ms": (s["start_ns"] - t0) / 1e6,
            "duration_ms": max(0, s["end_ns"] - s["start_ns"]) / 1e6,
            "status": s["status"],
            "status_message": s["status_message"],
            "attributes": s["attributes"],
        }
        for depth, s in _tree(spans)
    ]


def _bar(start: int, end: int, t0: int, t1: int, width: int = BAR_WIDTH) -> str:
    total = max(t1 - t0, 1)
    a = min(width - 1, int((start - t0) * width / total))
    b = max(a + 1, min(width, math.ceil((end - t0) * width / total)))
    return "|" + " " * a + "#" * (b - a) + " " * (width - b) + "|"


def format_waterfall(spans: Iterable[dict[str, Any]]) -> str:
    """A text waterfall: service, indented span name, start offset and duration (ms),
    a bar placing the span within the request's time range, and status."""
    spans = list(spans)
    if not spans:
        return "(no spans)\n"
    t0, t1 = _bounds(spans)
    rows = _tree(spans)
    header = ("service", "span", "start ms", "dur ms", "timeline", "status")
    table = [
        (
            s["service"],
            "  " * depth + s["name"],
            f"{(s['start_ns'] - t0) / 1e6:.3f}",
            f"{max(0, s['end_ns'] - s['start_ns']) / 1e6:.3f}",
            _bar(s["start_ns"], max(s["end_ns"], s["start_ns"]), t0, t1),
            _status(s),
        )
        for depth, s in rows
    ]
    widths = [max(len(r[i]) for r in [header, *table]) for i in range(5)]
    traces = sorted({s["trace_id"] for s in spans})
    lines = [
        f"trace {', '.join(traces)}: {len(spans)} spans, {(t1 - t0) / 1e6:.3f} ms",
    ]
    for r in [header, *table]:
        line = "  ".join(
            [
                r[0].ljust(widths[0]),
                r[1].ljust(widths[1]),
                r[2].rjust(widths[2]),
                r[3].rjust(widths[3]),
                r[4].ljust(widths[4]),
                r[5],
            ]
        )
        lines.append(line.rstrip())
    return "\n".join(lines) + "\n"


def run_trace(
    request_id: str,
    span_dirs: list[str],
    as_json: bool,
    out: TextIO | None = None,
) -> int:
    """Prints the waterfall (or JSON rows) of `request_id` from the `*.otlp` files in
    `span_dirs`; 1 with an error on stderr when no span of that request is there."""
    out = out if out is not None else sys.stdout
    files: list[Path] = []
    seen: set[Path] = set()
    for d in span_dirs:
        for f in sorted(Path(d).glob("*.otlp")):
            if f.resolve() not in seen:
                seen.add(f.resolve())
                files.append(f)
    spans = find_trace(read_span_files(files), request_id)
    if not spans:
        where = ", ".join(span_dirs) or "(none)"
        print(
            f"omnirail trace: no spans found for request {request_id!r} "
            f"({len(files)} span files read from: {where}). Spans are written only while "
            "no OTLP endpoint is set; the request may also be unsampled or not yet exported.",
            file=sys.stderr,
        )
        return 1
    if as_json:
        json.dump(waterfall_json(spans), out, indent=2, default=str)
        out.write("\n")
    else:
        out.write(format_waterfall(spans))
    return 0
