"""Log records that carry the request and trace they belong to.

Code that handles one request sets `request_context(request_id, traceparent)` (the stage
loop around its per-request work, schedulers around user compute); every record logged
inside gets `request_id` and `trace_id` attributes, which the services' format prints, so
a log line can be found from a trace and the other way round. Records logged with
`extra={"request_id": ..., "trace_id": ...}` keep their own values. The coordinator's
records about a request also carry its `principal` (the caller; "-" elsewhere).
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Iterator
from contextlib import contextmanager

from omnirail.telemetry.tracer import parse_traceparent

_request_id: contextvars.ContextVar[str] = contextvars.ContextVar(
    "omnirail_request_id", default="-"
)
_trace_id: contextvars.ContextVar[str] = contextvars.ContextVar("omnirail_trace_id", default="-")

FORMAT = (
    "%(asctime)s %(levelname)s %(process)d %(name)s "
    "[request=%(request_id)s trace=%(trace_id)s principal=%(principal)s]: %(message)s"
)


def trace_id_of(traceparent: str | None) -> str:
    """The trace id (hex) in a traceparent, or "-"."""
    if traceparent and len(traceparent) == 55 and traceparent[2] == "-":
        return traceparent[3:35]  # our own, well-formed: no need to parse it again
    ctx = parse_traceparent(traceparent)
    return f"{ctx.trace_id:032x}" if ctx is not None else "-"


def ids(request_id: str, traceparent: str | None, principal: str = "") -> dict[str, str]:
    """`extra=` for a record about one request logged outside its context."""
    return {
        "request_id": request_id or "-",
        "trace_id": trace_id_of(traceparent),
        "principal": principal or "-",
    }


@contextmanager
def request_context(request_id: str, traceparent: str | None = None) -> Iterator[None]:
    """Tags records logged inside (this thread or task) with the request and its trace."""
    rid_token = _request_id.set(request_id or "-")
    trace_token = _trace_id.set(trace_id_of(traceparent))
    try:
        yield
    finally:
        _trace_id.reset(trace_token)
        _request_id.reset(rid_token)


class ContextFilter(logging.Filter):
    """Fills `request_id` / `trace_id` on every record (from `extra` or the context)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = _request_id.get()
        if not hasattr(record, "trace_id"):
            record.trace_id = _trace_id.get()
        if not hasattr(record, "principal"):
            record.principal = "-"
        return True


def setup_logging(level: str = "INFO") -> None:
    """Service logging: one stderr handler whose lines carry request and trace ids."""
    handler = logging.StreamHandler()
    handler.addFilter(ContextFilter())
    handler.setFormatter(logging.Formatter(FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
