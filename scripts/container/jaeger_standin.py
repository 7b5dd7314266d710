"""A Jaeger stand-in for tests where the real image cannot be pulled (see standin_images.sh).

Receives OTLP traces like Jaeger all-in-one (gRPC on 4317, HTTP/protobuf on 4318 at
/v1/traces), keeps them in memory and answers a subset of Jaeger's query API on 16686 in
its JSON shape:

  GET /api/services                          {"data": ["svc", ...]}
  GET /api/services/SVC/operations           {"data": ["op", ...]}
  GET /api/traces?service=SVC[&operation=OP][&limit=N][&start=US][&end=US]
                                             {"data": [trace, ...]}, newest first
  GET /api/traces/TRACE_ID                   {"data": [trace]} or 404

A trace is {"traceID", "spans": [...], "processes": {"p1": {"serviceName", "tags"}}} with
Jaeger's span fields (spanID, operationName, references, startTime/duration in
microseconds, tags, logs, processID). No UI, no persistence, no sampling endpoints.
Runs inside the omnirail image: grpcio, the OTLP protos and omnirail's OTLP decoder.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections import OrderedDict
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from omnirail.telemetry.otlp import decode_request

OTLP_GRPC_PORT = int(os.environ.get("STANDIN_OTLP_GRPC_PORT", "4317"))
OTLP_HTTP_PORT = int(os.environ.get("STANDIN_OTLP_HTTP_PORT", "4318"))
QUERY_PORT = int(os.environ.get("STANDIN_QUERY_PORT", "16686"))
MAX_TRACES = int(os.environ.get("STANDIN_MAX_TRACES", "10000"))
SPAN_KINDS = {1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


class Store:
    """Spans by trace, oldest trace dropped first past MAX_TRACES."""

    def __init__(self, max_traces: int) -> None:
        self._traces: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self._max = max_traces
        self._lock = threading.Lock()

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self._lock:
            for span in decode_request(request):
                self._traces.setdefault(span["trace_id"], []).append(span)
            while len(self._traces) > self._max:
                self._traces.popitem(last=False)

    def snapshot(self) -> dict[str, list[dict[str, Any]]]:
        with self._lock:
            return {tid: list(spans) for tid, spans in self._traces.items()}


STORE = Store(MAX_TRACES)


class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        STORE.add(request)
        return trace_service_pb2.ExportTraceServiceResponse()


# ---- Jaeger JSON ---------------------------------------------------------------------


def jaeger_id(hex_id: str) -> str:
    """Jaeger prints a 128-bit id whose high half is zero as 16 hex digits."""
    return hex_id[16:] if len(hex_id) == 32 and hex_id[:16] == "0" * 16 else hex_id


def tag(key: str, value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"key": key, "type": "bool", "value": value}
    if isinstance(value, int):
        return {"key": key, "type": "int64", "value": value}
    if isinstance(value, float):
        return {"key": key, "type": "float64", "value": value}
    if isinstance(value, str):
        return {"key": key, "type": "string", "value": value}
    return {"key": key, "type": "string", "value": json.dumps(value, default=str)}


def to_jaeger(trace_id: str, spans: list[dict[str, Any]]) -> dict[str, Any]:
    processes: dict[str, str] = {}  # service -> processID
    out = []
    for s in sorted(spans, key=lambda s: s["start_ns"]):
        pid = processes.setdefault(s["service"], f"p{len(processes) + 1}")
        tags = [tag(k, v) for k, v in s["attributes"].items()]
        tags.append(tag("span.kind", SPAN_KINDS.get(s["kind"], "unspecified")))
        if s["status"] == "error":
            tags += [tag("error", True), tag("otel.status_code", "ERROR")]
            if s["status_message"]:
                tags.append(tag("otel.status_description", s["status_message"]))
        references = []
        if s["parent_span_id"]:
            references.append(
                {
                    "refType": "CHILD_OF",
                    "traceID": jaeger_id(trace_id),
                    "spanID": s["parent_span_id"],
                }
            )
        references += [
            {
                "refType": "FOLLOWS_FROM",
                "traceID": jaeger_id(lk["trace_id"]),
                "spanID": lk["span_id"],
            }
            for lk in s["links"]
        ]
        out.append(
            {
                "traceID": jaeger_id(trace_id),
                "spanID": s["span_id"],
                "flags": 1,
                "operationName": s["name"],
                "references": references,
                "startTime": s["start_ns"] // 1000,
                "duration": max(0, s["end_ns"] - s["start_ns"]) // 1000,
                "tags": tags,
                "logs": [
                    {
                        "timestamp": e["time_ns"] // 1000,
                        "fields": [
                            tag("event", e["name"]),
                            *(tag(k, v) for k, v in e["attributes"].items()),
                        ],
                    }
                    for e in s["events"]
                ],
                "processID": pid,
                "warnings": None,
            }
        )
    return {
        "traceID": jaeger_id(trace_id),
        "spans": out,
        "processes": {pid: {"serviceName": svc, "tags": []} for svc, pid in processes.items()},
        "warnings": None,
    }


def envelope(data: Any, status: int = 200, error: str | None = None) -> dict[str, Any]:
    errors = [{"code": status, "msg": error}] if error else None
    count = len(data) if isinstance(data, list) else 0
    return {"data": data, "total": count, "limit": 0, "offset": 0, "errors": errors}


def find_traces(query: dict[str, list[str]]) -> tuple[int, dict[str, Any]]:
    service = (query.get("service") or [""])[0]
    if not service:
        return 400, envelope(None, 400, "parameter 'service' is required")
    operation = (query.get("operation") or [""])[0]
    limit = int((query.get("limit") or ["100"])[0] or 100)
    start_us = int((query.get("start") or ["0"])[0] or 0)
    end_us = int((query.get("end") or ["0"])[0] or 0)
    found = []
    for trace_id, spans in STORE.snapshot().items():
        mine = [
            s
            for s in spans
            if s["service"] == service and (not operation or s["name"] == operation)
        ]
        if not mine:
            continue
        first_us = min(s["start_ns"] for s in spans) // 1000
        if (start_us and first_us < start_us) or (end_us and first_us > end_us):
            continue
        found.append((first_us, trace_id, spans))
    found.sort(key=lambda t: t[0], reverse=True)
    return 200, envelope([to_jaeger(tid, spans) for _, tid, spans in found[:limit]])


class QueryHandler(BaseHTTPRequestHandler):
    server_version = "jaeger-standin"

    def log_message(self, format: str, *args: Any) -> None:  # quiet access log
        pass

    def _send(self, status: int, body: dict[str, Any] | str) -> None:
        raw = (body if isinstance(body, str) else json.dumps(body)).encode()
        self.send_response(status)
        ctype = "text/plain" if isinstance(body, str) else "application/json"
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:
        url = urlparse(self.path)
        parts = [unquote(p) for p in url.path.strip("/").split("/") if p]
        query = parse_qs(url.query)
        traces = STORE.snapshot()
        if parts == ["api", "services"]:
            services = sorted({s["service"] for spans in traces.values() for s in spans})
            return self._send(200, envelope(services))
        if len(parts) == 4 and parts[:2] == ["api", "services"] and parts[3] == "operations":
            ops = sorted(
                {s["name"] for spans in traces.values() for s in spans if s["service"] == parts[2]}
            )
            return self._send(200, envelope(ops))
        if parts == ["api", "traces"]:
            return self._send(*find_traces(query))
        if len(parts) == 3 and parts[:2] == ["api", "traces"]:
            wanted = parts[2].lower().rjust(32, "0")
            if wanted in traces:
                return self._send(200, envelope([to_jaeger(wanted, traces[wanted])]))
            return self._send(404, envelope(None, 404, "trace not found"))
        if not parts:
            return self._send(200, "jaeger stand-in: see /api/services, /api/traces?service=X\n")
        return self._send(404, envelope(None, 404, "not found"))


class OtlpHttpHandler(BaseHTTPRequestHandler):
    """OTLP/HTTP with protobuf bodies (the JSON encoding is not accepted)."""

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        if urlparse(self.path).path != "/v1/traces":
            self.send_error(404)
            return
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        request = trace_service_pb2.ExportTraceServiceRequest()
        try:
            request.ParseFromString(body)
        except Exception:
            self.send_error(400, "expected an application/x-protobuf ExportTraceServiceRequest")
            return
        STORE.add(request)
        raw = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)


def main() -> None:
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(), grpc_server)
    grpc_server.add_insecure_port(f"0.0.0.0:{OTLP_GRPC_PORT}")
    grpc_server.start()
    http_servers = [
        ThreadingHTTPServer(("0.0.0.0", QUERY_PORT), QueryHandler),
        ThreadingHTTPServer(("0.0.0.0", OTLP_HTTP_PORT), OtlpHttpHandler),
    ]
    for srv in http_servers:
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    print(
        f"jaeger stand-in: OTLP gRPC :{OTLP_GRPC_PORT}, OTLP HTTP :{OTLP_HTTP_PORT}, "
        f"query :{QUERY_PORT}",
        flush=True,
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    for srv in http_servers:
        srv.shutdown()
    grpc_server.stop(1).wait()


if __name__ == "__main__":
    main()
