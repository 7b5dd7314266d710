"""Span export: spans to OTLP protobuf in a background thread, then to a collector or a file.

`SpanExporter.submit` is the `Tracer` sink and runs on the request path (event-loop
threads), so it only appends to a deque; encoding and I/O happen on the exporter's own
thread (encoding in `omnirail.telemetry.otlp`, about 4 µs per span).
"""

from __future__ import annotations

import collections
import logging
import os
import struct
import threading
import time
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from omnirail.telemetry.otlp import decode_request, encode
from omnirail.telemetry.spanfile import MARKER as SPANFILE_MARKER
from omnirail.telemetry.spanfile import pack_spans, unpack_spans
from omnirail.telemetry.tracer import Span

__all__ = [
    "FileSink",
    "OtlpGrpcSink",
    "SpanExporter",
    "SpanSink",
    "decode_request",
    "encode",
    "parse_headers",
    "read_span_files",
    "sink_from_env",
]

log = logging.getLogger(__name__)

_LEN = struct.Struct("<I")
_RETRY_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class _Throttled:
    """Logs the first warning, then at most one per interval: a collector that is down
    would otherwise log a warning per batch, several a second."""

    def __init__(self, every_s: float = 30.0) -> None:
        self.every_s = every_s
        self._last: float | None = None

    def warning(self, msg: str, *args: Any, exc_info: bool = False) -> None:
        now = time.monotonic()
        if self._last is None or now - self._last >= self.every_s:
            self._last = now
            log.warning(msg, *args, exc_info=exc_info)


class SpanSink(Protocol):
    def export(self, request: ExportTraceServiceRequest) -> bool: ...

    def close(self) -> None: ...


class SpanBatchSink(SpanSink, Protocol):
    """A sink that takes span records as they are (no OTLP message built for it)."""

    def export_spans(self, spans: list[Span], resource: Mapping[str, Any], scope: str) -> bool: ...


class SpanExporter:
    """Queues finished spans and exports them in batches from a daemon thread."""

    def __init__(
        self,
        sink: SpanSink,
        resource: Mapping[str, Any],
        *,
        scope: str = "omnirail",
        max_queue: int = 65536,
        max_batch: int = 2048,
        interval_s: float = 0.2,
    ) -> None:
        self.sink = sink
        self.resource = dict(resource)
        self.scope = scope
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.interval_s = interval_s
        self.dropped = 0  # spans refused because the queue was full or the exporter closed
        self.exported = 0  # spans in batches the sink accepted
        self.failed = 0  # spans in batches the sink rejected or raised on
        self._queue: collections.deque[Span] = collections.deque()
        self._wake_at = max(1, max_batch // 2)
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._flush_waiters: list[threading.Event] = []
        self._closed = False
        self._stop = False
        self._done = False  # the thread has taken its last flush waiters
        self._warning = _Throttled()
        self._raw = getattr(sink, "export_spans", None)
        self._thread = threading.Thread(
            target=self._run, name="omnirail-span-exporter", daemon=True
        )
        self._thread.start()

    def submit(self, span: Span) -> None:
        """Queues a finished span: the Tracer sink, called on request-path threads."""
        queue = self._queue
        if self._closed or len(queue) >= self.max_queue:
            self._drop()
            return
        queue.append(span)
        # is_set is a plain attribute read; the Event's lock is only taken once per wake.
        if len(queue) >= self._wake_at and not self._wake.is_set():
            self._wake.set()

    def _drop(self) -> None:
        with self._lock:
            self.dropped += 1
            first = self.dropped == 1
        if first:
            log.warning(
                "span export queue full (%d spans) or exporter closed: dropping spans; "
                "see SpanExporter.dropped for the count",
                self.max_queue,
            )

    def flush(self, timeout: float | None = 10.0) -> bool:
        """Exports every span submitted before the call; False when `timeout` ran out."""
        done = threading.Event()
        with self._lock:
            if self._done:
                return not self._queue
            self._flush_waiters.append(done)
        self._wake.set()
        return done.wait(timeout)

    def shutdown(self, timeout: float = 10.0) -> bool:
        """Exports everything queued, stops the thread and closes the sink."""
        deadline = time.monotonic() + timeout
        with self._lock:
            if self._closed:
                return not self._thread.is_alive() and not self._queue
            self._closed = True
            self._stop = True
        self._wake.set()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        clean = not self._thread.is_alive()
        # Closing the sink also cuts short an export stuck past the deadline.
        try:
            self.sink.close()
        except Exception:
            log.exception("closing span sink")
        if not clean:
            log.warning("span exporter did not finish within %.1fs", timeout)
        return clean and not self._queue

    def _run(self) -> None:
        while True:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            with self._lock:
                waiters, self._flush_waiters = self._flush_waiters, []
                stop = self._stop
            # Spans submitted before a flush call are all within the first len(queue) now.
            self._export_some(len(self._queue))
            for waiter in waiters:
                waiter.set()
            if stop:
                self._export_some(len(self._queue))
                with self._lock:
                    waiters, self._flush_waiters = self._flush_waiters, []
                    self._done = True
                for waiter in waiters:
                    waiter.set()
                return

    def _export_some(self, count: int) -> None:
        popleft = self._queue.popleft
        while count > 0:
            n = min(count, self.max_batch)
            count -= n
            batch = [popleft() for _ in range(n)]
            try:
                if self._raw is not None:
                    ok = self._raw(batch, self.resource, self.scope)
                else:
                    ok = self.sink.export(encode(batch, self.resource, self.scope))
            except Exception:
                # Never let a sink or an odd attribute end the thread: tracing stays up.
                self.failed += n
                self._warning.warning(
                    "span export failed; %d spans lost so far", self.failed, exc_info=True
                )
                continue
            if ok:
                self.exported += n
            else:
                self.failed += n


def _grpc_target(endpoint: str, insecure: bool) -> tuple[str, bool]:
    """host:port and whether to use TLS, from `http://`, `https://` or bare endpoints."""
    endpoint = endpoint.strip()
    if "://" in endpoint:
        parsed = urllib.parse.urlsplit(endpoint)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"OTLP endpoint {endpoint!r}: expected http://host:port")
        return parsed.netloc, parsed.scheme == "https"
    return endpoint.rstrip("/"), not insecure


