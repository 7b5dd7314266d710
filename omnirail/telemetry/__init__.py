"""Tracing for the mesh: cheap span records, W3C context, OTLP export (see tracer.py).

`setup_tracing` and `Telemetry` load lazily: request-path modules import
`omnirail.telemetry.tracer`, which should not pull in grpc, protobuf and the OTel SDK.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omnirail.telemetry.tracer import (
    KIND_CLIENT,
    KIND_INTERNAL,
    KIND_SERVER,
    STATUS_ERROR,
    STATUS_OK,
    STATUS_UNSET,
    Span,
    SpanContext,
    Tracer,
    attributes_of,
    parse_traceparent,
)

if TYPE_CHECKING:
    from omnirail.telemetry.setup import Telemetry, setup_tracing

# Set by the launcher for its processes: the folder for span files when no OTLP endpoint
# is configured. Here, not in setup, so the launcher can name it without loading grpc.
SPAN_DIR_ENV = "OMNIRAIL_SPAN_DIR"

_LAZY = {"Telemetry", "setup_tracing"}

__all__ = [
    "KIND_CLIENT",
    "KIND_INTERNAL",
    "KIND_SERVER",
    "SPAN_DIR_ENV",
    "STATUS_ERROR",
    "STATUS_OK",
    "STATUS_UNSET",
    "Span",
    "SpanContext",
    "Telemetry",
    "Tracer",
    "attributes_of",
    "parse_traceparent",
    "setup_tracing",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from omnirail.telemetry import setup

        return getattr(setup, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
