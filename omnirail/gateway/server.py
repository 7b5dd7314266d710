"""Runs the gateway: uvicorn (HTTPS with the pipeline's TLS material), bearer tokens, and a
client of the coordinator that speaks TLS and shows a token when the mesh wants them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn
from starlette.websockets import WebSocket

from omnirail.client.connect import client_options
from omnirail.client.sdk import AsyncClient
from omnirail.config import PipelineConfig
from omnirail.gateway.app import create_app
from omnirail.gateway.asgi import CountRequests
from omnirail.gateway.errors import ApiError
from omnirail.gateway.mesh import Gateway
from omnirail.gateway.realtime.endpoint import PRINCIPAL_SCOPE_KEY, deny, offered_token
from omnirail.telemetry import setup_tracing
from omnirail.transport.security import SecretSet, mesh_security

log = logging.getLogger(__name__)

# Probes and scrapers reach these without a token (they tell nothing a caller could use).
OPEN_PATHS = frozenset({"/health", "/metrics"})


class TokenAuth:
    """ASGI middleware: every route but OPEN_PATHS needs `Authorization: Bearer <token>`
    naming one of the mesh's client tokens (compared as digests, never logged); the
    token's principal goes to the routes in the scope (`PRINCIPAL_SCOPE_KEY`).

    WebSocket handshakes (`/v1/realtime`) need the same token, in the same header or, from
    browsers (which cannot set headers), as the `openai-insecure-api-key.<token>`
    subprotocol; a refused one gets the same 401 as an HTTP request, before any session
    exists (403 on a server without WebSocket denial responses)."""

    def __init__(self, app: Any, tokens: SecretSet) -> None:
        self.app = app
        self.tokens = tokens

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket") or scope["path"] in OPEN_PATHS or not self.tokens:
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        subprotocols = list(scope.get("subprotocols") or []) if kind == "websocket" else []
        token = offered_token(header.decode("latin-1"), subprotocols)
        principal = self.tokens.lookup(_raw(token)) if token is not None else None
        if token is None:
            problem = "missing bearer token: send Authorization: Bearer <token>"
        elif principal is None:
            problem = "invalid bearer token"
        else:
            # The routes forward it to the coordinator with each request (on_behalf_of).
            await self.app({**scope, PRINCIPAL_SCOPE_KEY: principal}, receive, send)
            return
        error = ApiError(401, problem, code="invalid_api_key")
        headers = {"www-authenticate": "Bearer"}
        if kind == "websocket":
            await deny(WebSocket(scope, receive, send), 401, error.body(), headers)
            return
        response = error.response()
        response.headers.update(headers)
        await response(scope, receive, send)


def _raw(token: str) -> bytes:
    """The token's bytes as the client sent them (headers arrive as latin-1)."""
    try:
        return token.encode("latin-1")
    except UnicodeEncodeError:
        return token.encode()


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: it re-raises SIGTERM after shutting down
    (so the process would end "killed by SIGTERM"); `serve` stops it on SIGTERM itself
    and exits 0 once the responses in flight ended."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def parse_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--listen: expected HOST:PORT, got {listen!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


async def serve(
    pipeline: PipelineConfig,
    coordinator: str,
    listen: str,
    ready_file: str | None = None,
) -> None:
    """Serves until SIGINT/SIGTERM; writes `http(s)://host:port` to `ready_file` once up."""
    if pipeline.api.openai is None:
        raise ValueError(
            f"pipeline {pipeline.name!r} has no api.openai section: nothing to serve over HTTP"
        )
    security = mesh_security(pipeline)
    telemetry = setup_tracing("omnirail-gateway")
    options = client_options(security)
    # The coordinator attributes each request to the HTTP caller's principal, which it takes
    # from a call that shows the mesh secret; without one, requests are the gateway's own.
    forward = bool(security.tokens) and bool(security.mesh_metadata())
    if security.tokens and not forward:
        log.warning(
            "security: no mesh_secret_file: the coordinator counts every HTTP caller's "
            "requests as the gateway's own principal (quotas cannot tell them apart)"
        )
    metadata = security.mesh_metadata() if forward else ()
    gateway = Gateway(
        pipeline,
        lambda: AsyncClient(coordinator, tensors="numpy", metadata=metadata, **options),
        tracer=telemetry.tracer,
        forward_principals=forward,
    )
    # Outermost: refusals are counted too.
    app = CountRequests(TokenAuth(create_app(gateway), security.tokens), gateway.metrics)
    host, port = parse_listen(listen)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    tls = security.config.tls
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        ssl_certfile=tls.cert if tls is not None else None,
        ssl_keyfile=tls.key if tls is not None else None,
        timeout_graceful_shutdown=pipeline.drain_s,
        loop="none",  # the running loop (uvloop when omnirail.tuning.aio made it)
    )
    server = _Server(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    if security.tokens and tls is None and host not in ("127.0.0.1", "::1", "localhost"):
        log.warning("security: bearer tokens over plain HTTP: anyone on the path can read them")
    scheme = "https" if tls is not None else "http"
    bound = sock.getsockname()
    address = f"{scheme}://{bound[0]}:{bound[1]}"

    async def announce() -> None:
        while not server.started:
            await asyncio.sleep(0.01)
        log.info("gateway for %r at %s (coordinator %s)", pipeline.model_name, address, coordinator)
        if ready_file:
            tmp = Path(ready_file).with_suffix(".tmp")
            tmp.write_text(address)
            tmp.replace(ready_file)

    task = loop.create_task(announce())
    try:
        await server.serve(sockets=[sock])
    finally:
        task.cancel()
        telemetry.shutdown()
