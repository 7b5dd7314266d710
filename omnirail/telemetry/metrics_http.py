"""A process's Prometheus `/metrics` endpoint: where it listens, and the HTTP(S) server.

One server per service process, on a daemon thread, one thread per connection. With TLS
(the mesh's `security.tls`), it serves HTTPS with the mesh's certificate and, when the mesh
is `mutual`, requires a client certificate from the mesh's CA, as the stages' gRPC servers
do. prometheus_client's own TLS server is not used: it wraps the listening socket, so the
TLS handshake runs in its accept loop, and one client that connects and says nothing stops
every scrape until it leaves. Here the handshake runs in the connection's own thread, under
a timeout.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from omnirail.config import MetricsConfig

log = logging.getLogger(__name__)

# A connection that has not finished its handshake, or sent its request, by then is closed:
# a scrape is one short request, and a stuck client must not hold a thread for ever.
CONNECTION_TIMEOUT_S = 10.0

_WILDCARDS = ("", "0.0.0.0", "::")
_servers: dict[str, tuple[MetricsServer, threading.Thread]] = {}
_servers_lock = threading.Lock()


class _QuietHandler(WSGIRequestHandler):
    timeout = CONNECTION_TIMEOUT_S  # StreamRequestHandler sets it on the connection

    def log_message(self, format: str, *args: Any) -> None:
        """A scrape every few seconds is not worth a log line."""


class MetricsServer(ThreadingMixIn, WSGIServer):
    """A WSGI server, one daemon thread per connection; with `tls`, each connection's TLS
    handshake runs in that connection's thread."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], tls: ssl.SSLContext | None) -> None:
        self.address_family = _family(address[0])
        self.tls = tls
        super().__init__(address, _QuietHandler)

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self.tls is None:
            super().finish_request(request, client_address)
            return
        request.settimeout(CONNECTION_TIMEOUT_S)
        try:
            secured = self.tls.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError) as exc:
            # Plain HTTP on the HTTPS port, no or a foreign client certificate, a peer gone:
            # that connection ends; the server serves on.
            log.debug("metrics: TLS handshake with %s failed: %s", client_address, exc)
            return
        try:
            super().finish_request(secured, client_address)
        finally:
            secured.close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """One connection's failure (a reset, a timeout) is that connection's; the default
        prints a traceback to stderr."""
        log.debug("metrics: connection from %s failed", client_address, exc_info=True)


def metrics_endpoint(
    cfg: MetricsConfig, *, stage: bool, host: str | None = None, port: int | None = None
) -> tuple[str, int] | None:
    """Where a process serves /metrics: the `--metrics-host`/`--metrics-port` flags win
    over the pipeline's `metrics` config; a port of -1 (or `enabled: false` without a
    port flag) means no endpoint."""
    if port is None:
        if not cfg.enabled:
            return None
        port = cfg.stage_port if stage else cfg.port
    if port == -1:
        return None
    if not 0 <= port <= 65535:
        raise ValueError(f"metrics port {port} is out of range (0-65535, or -1 for none)")
    return (cfg.host if host is None else host), port


def start_metrics_server(
    registry: CollectorRegistry, host: str, port: int, tls: ssl.SSLContext | None = None
) -> str:
    """Serves `registry` at http://ADDRESS/metrics (https:// with `tls`, a server-side
    context) on a daemon thread; returns ADDRESS (host:port, the port actually bound:
    `port` 0 picks a free one).

    A wildcard host comes back as loopback, like `omnirail.transport.grpc_server.bind`, since the
    address is meant to be dialed. Stop it with `stop_metrics_server(ADDRESS)`.

    Turns off prometheus_client's `*_created` series for the whole process: one more
    unitless series per counter and histogram child that nothing here reads.
    """
    from prometheus_client import disable_created_metrics, make_wsgi_app

    disable_created_metrics()
    host = host.strip("[]")
    server = MetricsServer((host or "0.0.0.0", port), tls)
    server.set_app(make_wsgi_app(registry))
    thread = threading.Thread(target=server.serve_forever, name="metrics", daemon=True)
    thread.start()
    if host in _WILDCARDS:
        host = "::1" if host == "::" else "127.0.0.1"
    address = _join(host, server.server_port)
    with _servers_lock:
        _servers[address] = (server, thread)
    return address


def stop_metrics_server(address: str, *, wait: bool = True) -> None:
    """Stops the endpoint `start_metrics_server` returned `address` for (blocks for up to
    the server's 0.5 s poll interval; `wait=False`: stops it from a daemon thread, for a
    process about to exit, whose exit must not wait on that poll)."""
    with _servers_lock:
        found = _servers.pop(address, None)
    if found is None:
        return
    server, thread = found
    if not wait:
        threading.Thread(target=_stop, args=(server, thread), daemon=True).start()
        return
    _stop(server, thread)


def _stop(server: MetricsServer, thread: threading.Thread) -> None:
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def dial_address(address: str, host: str, advertise: str | None) -> str:
    """The address to publish for discovery: an endpoint bound to every interface (`host`
    a wildcard) is dialed at the host its stage advertises for Deliver, not loopback."""
    if host.strip("[]") not in _WILDCARDS or not advertise or advertise.startswith("unix:"):
        return address
    if ":" not in advertise:
        return address
    return _join(advertise.rsplit(":", 1)[0].strip("[]"), int(address.rsplit(":", 1)[1]))


def _family(host: str) -> socket.AddressFamily:
    """IPv6 for an IPv6 host (or a name that resolves only to one), else IPv4."""
    try:
        infos = socket.getaddrinfo(
            host or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror:
        return socket.AF_INET
    return socket.AddressFamily(infos[0][0])


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