class OtlpGrpcSink:
    """Sends batches to an OTLP/gRPC collector (`TraceService/Export`)."""

    def __init__(
        self,
        endpoint: str,
        *,
        headers: Iterable[tuple[str, str]] = (),
        insecure: bool = True,
        timeout_s: float = 10.0,
        compression: str | None = None,
        retries: int = 2,
        backoff_s: float = 0.5,
    ) -> None:
        self.target, self.secure = _grpc_target(endpoint, insecure)
        # gRPC rejects metadata keys with upper case letters.
        self.metadata = tuple((k.lower(), v) for k, v in headers)
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.dropped_batches = 0
        self._warning = _Throttled()
        if compression not in (None, "none", "gzip"):
            raise ValueError(f"OTLP compression {compression!r}: expected gzip or none")
        self.compression = "gzip" if compression == "gzip" else None
        comp = grpc.Compression.Gzip if self.compression else None
        if self.secure:
            creds = grpc.ssl_channel_credentials()
            self._channel = grpc.secure_channel(self.target, creds, compression=comp)
        else:
            self._channel = grpc.insecure_channel(self.target, compression=comp)
        self._stub = trace_service_pb2_grpc.TraceServiceStub(self._channel)
        self._closed = threading.Event()

    def export(self, request: ExportTraceServiceRequest) -> bool:
        """Sends one batch; False (and a counted warning) when it had to be dropped."""
        error: grpc.RpcError | None = None
        for attempt in range(self.retries + 1):
            if attempt and self._closed.wait(self.backoff_s * 2 ** (attempt - 1)):
                break
            try:
                response = self._stub.Export(
                    request, timeout=self.timeout_s, metadata=self.metadata
                )
            except grpc.RpcError as exc:
                error = exc
                if exc.code() not in _RETRY_CODES or self._closed.is_set():
                    break
                continue
            except ValueError as exc:
                # Calling on a closed channel raises ValueError, not RpcError.
                log.warning("OTLP export to %s after close: %s", self.target, exc)
                return False
            rejected = response.partial_success.rejected_spans
            if rejected:
                log.warning(
                    "OTLP collector %s rejected %d spans: %s",
                    self.target,
                    rejected,
                    response.partial_success.error_message,
                )
            return True
        self.dropped_batches += 1
        code = error.code() if error is not None else None
        detail = error.details() if error is not None else "closed"
        self._warning.warning(
            "OTLP export to %s failed (%s: %s); dropped the batch (%d batches dropped so far)",
            self.target,
            code,
            detail,
            self.dropped_batches,
        )
        return False

    def close(self) -> None:
        self._closed.set()
        self._channel.close()


