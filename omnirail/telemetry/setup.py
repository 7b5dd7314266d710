"""Per-process tracing setup from the standard OTEL_* variables."""

from __future__ import annotations

import os
import re
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omnirail.telemetry import SPAN_DIR_ENV
from omnirail.telemetry.export import SpanExporter, sink_from_env
from omnirail.telemetry.tracer import Tracer, sdk_root_sampler

_UNSAFE_FILENAME = re.compile(r"[^A-Za-z0-9._-]+")


class Telemetry:
    """A process's tracer and, when tracing is on, the exporter behind it."""

    def __init__(
        self,
        tracer: Tracer,
        exporter: SpanExporter | None,
        service_name: str,
        resource: Mapping[str, Any],
    ) -> None:
        self.tracer = tracer
        self.exporter = exporter
        self.service_name = service_name
        self.resource = dict(resource)

    @property
    def enabled(self) -> bool:
        return self.tracer.enabled

    def shutdown(self, timeout: float = 10.0) -> bool:
        """Exports every finished span, then stops; True when nothing was left behind."""
        if self.exporter is None:
            return True
        return self.exporter.shutdown(timeout)


def _resource_attributes(environ: Mapping[str, str]) -> dict[str, str]:
    """OTEL_RESOURCE_ATTRIBUTES from `environ`, parsed as the SDK's detector does.

    The SDK reads os.environ itself; parsing here too makes an explicit `environ` win.
    """
    attributes = {}
    for item in environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip():
            attributes[key.strip()] = urllib.parse.unquote(value.strip())
    return attributes


def span_file_path(span_dir: str | Path, service_name: str, pid: int | None = None) -> Path:
    """`<dir>/<service>-<pid>.otlp`: one file per process, so writers never interleave."""
    safe = _UNSAFE_FILENAME.sub("_", service_name).strip("._") or "service"
    return Path(span_dir) / f"{safe}-{os.getpid() if pid is None else pid}.otlp"


def setup_tracing(
    default_service_name: str, *, environ: Mapping[str, str] = os.environ
) -> Telemetry:
    """The tracer for this process, exporting as OTEL_* and OMNIRAIL_SPAN_DIR say.

    Service name: OTEL_SERVICE_NAME, else `default_service_name`. Spans go to an OTLP/gRPC
    collector when an endpoint is set, else to `$OMNIRAIL_SPAN_DIR/<service>-<pid>.otlp`,
    else nowhere (the tracer is disabled and costs nothing). Raises ValueError for OTEL_*
    settings that cannot be honoured (see `sink_from_env`). The sampler (OTEL_TRACES_SAMPLER)
    and resource detectors read os.environ, as the SDK always does.
    """
    from opentelemetry.sdk.resources import Resource

    service_name = environ.get("OTEL_SERVICE_NAME", "").strip() or default_service_name
    span_dir = environ.get(SPAN_DIR_ENV, "").strip()
    span_file = span_file_path(span_dir, service_name) if span_dir else None
    sink = sink_from_env(environ, span_file)
    attributes: dict[str, Any] = _resource_attributes(environ)
    # Ours, not OTEL_RESOURCE_ATTRIBUTES' service.name: one shared env must not give every
    # process of the mesh the same name.
    attributes["service.name"] = service_name
    resource = dict(Resource.create(attributes).attributes)
    if sink is None:
        return Telemetry(Tracer(None), None, service_name, resource)
    exporter = SpanExporter(sink, resource)
    tracer = Tracer(exporter.submit, root_sampler=sdk_root_sampler())
    return Telemetry(tracer, exporter, service_name, resource)
