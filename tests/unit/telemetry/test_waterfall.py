"""Tests for omnirail.telemetry.waterfall: finding a request's trace and drawing it."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

import pytest

from omnirail.telemetry.export import FileSink, encode
from omnirail.telemetry.tracer import KIND_SERVER, SpanContext, Tracer
from omnirail.telemetry.waterfall import (
    find_trace,
    format_waterfall,
    run_trace,
    waterfall_json,
)

T0 = 1_700_000_000_000_000_000
MS = 1_000_000
TRACE_A = "a" * 32
TRACE_B = "b" * 32


def mk(
    name: str,
    span_id: str,
    parent: str,
    start_ms: float,
    dur_ms: float,
    service: str = "omnirail-coordinator",
    trace_id: str = TRACE_A,
    status: str = "unset",
    message: str = "",
    request_id: str | None = None,
) -> dict[str, Any]:
    return {
        "service": service,
        "name": name,
        "kind": 1,
        "trace_id": trace_id,
        "span_id": span_id,
        "parent_span_id": parent,
        "start_ns": T0 + int(start_ms * MS),
        "end_ns": T0 + int((start_ms + dur_ms) * MS),
        "attributes": {"omnirail.request_id": request_id} if request_id else {},
        "events": [],
        "links": [],
        "status": status,
        "status_message": message,
    }


def hand_made() -> list[dict[str, Any]]:
    """A request r1 (the client's span, 'c1', is not in the set) and an unrelated r2."""
    thinker, talker = "omnirail-stage-thinker", "omnirail-stage-talker"
    return [
        mk("stage.deliver", "22", "11", 5, 4, talker),  # listed before its parent
        mk("request", "11", "c1", 0, 10, request_id="r1"),
        mk("stage.compute", "33", "21", 2, 2, thinker, status="error", message="oom"),
        mk("stage.deliver", "21", "11", 1, 4, thinker, status="ok"),
        mk("request", "99", "", 0, 50, trace_id=TRACE_B, request_id="r2"),
    ]


def test_find_trace_takes_every_span_of_the_trace() -> None:
    spans = hand_made()
    found = find_trace(spans, "r1")
    assert sorted(s["span_id"] for s in found) == ["11", "21", "22", "33"]
    assert [s["span_id"] for s in find_trace(spans + spans, "r2")] == ["99"]  # deduplicated
    assert find_trace(spans, "nope") == []


def test_waterfall_json_order_depth_offsets() -> None:
    rows = waterfall_json(find_trace(hand_made(), "r1"))
    assert [(r["span_id"], r["depth"]) for r in rows] == [
        ("11", 0),
        ("21", 1),
        ("33", 2),
        ("22", 1),
    ]
    assert [r["start_offset_ms"] for r in rows] == [0.0, 1.0, 2.0, 5.0]
    assert [r["duration_ms"] for r in rows] == [10.0, 4.0, 2.0, 4.0]
    assert rows[2]["status"] == "error" and rows[2]["status_message"] == "oom"
    assert rows[0]["attributes"] == {"omnirail.request_id": "r1"}
    assert rows[0]["parent_span_id"] == "c1"  # an orphan: its parent lives elsewhere
    assert waterfall_json([]) == []


def test_format_waterfall_lines() -> None:
    text = format_waterfall(find_trace(hand_made(), "r1"))
    lines = text.splitlines()
    assert lines[0] == f"trace {TRACE_A}: 4 spans, 10.000 ms"
    assert lines[1].split()[:2] == ["service", "span"]
    body = lines[2:]
    assert len(body) == 4
    # Names are indented two spaces per level, after a service column of equal width.
    col = body[0].index("request")
    assert [re.match(r" *\S+", line[col:]).group(0) for line in body] == [  # type: ignore[union-attr]
        "request",
        "  stage.deliver",
        "    stage.compute",
        "  stage.deliver",
    ]
    assert body[1].startswith("omnirail-stage-thinker")
    assert body[3].startswith("omnirail-stage-talker")
    numbers = [re.findall(r"\d+\.\d{3}", line) for line in body]
    assert numbers == [
        ["0.000", "10.000"],
        ["1.000", "4.000"],
        ["2.000", "2.000"],
        ["5.000", "4.000"],
    ]
    bars = [re.search(r"\|[ #]+\|", line).group(0) for line in body]  # type: ignore[union-attr]
    assert bars[0] == "|" + "#" * 40 + "|"
    assert bars[1] == "|" + " " * 4 + "#" * 16 + " " * 20 + "|"
    assert bars[3] == "|" + " " * 20 + "#" * 16 + " " * 4 + "|"
    assert body[2].endswith("error: oom") and body[1].endswith("ok")
    assert format_waterfall([]) == "(no spans)\n"


def test_zero_length_spans_and_parent_cycles_still_draw() -> None:
    spans = [
        mk("instant", "1", "", 0, 0),
        mk("x", "2", "3", 0, 1),  # 2 and 3 are each other's parent: never reached from a root
        mk("y", "3", "2", 0, 1),
    ]
    rows = waterfall_json(spans)
    assert sorted(r["span_id"] for r in rows) == ["1", "2", "3"]
    assert "#" in format_waterfall(spans).splitlines()[2]


def write_spans(span_dir: Path) -> str:
    """Two processes' span files holding one request; returns its request id."""
    tracer = Tracer(lambda s: None)
    client = SpanContext(0xC0FFEE, 0xC1, True)
    root = tracer.start("coordinator.request", client, {"omnirail.request_id": "r-7"}, kind=2)
    assert root is not None
    root.end(root.start_ns + 8 * MS)
    child = tracer.start("stage.compute", root, start_ns=root.start_ns + MS)
    assert child is not None
    child.error("boom")
    child.end(root.start_ns + 3 * MS)
    for service, span in (("omnirail-coordinator", root), ("omnirail-stage-a", child)):
        sink = FileSink(span_dir / f"{service}-1.otlp")
        sink.export(encode([span], {"service.name": service}))
        sink.close()
    return "r-7"


def test_run_trace_text_and_json(tmp_path: Path) -> None:
    request_id = write_spans(tmp_path / "spans")
    out = io.StringIO()
    assert run_trace(request_id, [str(tmp_path / "spans")], False, out=out) == 0
    lines = out.getvalue().splitlines()
    assert "coordinator.request" in lines[2] and lines[2].startswith("omnirail-coordinator")
    assert "  stage.compute" in lines[3] and lines[3].endswith("error: boom")
    out = io.StringIO()
    # The same dir twice reads each file once.
    assert run_trace(request_id, [str(tmp_path / "spans")] * 2, True, out=out) == 0
    rows = json.loads(out.getvalue())
    assert [(r["name"], r["depth"]) for r in rows] == [
        ("coordinator.request", 0),
        ("stage.compute", 1),
    ]
    assert rows[1]["start_offset_ms"] == 1.0 and rows[1]["duration_ms"] == 2.0
    assert rows[0]["parent_span_id"] == f"{0xC1:016x}"


def test_run_trace_not_found(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_spans(tmp_path / "spans")
    dirs = [str(tmp_path / "spans"), str(tmp_path / "missing")]
    out = io.StringIO()
    assert run_trace("other", dirs, False, out=out) == 1
    err = capsys.readouterr().err
    assert out.getvalue() == ""
    assert "'other'" in err and "2 span files" in err
    assert dirs[0] in err and dirs[1] in err


def test_kind_constant_matches_otlp() -> None:
    assert KIND_SERVER == 2