class FileSink:
    """Appends each batch as a length-prefixed record to one file per process.

    The exporter writes compact span records (`spanfile`); `export` of an OTLP request
    writes the request itself. `read_span_files` reads both.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab")
        self._lock = threading.Lock()

    def export(self, request: ExportTraceServiceRequest) -> bool:
        return self._write(request.SerializeToString())

    def export_spans(self, spans: list[Span], resource: Mapping[str, Any], scope: str) -> bool:
        """The exporter's path: compact records (see `omnirail.telemetry.spanfile`)."""
        return self._write(pack_spans(spans, resource, scope))

    def _write(self, data: bytes) -> bool:
        with self._lock:
            # One write per record keeps a torn record at the very end of the file only.
            self._file.write(_LEN.pack(len(data)) + data)
            # Flushed per batch so `omnirail trace` sees the spans of a live mesh.
            self._file.flush()
        return True

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_span_files(paths: Iterable[str | Path]) -> Iterator[dict[str, Any]]:
    """The spans in files written by `FileSink`, as dicts.

    Keys: service, name, kind, trace_id, span_id and parent_span_id (hex; parent "" for a
    root), start_ns, end_ns, attributes, events, links, status ("unset", "ok", "error"),
    status_message. A truncated or corrupt tail (a process killed mid-write) ends the file.
    """
    for path in paths:
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            continue
        with f:
            # Bounds reads by what is there: a torn header may claim up to 4 GiB.
            end = os.fstat(f.fileno()).st_size
            while True:
                head = f.read(_LEN.size)
                if len(head) < _LEN.size:
                    break
                (size,) = _LEN.unpack(head)
                if size > end - f.tell():
                    break
                data = f.read(size)
                try:
                    if data[:1] == bytes((SPANFILE_MARKER,)):
                        spans = list(unpack_spans(data))
                    else:
                        request = ExportTraceServiceRequest()
                        request.ParseFromString(data)
                        spans = list(decode_request(request))
                except (DecodeError, ValueError):
                    log.warning("%s: corrupt span record; skipping the rest of the file", path)
                    break
                yield from spans


def _env(environ: Mapping[str, str], name: str) -> str:
    """OTEL_EXPORTER_OTLP_TRACES_<name>, else OTEL_EXPORTER_OTLP_<name>, stripped."""
    value = environ.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}", "").strip()
    return value or environ.get(f"OTEL_EXPORTER_OTLP_{name}", "").strip()


def parse_headers(value: str) -> list[tuple[str, str]]:
    """`k=v,k2=v2` with URL-encoded keys and values (W3C baggage style, per the spec)."""
    headers = []
    for item in value.split(","):
        if not item.strip():
            continue
        key, sep, val = item.partition("=")
        key = urllib.parse.unquote(key.strip())
        if not sep or not key:
            raise ValueError(f"OTEL_EXPORTER_OTLP_HEADERS: expected key=value, got {item!r}")
        headers.append((key, urllib.parse.unquote(val.strip())))
    return headers


def sink_from_env(
    environ: Mapping[str, str], span_file: str | Path | None
) -> OtlpGrpcSink | FileSink | None:
    """The sink the standard OTEL_* variables ask for; `span_file` without an endpoint.

    Raises ValueError for settings this exporter cannot honour (an HTTP protocol, an
    unknown exporter or compression, a bad timeout) rather than silently exporting nothing.
    """
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    exporters = {
        e.strip().lower() for e in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()
    }
    if "none" in exporters:
        return None
    if exporters - {"otlp"}:
        raise ValueError(
            f"OTEL_TRACES_EXPORTER={environ['OTEL_TRACES_EXPORTER']!r}: "
            "omnirail supports only 'otlp' (over gRPC) or 'none'"
        )
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    endpoint = endpoint or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    if not endpoint:
        return FileSink(span_file) if span_file else None
    protocol = _env(environ, "PROTOCOL").lower()
    if protocol and protocol != "grpc":
        raise ValueError(
            f"OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL={protocol!r}: omnirail exports OTLP over "
            "gRPC only; set it to 'grpc' (or unset it) and point the endpoint at the "
            "collector's gRPC port (usually 4317)"
        )
    kwargs: dict[str, Any] = {"headers": parse_headers(_env(environ, "HEADERS"))}
    insecure = _env(environ, "INSECURE").lower()
    if insecure:
        kwargs["insecure"] = insecure == "true"
    timeout = _env(environ, "TIMEOUT")
    if timeout:
        try:
            kwargs["timeout_s"] = float(timeout) / 1000.0  # the spec gives milliseconds
        except ValueError:
            raise ValueError(
                f"OTEL_EXPORTER_OTLP_(TRACES_)TIMEOUT={timeout!r}: expected milliseconds"
            ) from None
        if kwargs["timeout_s"] <= 0:
            raise ValueError(f"OTEL_EXPORTER_OTLP_(TRACES_)TIMEOUT={timeout!r}: must be > 0")
    compression = _env(environ, "COMPRESSION").lower()
    if compression not in ("", "none", "gzip"):
        raise ValueError(
            f"OTEL_EXPORTER_OTLP_(TRACES_)COMPRESSION={compression!r}: expected gzip or none"
        )
    kwargs["compression"] = compression if compression == "gzip" else None
    return OtlpGrpcSink(endpoint, **kwargs)
