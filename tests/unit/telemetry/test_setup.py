"""Tests for configuration from the environment: sink_from_env and setup_tracing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from omnirail.telemetry.export import (
    FileSink,
    OtlpGrpcSink,
    parse_headers,
    read_span_files,
    sink_from_env,
)
from omnirail.telemetry.setup import setup_tracing
from tests.otlp_receiver import OtlpReceiver

TIMEOUT = 60.0  # generous: a busy 2-core machine

# ---- sink_from_env ----

EP = "OTEL_EXPORTER_OTLP_ENDPOINT"


def grpc_sink(env: dict[str, str]) -> OtlpGrpcSink:
    sink = sink_from_env(env, None)
    assert isinstance(sink, OtlpGrpcSink)
    sink.close()
    return sink


def test_env_without_endpoint(tmp_path: Path) -> None:
    assert sink_from_env({}, None) is None
    sink = sink_from_env({}, str(tmp_path / "s" / "f.otlp"))
    assert isinstance(sink, FileSink) and sink.path == tmp_path / "s" / "f.otlp"
    sink.close()


@pytest.mark.parametrize(
    "env",
    [
        {"OTEL_SDK_DISABLED": "true", EP: "http://c:4317"},
        {"OTEL_SDK_DISABLED": "TRUE"},
        {"OTEL_TRACES_EXPORTER": "none", EP: "http://c:4317"},
        {"OTEL_TRACES_EXPORTER": " None "},
    ],
)
def test_env_disabled(env: dict[str, str], tmp_path: Path) -> None:
    assert sink_from_env(env, str(tmp_path / "f.otlp")) is None


def test_env_endpoint_and_scheme() -> None:
    sink = grpc_sink({EP: "http://collector:4317", "OTEL_TRACES_EXPORTER": "otlp"})
    assert (sink.target, sink.secure) == ("collector:4317", False)
    sink = grpc_sink({EP: "http://a:1", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://b:2/"})
    assert (sink.target, sink.secure) == ("b:2", True)
    assert grpc_sink({EP: "c:3"}).secure is False
    assert grpc_sink({EP: "c:3", "OTEL_EXPORTER_OTLP_INSECURE": "false"}).secure is True
    env = {EP: "c:3", "OTEL_EXPORTER_OTLP_INSECURE": "false"}
    assert grpc_sink({**env, "OTEL_EXPORTER_OTLP_TRACES_INSECURE": "true"}).secure is False
    # http:// is insecure whatever INSECURE says
    assert grpc_sink({EP: "http://c:3", "OTEL_EXPORTER_OTLP_INSECURE": "false"}).secure is False


def test_env_protocol() -> None:
    grpc_sink({EP: "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    with pytest.raises(ValueError, match="gRPC only"):
        sink_from_env({EP: "http://c:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, None)
    with pytest.raises(ValueError, match="http/json"):
        sink_from_env(
            {EP: "http://c:4318", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"}, None
        )
    env = {EP: "http://c:1", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    grpc_sink({**env, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"})
    with pytest.raises(ValueError, match="otlp"):
        sink_from_env({EP: "http://c:1", "OTEL_TRACES_EXPORTER": "zipkin"}, None)


def test_env_headers() -> None:
    env = {EP: "http://c:1", "OTEL_EXPORTER_OTLP_HEADERS": "Api-Key=a%20b%3D, x-tenant = t1 ,"}
    assert grpc_sink(env).metadata == (("api-key", "a b="), ("x-tenant", "t1"))
    env["OTEL_EXPORTER_OTLP_TRACES_HEADERS"] = "only=this"
    assert grpc_sink(env).metadata == (("only", "this"),)
    assert parse_headers("") == []
    with pytest.raises(ValueError, match="key=value"):
        parse_headers("novalue")


def test_env_timeout_and_compression() -> None:
    assert grpc_sink({EP: "http://c:1"}).timeout_s == 10.0
    assert grpc_sink({EP: "http://c:1", "OTEL_EXPORTER_OTLP_TIMEOUT": "2500"}).timeout_s == 2.5
    env = {EP: "http://c:1", "OTEL_EXPORTER_OTLP_TIMEOUT": "2500"}
    assert grpc_sink({**env, "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "100"}).timeout_s == 0.1
    with pytest.raises(ValueError, match="milliseconds"):
        sink_from_env({EP: "http://c:1", "OTEL_EXPORTER_OTLP_TIMEOUT": "10s"}, None)
    assert grpc_sink({EP: "http://c:1"}).compression is None
    env = {EP: "http://c:1", "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip"}
    assert grpc_sink(env).compression == "gzip"
    assert grpc_sink({**env, "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": "none"}).compression is None
    with pytest.raises(ValueError, match="gzip or none"):
        sink_from_env({EP: "http://c:1", "OTEL_EXPORTER_OTLP_COMPRESSION": "zstd"}, None)


# ---- setup_tracing ----


def test_setup_tracing_span_dir(tmp_path: Path) -> None:
    env = {"OMNIRAIL_SPAN_DIR": str(tmp_path), "OTEL_RESOURCE_ATTRIBUTES": "team=a%2Fb,x=1"}
    telemetry = setup_tracing("omnirail-test", environ=env)
    assert telemetry.tracer.enabled and telemetry.exporter is not None
    assert telemetry.resource["service.name"] == "omnirail-test"
    assert telemetry.resource["team"] == "a/b"
    span = telemetry.tracer.start("hello", None)
    assert span is not None
    span.end()
    assert telemetry.shutdown(TIMEOUT)
    path = tmp_path / f"omnirail-test-{os.getpid()}.otlp"
    (d,) = read_span_files([path])
    assert (d["service"], d["name"]) == ("omnirail-test", "hello")


def test_setup_tracing_disabled_and_service_name(tmp_path: Path) -> None:
    telemetry = setup_tracing("omnirail-test", environ={})
    assert not telemetry.tracer.enabled and telemetry.exporter is None
    assert telemetry.tracer.start("x", None) is None
    assert telemetry.shutdown()
    env = {"OMNIRAIL_SPAN_DIR": str(tmp_path), "OTEL_SERVICE_NAME": "custom/name"}
    telemetry = setup_tracing("omnirail-test", environ=env)
    assert telemetry.service_name == "custom/name"
    assert telemetry.shutdown(TIMEOUT)
    assert [p.name.rsplit("-", 1)[0] for p in tmp_path.iterdir()] == ["custom_name"]
    env = {"OMNIRAIL_SPAN_DIR": str(tmp_path), "OTEL_TRACES_EXPORTER": "none"}
    assert setup_tracing("omnirail-test", environ=env).exporter is None


def test_setup_tracing_otlp_endpoint() -> None:
    with OtlpReceiver() as rx:
        telemetry = setup_tracing("omnirail-test", environ={EP: rx.endpoint})
        span = telemetry.tracer.start("over-grpc", None)
        assert span is not None
        span.end()
        assert telemetry.shutdown(TIMEOUT)
        (d,) = rx.wait_for(lambda got: len(got) == 1, TIMEOUT)
        assert (d["service"], d["name"]) == ("omnirail-test", "over-grpc")
