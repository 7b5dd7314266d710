"""Tests for omnirail.telemetry.export: OTLP encoding, the exporter thread and the sinks."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from omnirail.telemetry.export import (
    FileSink,
    OtlpGrpcSink,
    SpanExporter,
    decode_request,
    encode,
    read_span_files,
)
from omnirail.telemetry.tracer import (
    KIND_CLIENT,
    KIND_SERVER,
    STATUS_OK,
    Span,
    SpanContext,
    Tracer,
)
from tests.otlp_receiver import OtlpReceiver

TIMEOUT = 60.0  # generous: a busy 2-core machine


def make_spans(n: int, name: str = "s") -> list[Span]:
    tracer = Tracer(lambda s: None)
    return [tracer.start(f"{name}{i}", None) for i in range(n)]  # type: ignore[misc]


def wait_until(cond: Callable[[], bool], timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


class ListSink:
    """Records the span names of each batch; `fail` decides per call."""

    def __init__(self, fail: Callable[[int], bool | None] = lambda call: None) -> None:
        self.batches: list[list[str]] = []
        self.calls = 0
        self.closed = False
        self.fail = fail

    def export(self, request: ExportTraceServiceRequest) -> bool:
        self.calls += 1
        outcome = self.fail(self.calls)
        if outcome is not None:
            return outcome
        self.batches.append([s["name"] for s in decode_request(request)])
        return True

    def close(self) -> None:
        self.closed = True

    def names(self) -> list[str]:
        return [n for b in self.batches for n in b]


# ---- encode ----


def test_encode_fields_exactly() -> None:
    parent = SpanContext(0x0102030405060708090A0B0C0D0E0F10, 0x1112131415161718, True)
    tracer = Tracer(lambda s: None)
    span = tracer.start("child", parent, {"s": "x", "b": True, "i": 7, "f": 1.5}, kind=KIND_CLIENT)
    root = tracer.start("root", None, kind=KIND_SERVER)
    assert span is not None and root is not None
    span.event("evt", {"n": 2})
    span.link(SpanContext(0xAB, 0xCD, False))
    span.error("bad thing")
    span.end(span.start_ns + 5)
    root.status_code = STATUS_OK
    root.end()
    request = encode([span, root], {"service.name": "svc", "pids": [1, 2]}, scope="sc")

    (rs,) = request.resource_spans
    resource = {kv.key: kv.value for kv in rs.resource.attributes}
    assert resource["service.name"].string_value == "svc"
    assert [v.int_value for v in resource["pids"].array_value.values] == [1, 2]
    (ss,) = rs.scope_spans
    assert ss.scope.name == "sc"
    s, r = ss.spans
    assert s.trace_id == bytes(range(1, 17))
    assert s.parent_span_id == bytes(range(0x11, 0x19))
    assert s.span_id == span.context.span_id.to_bytes(8, "big") and len(s.span_id) == 8
    assert s.name == "child" and s.kind == KIND_CLIENT
    assert (s.start_time_unix_nano, s.end_time_unix_nano) == (span.start_ns, span.start_ns + 5)
    attrs = {kv.key: kv.value for kv in s.attributes}
    assert attrs["s"].WhichOneof("value") == "string_value" and attrs["s"].string_value == "x"
    assert attrs["b"].WhichOneof("value") == "bool_value" and attrs["b"].bool_value is True
    assert attrs["i"].WhichOneof("value") == "int_value" and attrs["i"].int_value == 7
    assert attrs["f"].WhichOneof("value") == "double_value" and attrs["f"].double_value == 1.5
    (e,) = s.events
    assert e.name == "evt" and e.time_unix_nano == span.events[0][1]
    assert e.attributes[0].key == "n" and e.attributes[0].value.int_value == 2
    (lk,) = s.links
    assert lk.trace_id == (0xAB).to_bytes(16, "big") and lk.span_id == (0xCD).to_bytes(8, "big")
    assert (s.status.code, s.status.message) == (2, "bad thing")
    assert r.parent_span_id == b"" and r.kind == KIND_SERVER
    assert (r.status.code, r.status.message) == (1, "")
    assert len(r.trace_id) == 16


def test_encode_odd_attribute_values() -> None:
    (span,) = make_spans(1)
    span.attributes.update({"big": 2**70, "obj": object(), "none": None, "raw": b"\x00"})
    request = encode([span], {})
    (d,) = decode_request(request)
    assert d["attributes"]["big"] == str(2**70)  # beyond int64: kept as text
    assert d["attributes"]["obj"].startswith("<object")
    assert d["attributes"]["none"] == "None"
    assert d["attributes"]["raw"] == b"\x00"


def test_children_are_encoded_after_their_parent() -> None:
    tracer = Tracer(lambda s: None)
    root = tracer.start("stage a", None, {"omnirail.stage": "a"})
    assert root is not None
    q = tracer.record("queue", root, root.start_ns + 1, root.start_ns + 2)
    c = tracer.record("compute", root, root.start_ns + 2, root.start_ns + 5, {"k": 1})
    root.end(root.start_ns + 9)
    d_root, d_q, d_c = decode_request(encode([root], {"service.name": "svc"}))
    assert [d["name"] for d in (d_root, d_q, d_c)] == ["stage a", "queue", "compute"]
    for d, span_id in ((d_q, q), (d_c, c)):
        assert d["span_id"] == f"{span_id:016x}"
        assert d["parent_span_id"] == d_root["span_id"]
        assert d["trace_id"] == d_root["trace_id"]
        assert d["kind"] == 1 and d["status"] == "unset"
    assert (d_c["start_ns"] - root.start_ns, d_c["end_ns"] - root.start_ns) == (2, 5)
    assert d_c["attributes"] == {"k": 1} and d_q["attributes"] == {}


def test_decode_round_trip() -> None:
    tracer = Tracer(lambda s: None)
    root = tracer.start("root", None, {"omnirail.request_id": "r1"})
    assert root is not None
    child = tracer.start("child", root, {"k": 0.25}, start_ns=root.start_ns + 1)
    assert child is not None
    child.end(root.start_ns + 9)
    root.event("e")
    root.link(child.context)
    root.end(root.start_ns + 10)
    d_child, d_root = decode_request(encode([child, root], {"service.name": "svc"}))
    assert d_root == {
        "service": "svc",
        "name": "root",
        "kind": 1,
        "trace_id": f"{root.context.trace_id:032x}",
        "span_id": f"{root.context.span_id:016x}",
        "parent_span_id": "",
        "start_ns": root.start_ns,
        "end_ns": root.start_ns + 10,
        "attributes": {"omnirail.request_id": "r1"},
        "events": [{"name": "e", "time_ns": root.events[0][1], "attributes": {}}],
        "links": [{"trace_id": d_child["trace_id"], "span_id": d_child["span_id"]}],
        "status": "unset",
        "status_message": "",
    }
    assert d_child["parent_span_id"] == d_root["span_id"]
    assert d_child["attributes"] == {"k": 0.25}


# ---- SpanExporter ----


def test_exporter_batches_and_flush_exports_everything() -> None:
    sink = ListSink()
    exporter = SpanExporter(sink, {"service.name": "t"}, max_batch=64, interval_s=3600)
    spans = make_spans(1000)
    for s in spans:
        exporter.submit(s)
    assert exporter.flush(TIMEOUT)
    assert sink.names() == [s.name for s in spans]  # all of them, in order
    assert all(0 < len(b) <= 64 for b in sink.batches)
    assert exporter.exported == 1000 and exporter.dropped == 0 and exporter.failed == 0
    assert exporter.shutdown(TIMEOUT) and sink.closed


def test_exporter_wakes_at_half_a_batch() -> None:
    sink = ListSink()
    exporter = SpanExporter(sink, {}, max_batch=10, interval_s=3600)
    for s in make_spans(4):
        exporter.submit(s)
    time.sleep(0.2)
    assert sink.batches == []  # below half a batch: waits for the (hour-long) interval
    for s in make_spans(1, "x"):
        exporter.submit(s)
    wait_until(lambda: len(sink.names()) == 5)
    exporter.shutdown(TIMEOUT)


def test_exporter_exports_on_interval() -> None:
    sink = ListSink()
    exporter = SpanExporter(sink, {}, interval_s=0.05)
    exporter.submit(make_spans(1)[0])
    wait_until(lambda: sink.names() == ["s0"])
    exporter.shutdown(TIMEOUT)


def test_shutdown_exports_everything_then_drops() -> None:
    sink = ListSink()
    exporter = SpanExporter(sink, {}, max_batch=7, interval_s=3600)
    for s in make_spans(100):
        exporter.submit(s)
    assert exporter.shutdown(TIMEOUT)
    assert len(sink.names()) == 100 and sink.closed
    exporter.submit(make_spans(1)[0])
    assert exporter.dropped == 1
    assert exporter.flush(1) and exporter.shutdown(1)  # idempotent after shutdown
    assert len(sink.names()) == 100


def test_bounded_queue_drops_and_counts(caplog: pytest.LogCaptureFixture) -> None:
    entered, gate = threading.Event(), threading.Event()

    def block(call: int) -> None:
        if call == 1:
            entered.set()
            gate.wait(TIMEOUT)

    sink = ListSink(block)
    exporter = SpanExporter(sink, {}, max_queue=10, max_batch=4, interval_s=0.01)
    exporter.submit(make_spans(1, "first")[0])
    assert entered.wait(TIMEOUT)  # the exporter thread is now stuck in the sink
    with caplog.at_level(logging.WARNING, "omnirail.telemetry.export"):
        for s in make_spans(15):
            exporter.submit(s)
    assert exporter.dropped == 5
    assert sum("dropping spans" in r.getMessage() for r in caplog.records) == 1
    gate.set()
    assert exporter.shutdown(TIMEOUT)
    assert sink.names() == ["first0"] + [f"s{i}" for i in range(10)]
    assert exporter.exported == 11


def test_failing_sink_never_kills_the_thread() -> None:
    def flaky(call: int) -> bool | None:
        if call == 1:
            raise RuntimeError("sink exploded")
        return False if call == 2 else None

    sink = ListSink(flaky)
    exporter = SpanExporter(sink, {}, interval_s=3600)
    for batch in range(3):
        for s in make_spans(2, f"b{batch}-"):
            exporter.submit(s)
        assert exporter.flush(TIMEOUT)
    assert exporter.failed == 4 and exporter.exported == 2
    assert sink.names() == ["b2-0", "b2-1"]
    assert exporter.shutdown(TIMEOUT)


# ---- FileSink and read_span_files ----


def test_file_sink_round_trip_with_truncated_tail(tmp_path: Path) -> None:
    path = tmp_path / "spans" / "deep" / "svc-1.otlp"
    sink = FileSink(path)  # creates parent dirs
    first, second = make_spans(3, "a"), make_spans(2, "b")
    sink.export(encode(first, {"service.name": "svc"}))
    # Readable while the writer is live: each batch is flushed.
    assert [d["name"] for d in read_span_files([path])] == ["a0", "a1", "a2"]
    size_after_first = path.stat().st_size
    sink.export(encode(second, {"service.name": "svc"}))
    sink.close()
    assert [d["name"] for d in read_span_files([path])] == ["a0", "a1", "a2", "b0", "b1"]
    assert {d["service"] for d in read_span_files([path])} == {"svc"}

    data = path.read_bytes()
    for cut in (size_after_first + 2, len(data) - 1):  # mid-header, mid-body
        path.write_bytes(data[:cut])
        assert [d["name"] for d in read_span_files([path])] == ["a0", "a1", "a2"]
    path.write_bytes(data[:size_after_first] + b"\xff\xff\xff\xff" + data[-10:])
    assert [d["name"] for d in read_span_files([path])] == ["a0", "a1", "a2"]
    assert list(read_span_files([tmp_path / "missing.otlp"])) == []


def test_file_sink_appends_across_instances(tmp_path: Path) -> None:
    path = tmp_path / "x.otlp"
    for name in ("p", "q"):
        sink = FileSink(path)
        sink.export(encode(make_spans(1, name), {}))
        sink.close()
    assert [d["name"] for d in read_span_files([str(path)])] == ["p0", "q0"]


# ---- OtlpGrpcSink against a real gRPC receiver ----


@pytest.mark.parametrize("compression", [None, "gzip"])
def test_grpc_sink_exports_to_receiver(compression: str | None) -> None:
    with OtlpReceiver() as rx:
        sink = OtlpGrpcSink(rx.endpoint, headers=[("X-Token", "t")], compression=compression)
        exporter = SpanExporter(sink, {"service.name": "svc"}, max_batch=50)
        spans = make_spans(120)
        spans[0].set("omnirail.request_id", "r1")
        for s in spans:
            exporter.submit(s)
        assert exporter.shutdown(TIMEOUT)
        got = rx.wait_for(lambda got: len(got) == 120, TIMEOUT)
        assert [d["name"] for d in got] == [s.name for s in spans]
        assert got[0]["service"] == "svc"
        assert got[0]["attributes"] == {"omnirail.request_id": "r1"}
        assert rx.requests == 3
        assert all(md.get("x-token") == "t" for md in rx.metadata)


def test_grpc_sink_retries_unavailable() -> None:
    with OtlpReceiver() as rx:
        sink = OtlpGrpcSink(rx.endpoint, retries=2, backoff_s=0.01)
        rx.fail_next(2, grpc.StatusCode.UNAVAILABLE)
        assert sink.export(encode(make_spans(1), {}))
        assert (rx.calls, rx.requests, sink.dropped_batches) == (3, 1, 0)
        rx.fail_next(3, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert not sink.export(encode(make_spans(1), {}))
        assert (rx.calls, rx.requests, sink.dropped_batches) == (6, 1, 1)
        rx.fail_next(1, grpc.StatusCode.INVALID_ARGUMENT)  # not retried
        assert not sink.export(encode(make_spans(1), {}))
        assert (rx.calls, sink.dropped_batches) == (7, 2)
        sink.close()


def test_grpc_sink_unreachable_collector_drops_without_raising() -> None:
    with socket.socket() as s:  # a port nothing listens on: connection refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sink = OtlpGrpcSink(f"127.0.0.1:{port}", timeout_s=5, retries=1, backoff_s=0.01)
    exporter = SpanExporter(sink, {}, interval_s=3600)
    exporter.submit(make_spans(1)[0])
    assert exporter.flush(TIMEOUT)
    assert exporter.failed == 1 and sink.dropped_batches == 1
    assert exporter.shutdown(TIMEOUT)


def test_shutdown_cuts_short_an_export_to_a_hung_collector() -> None:
    rx = OtlpReceiver()  # bound but never started: connects, then nothing answers
    sink = OtlpGrpcSink(rx.endpoint, timeout_s=120, retries=2)
    exporter = SpanExporter(sink, {}, interval_s=0.01)
    exporter.submit(make_spans(1)[0])
    time.sleep(0.2)
    started = time.monotonic()
    assert not exporter.shutdown(timeout=0.5)
    # Closing the channel ends the stuck call: the thread exits, no retries follow.
    exporter._thread.join(TIMEOUT)
    assert not exporter._thread.is_alive()
    assert time.monotonic() - started < TIMEOUT
    assert exporter.failed == 1
    rx.stop()


def test_span_file_records_decode_like_otlp(tmp_path) -> None:
    """The exporter's compact file records read back as the same dicts as OTLP requests."""
    from omnirail.telemetry.export import FileSink, read_span_files
    from omnirail.telemetry.tracer import SpanContext

    tracer = Tracer(lambda s: None)
    root = tracer.start("stage a", SpanContext(5, 6, True), {"omnirail.stage": "a", "n": 3})
    assert root is not None
    root.event("first_chunk_in", {"omnirail.source": "b"})
    root.link(SpanContext(7, 8, True))
    tracer.record("queue", root, root.start_ns, root.start_ns + 5)
    tracer.record("relay.get", root, root.start_ns, root.start_ns + 2, {"bytes": 9})
    root.error("INTERNAL: x")
    root.end(root.start_ns + 10)
    other = tracer.start("omnirail.request", None)
    assert other is not None
    other.end()
    resource = {"service.name": "svc"}
    compact, otlp = FileSink(tmp_path / "a.otlp"), FileSink(tmp_path / "b.otlp")
    compact.export_spans([root, other], resource, "omnirail")
    otlp.export(encode([root, other], resource))
    compact.close()
    otlp.close()
    from_compact = list(read_span_files([tmp_path / "a.otlp"]))
    from_otlp = list(read_span_files([tmp_path / "b.otlp"]))
    assert from_compact == from_otlp
    assert [d["name"] for d in from_compact] == [
        "stage a",
        "queue",
        "relay.get",
        "omnirail.request",
    ]
