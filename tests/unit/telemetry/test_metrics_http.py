"""The `/metrics` endpoint: where it listens, plain HTTP, and HTTPS with the mesh's
material (a client certificate required when the mesh is mutual), which one silent or
plaintext client cannot stop."""

from __future__ import annotations

import socket
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter

from omnirail.config import MetricsConfig, PipelineConfig
from omnirail.ops.certs import make_mesh_material
from omnirail.telemetry.metrics_http import (
    dial_address,
    metrics_endpoint,
    start_metrics_server,
    stop_metrics_server,
)
from omnirail.transport.security import MeshSecurity, SecurityError


def _registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("omnirail_probe", "a counter to find", registry=registry).inc(3)
    return registry


@pytest.fixture(scope="module")
def material(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tls")
    make_mesh_material(folder, ["localhost"])
    return folder


def _security(material: Path, *, mutual: bool) -> MeshSecurity:
    cfg = PipelineConfig.from_dict(
        {
            "stages": [
                {"name": "a", "factory": "tests.unit.stage_service.stage_fakes:make_plain",
                 "terminal": True}
            ],
            "security": {
                "tls": {
                    "cert": str(material / "mesh.pem"),
                    "key": str(material / "mesh.key"),
                    "ca": str(material / "ca.pem"),
                    "mutual": mutual,
                }
            },
        }
    )  # fmt: skip
    return MeshSecurity(cfg.security, environ={})


def _client(material: Path, *, with_cert: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(material / "ca.pem"))
    if with_cert:
        context.load_cert_chain(str(material / "mesh.pem"), str(material / "mesh.key"))
    return context


def _get(url: str, context: ssl.SSLContext | None = None) -> str:
    with urllib.request.urlopen(url, timeout=10, context=context) as resp:
        return resp.read().decode()


@pytest.fixture
def served(material: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    tls = _security(material, mutual=request.param).metrics_tls()
    address = start_metrics_server(_registry(), "127.0.0.1", 0, tls)
    yield address.replace("127.0.0.1", "localhost")  # the name the certificate gives
    stop_metrics_server(address)


@pytest.mark.parametrize("served", [False], indirect=True)
def test_https_with_the_mesh_certificate(served: str, material: Path) -> None:
    body = _get(f"https://{served}/metrics", _client(material, with_cert=False))
    assert "omnirail_probe_total 3.0" in body
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        _get(f"https://{served}/metrics", ssl.create_default_context())  # system roots only


@pytest.mark.parametrize("served", [True], indirect=True)
def test_mutual_requires_a_client_certificate_from_the_mesh_ca(
    served: str, material: Path, tmp_path: Path
) -> None:
    body = _get(f"https://{served}/metrics", _client(material, with_cert=True))
    assert "omnirail_probe_total 3.0" in body
    with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
        _get(f"https://{served}/metrics", _client(material, with_cert=False))
    stranger = tmp_path / "stranger"
    make_mesh_material(stranger, ["localhost"])  # a certificate from another CA
    foreign = ssl.create_default_context(cafile=str(material / "ca.pem"))
    foreign.load_cert_chain(str(stranger / "mesh.pem"), str(stranger / "mesh.key"))
    with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
        _get(f"https://{served}/metrics", foreign)
    # Refused connections cost the server nothing: it still serves.
    assert "omnirail_probe_total" in _get(
        f"https://{served}/metrics", _client(material, with_cert=True)
    )


@pytest.mark.parametrize("served", [False], indirect=True)
def test_a_silent_or_plaintext_client_does_not_stop_the_scrapes(
    served: str, material: Path
) -> None:
    host, port = served.rsplit(":", 1)
    silent = socket.create_connection((host, int(port)))  # connects, never says hello
    try:
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            _get(f"http://{served}/metrics")  # plain HTTP on the HTTPS port
        started = time.monotonic()
        body = _get(f"https://{served}/metrics", _client(material, with_cert=False))
        assert "omnirail_probe_total" in body
        # prometheus_client's own TLS server waits out the silent client here (its
        # handshake runs in the accept loop): the scrape would time out after 10 s.
        assert time.monotonic() - started < 8
    finally:
        silent.close()


def test_plain_http_without_tls() -> None:
    address = start_metrics_server(_registry(), "127.0.0.1", 0)
    try:
        assert "omnirail_probe_total 3.0" in _get(f"http://{address}/metrics")
    finally:
        stop_metrics_server(address)
    with pytest.raises(urllib.error.URLError):
        _get(f"http://{address}/metrics")


def test_no_tls_section_serves_plaintext() -> None:
    assert MeshSecurity(None, environ={}).metrics_tls() is None


def test_a_key_that_does_not_match_is_named(material: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    make_mesh_material(other, ["localhost"])
    cfg = PipelineConfig.from_dict(
        {
            "stages": [
                {"name": "a", "factory": "tests.unit.stage_service.stage_fakes:make_plain",
                 "terminal": True}
            ],
            "security": {
                "tls": {"cert": str(material / "mesh.pem"), "key": str(other / "mesh.key")}
            },
        }
    )  # fmt: skip
    with pytest.raises(SecurityError, match=r"tls.cert .*mesh.pem.* / tls.key"):
        MeshSecurity(cfg.security, environ={}).metrics_tls()


def test_metrics_endpoint_flags_win_over_config() -> None:
    cfg = MetricsConfig(host="0.0.0.0", port=9100, stage_port=9200)
    assert metrics_endpoint(cfg, stage=False) == ("0.0.0.0", 9100)
    assert metrics_endpoint(cfg, stage=True) == ("0.0.0.0", 9200)
    assert metrics_endpoint(cfg, stage=True, port=0, host="127.0.0.2") == ("127.0.0.2", 0)
    assert metrics_endpoint(cfg, stage=False, port=-1) is None
    off = MetricsConfig(enabled=False)
    assert metrics_endpoint(off, stage=False) is None
    assert metrics_endpoint(off, stage=False, port=9300) == ("127.0.0.1", 9300)
    with pytest.raises(ValueError, match="out of range"):
        metrics_endpoint(cfg, stage=False, port=70000)
    with pytest.raises(ValueError, match="out of range"):
        metrics_endpoint(cfg, stage=False, port=-2)


def test_dial_address_uses_the_advertised_host_for_a_wildcard_bind() -> None:
    assert dial_address("127.0.0.1:9100", "0.0.0.0", "10.0.0.5:7000") == "10.0.0.5:9100"
    assert dial_address("[::1]:9100", "::", "[fd00::5]:7000") == "[fd00::5]:9100"
    assert dial_address("127.0.0.1:9100", "127.0.0.1", "10.0.0.5:7000") == "127.0.0.1:9100"
    assert dial_address("127.0.0.1:9100", "0.0.0.0", None) == "127.0.0.1:9100"
    assert dial_address("127.0.0.1:9100", "0.0.0.0", "unix:///tmp/s.sock") == "127.0.0.1:9100"


def test_wildcard_host_reports_a_dialable_address() -> None:
    address = start_metrics_server(_registry(), "0.0.0.0", 0)
    try:
        assert address.startswith("127.0.0.1:")
        assert "omnirail_probe_total" in _get(f"http://{address}/metrics")
    finally:
        stop_metrics_server(address)


def test_an_ipv6_host_is_served_on_ipv6() -> None:
    try:
        address = start_metrics_server(_registry(), "::1", 0)
    except OSError:
        pytest.skip("no IPv6 loopback here")
    try:
        assert address.startswith("[::1]:")
        assert "omnirail_probe_total" in _get(f"http://{address}/metrics")
    finally:
        stop_metrics_server(address)
