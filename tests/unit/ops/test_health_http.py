"""`omnirail health` with an http(s):// address: healthy on 200, a precise reason otherwise."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

from omnirail.ops.health import HealthCheckError, check_health


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 503)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_200_is_healthy(server: str) -> None:
    check_health(f"{server}/health", timeout=5)


def test_another_status_is_not_serving(server: str) -> None:
    with pytest.raises(HealthCheckError) as info:
        check_health(f"{server}/starting", timeout=5)
    assert info.value.reason == "not_serving" and "HTTP 503" in str(info.value)


def test_nothing_listening_is_unreachable() -> None:
    with pytest.raises(HealthCheckError) as info:
        check_health("http://127.0.0.1:9/health", timeout=5)
    assert info.value.reason == "unreachable"
