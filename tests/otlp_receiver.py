"""A real OTLP/gRPC trace receiver for tests: what a collector would get, decoded to dicts.

with OtlpReceiver() as rx:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint}
    ...
    spans = rx.wait_for(lambda spans: any(s["name"] == "x" for s in spans), timeout=30)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from omnirail.telemetry.export import decode_request

SpanDicts = list[dict[str, Any]]


class _Servicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self.receiver = receiver

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        return self.receiver._export(request, context)


class OtlpReceiver:
    """A grpc server on 127.0.0.1 implementing TraceService/Export.

    `fail_next(n, code)` makes the next n calls fail with `code` (retry tests);
    `metadata` holds each call's invocation metadata (header tests).
    """

    def __init__(self, max_workers: int = 4) -> None:
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Servicer(self), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.requests = 0  # Export calls that succeeded
        self.calls = 0  # every Export call, failed ones included
        self.metadata: list[dict[str, str]] = []
        self._spans: SpanDicts = []
        self._failures: list[grpc.StatusCode] = []
        self._cond = threading.Condition()

    def start(self) -> OtlpReceiver:
        self._server.start()
        return self

    def stop(self, grace: float | None = None) -> None:
        self._server.stop(grace).wait()

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def fail_next(self, n: int, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        with self._cond:
            self._failures.extend([code] * n)

    def _export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        with self._cond:
            self.calls += 1
            self.metadata.append({k: str(v) for k, v in context.invocation_metadata()})
            if self._failures:
                code = self._failures.pop(0)
                context.abort(code, "injected failure")
            self._spans.extend(decode_request(request))
            self.requests += 1
            self._cond.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> SpanDicts:
        """Every span received so far (dicts like `read_span_files` yields)."""
        with self._cond:
            return list(self._spans)

    def wait_for(self, predicate: Callable[[SpanDicts], bool], timeout: float = 30.0) -> SpanDicts:
        """The spans once `predicate(spans)` holds; TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(list(self._spans)):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({s["name"] for s in self._spans})
                    raise TimeoutError(
                        f"OTLP receiver: condition not met in {timeout}s; "
                        f"{len(self._spans)} spans in {self.requests} requests: {names}"
                    )
                self._cond.wait(left)
            return list(self._spans)
