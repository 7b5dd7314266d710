"""End-to-end traces through real processes into a real OTLP/gRPC receiver.

One trace per request from the client's parent through the coordinator and every stage;
parent/child structure following the route; links on fan-in; relay spans with byte
counts; error status from a failing stage; streaming spans with first-chunk events; and
every span delivered when the mesh shuts down right after the last request.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from omnirail.client.sdk import Chunk, Client, build_request
from omnirail.v1 import client_pb2_grpc
from omnirail.wire.errors import OmniError
from tests.integration.conftest import start_mesh
from tests.otlp_receiver import OtlpReceiver


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as rx:
        yield rx


def _env(rx: OtlpReceiver) -> dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint,
        "OTEL_TRACES_SAMPLER": "always_on",
        "OTEL_SDK_DISABLED": "false",
    }


def _client_parent() -> tuple[str, str, str]:
    trace_id = f"{random.getrandbits(128):032x}"
    span_id = f"{random.getrandbits(64):016x}"
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def _of_request(spans: list[dict[str, Any]], request_id: str) -> list[dict[str, Any]]:
    traces = {
        s["trace_id"] for s in spans if s["attributes"].get("omnirail.request_id") == request_id
    }
    assert len(traces) == 1, f"request {request_id} is in {len(traces)} traces"
    return [s for s in spans if s["trace_id"] in traces]


def _one(spans: list[dict[str, Any]], name: str) -> dict[str, Any]:
    found = [s for s in spans if s["name"] == name]
    assert len(found) == 1, (name, [s["name"] for s in spans])
    return found[0]


def _children(spans: list[dict[str, Any]], parent: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for s in spans if s["parent_span_id"] == parent["span_id"]]


def test_fan_out_fan_in_trace(receiver: OtlpReceiver) -> None:
    mesh = start_mesh("fanout", env=_env(receiver))
    parent, trace_id, client_span = _client_parent()
    try:
        with Client(mesh.address or "", timeout=60) as client:
            client.generate({"n": 20000}, request_id="traced-fan", traceparent=parent)
            for i in range(3):  # others in flight alongside must not mix in
                client.generate({"n": 10}, request_id=f"other-{i}")
    finally:
        mesh.stop()  # at once: spans still queued must be flushed on shutdown
    spans = _of_request(receiver.spans(), "traced-fan")
    assert {s["trace_id"] for s in spans} == {trace_id}

    root = _one(spans, "omnirail.request")
    assert root["parent_span_id"] == client_span and root["service"] == "omnirail-coordinator"
    assert root["status"] == "ok"
    split, left, right, join = (
        _one(spans, f"stage {n}") for n in ("split", "left", "right", "join")
    )
    assert split["parent_span_id"] == root["span_id"]
    assert left["parent_span_id"] == right["parent_span_id"] == split["span_id"]
    assert join["parent_span_id"] in (left["span_id"], right["span_id"])
    assert {link["span_id"] for link in join["links"]} == {left["span_id"], right["span_id"]}
    for stage, span in (("split", split), ("left", left), ("right", right), ("join", join)):
        assert span["service"] == f"omnirail-stage-{stage}"
        assert span["attributes"]["omnirail.stage"] == stage
        assert span["attributes"]["omnirail.request_id"] == "traced-fan"
        assert span["status"] == "ok"
        names = {c["name"] for c in _children(spans, span)}
        assert {"queue", "compute", "send"} <= names, (stage, names)
        # Its own children (not the downstream stages' spans) sit inside it.
        for child in _children(spans, span):
            if child["service"] != span["service"]:
                continue
            inside = span["start_ns"] <= child["start_ns"] <= child["end_ns"] <= span["end_ns"]
            assert inside, (
                stage,
                child["name"],
                child["start_ns"] - span["start_ns"],
                child["end_ns"] - span["end_ns"],
            )

    # split relays both projections (inline bound 256 bytes); left and right read them.
    puts = [c for c in _children(spans, split) if c["name"] == "relay.put"]
    assert sorted(p["attributes"]["omnirail.edge"] for p in puts) == ["split->left", "split->right"]
    assert {p["attributes"]["omnirail.relay.backend"] for p in puts} == {"shm"}
    assert {
        p["attributes"]["omnirail.edge"]: p["attributes"]["omnirail.relay.bytes"] for p in puts
    } == {
        "split->left": 20000 * 8,
        "split->right": 20000 * 2,
    }
    for reader, edge in ((left, "split->left"), (right, "split->right")):
        [get] = [c for c in _children(spans, reader) if c["name"] == "relay.get"]
        assert get["attributes"]["omnirail.edge"] == edge
        assert get["attributes"]["omnirail.relay.bytes"] > 0


def test_failing_stage_sets_error_status(receiver: OtlpReceiver) -> None:
    mesh = start_mesh("linear", env=_env(receiver))
    meta_parent, meta_trace, meta_span = _client_parent()
    try:
        with Client(mesh.address or "", timeout=60) as client:
            with pytest.raises(OmniError):
                client.generate({"n": 3, "fail": "boom"}, request_id="traced-fail")
            client.generate({"n": 3}, request_id="traced-ok")
        # A plain gRPC caller may pass its context as metadata instead.
        with grpc.insecure_channel(mesh.address or "") as channel:
            stub = client_pb2_grpc.OmnirailStub(channel)
            request = build_request({"n": 3}, "traced-meta", 60, None)
            list(stub.Generate(request, metadata=[("traceparent", meta_parent)], timeout=60))
        log_text = "".join(p.read_text() for p in (mesh.run_dir / "logs").glob("*.log"))
    finally:
        mesh.stop()
    spans = _of_request(receiver.spans(), "traced-fail")
    # The stage's log line about the failure names the request and its trace.
    [line] = [ln for ln in log_text.splitlines() if "request failed" in ln]
    # (A stage knows no principal: only the coordinator's records name one.)
    assert f"[request=traced-fail trace={spans[0]['trace_id']} principal=-]" in line, line
    assert "stage double" in line and "asked to fail: boom" in line
    double = _one(spans, "stage double")
    assert double["status"] == "error" and "asked to fail: boom" in double["status_message"]
    root = _one(spans, "omnirail.request")
    assert root["status"] == "error" and "boom" in root["status_message"]
    assert not [s for s in spans if s["name"] == "stage summarize"]  # it never ran
    meta_root = _one(_of_request(receiver.spans(), "traced-meta"), "omnirail.request")
    assert (meta_root["trace_id"], meta_root["parent_span_id"]) == (meta_trace, meta_span)
    ok = _of_request(receiver.spans(), "traced-ok")
    assert {s["status"] for s in ok if s["name"].startswith("stage ")} == {"ok"}


def test_streaming_trace(receiver: OtlpReceiver) -> None:
    mesh = start_mesh("streaming", env=_env(receiver))
    parent, trace_id, client_span = _client_parent()
    try:
        with Client(mesh.address or "", timeout=60) as client:
            events = list(client.stream({"n": 9}, request_id="traced-stream", traceparent=parent))
            long = client.stream({"n": 500, "step_ms": 10}, request_id="traced-abort")
            assert isinstance(next(long), Chunk)
            client.abort("traced-abort", "test")
            with pytest.raises(OmniError):
                list(long)
        assert sum(isinstance(e, Chunk) for e in events) == 4
    finally:
        mesh.stop()
    aborted = _of_request(receiver.spans(), "traced-abort")
    for span in aborted:
        if span["name"] == "omnirail.request" or span["name"].startswith("stage "):
            assert span["status"] == "error" and "test" in span["status_message"], span
    spans = _of_request(receiver.spans(), "traced-stream")
    assert {s["trace_id"] for s in spans} == {trace_id}
    root = _one(spans, "omnirail.request")
    assert root["parent_span_id"] == client_span
    assert root["attributes"]["omnirail.stream.chunks"] == 4
    assert [e["name"] for e in root["events"]] == ["first_chunk"]
    thinker, talker, vocoder = (_one(spans, f"stage {n}") for n in ("thinker", "talker", "vocoder"))
    assert thinker["parent_span_id"] == root["span_id"]
    assert talker["parent_span_id"] == thinker["span_id"]
    assert vocoder["parent_span_id"] == talker["span_id"]
    # One span per stage for the whole stream: counts and first-chunk events, not a span
    # per chunk.
    assert thinker["attributes"]["omnirail.stream.chunks_out"] == 9
    assert talker["attributes"]["omnirail.stream.chunks_in"] == 9
    assert talker["attributes"]["omnirail.stream.chunks_out"] == 9
    assert vocoder["attributes"]["omnirail.stream.chunks_in"] == 9
    assert vocoder["attributes"]["omnirail.stream.chunks_out"] == 4
    assert "first_chunk_out" in [e["name"] for e in thinker["events"]]
    assert {"first_chunk_in", "first_chunk_out"} <= {e["name"] for e in vocoder["events"]}
    assert len([s for s in spans if s["name"].startswith("stage ")]) == 3


_APP = """
import json, sys
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from omnirail.client.sdk import Client

exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
with trace.get_tracer("app").start_as_current_span("app request"):
    with Client(sys.argv[1], timeout=60) as client:
        client.generate({"n": 3}, request_id="sdk-traced")
spans = {s.name: s for s in exporter.get_finished_spans()}
client_span, app = spans["omnirail generate"], spans["app request"]
print(json.dumps({
    "trace_id": f"{client_span.context.trace_id:032x}",
    "client_span": f"{client_span.context.span_id:016x}",
    "client_parent": f"{client_span.parent.span_id:016x}",
    "app_span": f"{app.context.span_id:016x}",
    "kind": client_span.kind.name,
}))
"""


def test_sdk_client_span_parents_the_request(receiver: OtlpReceiver) -> None:
    """An application with OpenTelemetry configured gets a client span, and the mesh's
    trace continues under it."""
    import json
    import subprocess
    import sys

    mesh = start_mesh("linear", env=_env(receiver))
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _APP, mesh.address or ""],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        mesh.stop()
    assert proc.returncode == 0, proc.stderr
    app = json.loads(proc.stdout)
    assert app["kind"] == "CLIENT" and app["client_parent"] == app["app_span"]
    spans = _of_request(receiver.spans(), "sdk-traced")
    root = _one(spans, "omnirail.request")
    assert root["trace_id"] == app["trace_id"]
    assert root["parent_span_id"] == app["client_span"]
