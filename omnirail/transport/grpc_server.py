"""What every omnirail gRPC server shares: options, health, reflection, binding."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from omnirail.transport.deliver import channel_options
from omnirail.transport.malformed import MalformedGuard
from omnirail.transport.security import MeshSecurity

log = logging.getLogger(__name__)

# Calls the server has taken from the network but the event loop has not picked up yet.
# gRPC's defaults (1,000, then random refusals up to 3,000) answer a flood of calls with a
# bare CANCELLED before the coordinator's admission sees them: past this bound they are
# RESOURCE_EXHAUSTED ("Too many pending requests"), so it is set far above any admission
# limit (max_live_requests) for the mesh's own refusal, with its retry hint, to be what a
# client meets. A waiting call costs about 16 KiB of the server's memory (measured: 20,000
# waiting calls, 306 MB), so this bound is also a bound of 256 MiB on what a flood holds.
MAX_PENDING_CALLS = 1 << 14
SERVER_OPTIONS = [
    ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
    ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
]

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def create_server(
    service_names: Iterable[str],
    *,
    max_message_bytes: int,
    security: MeshSecurity | None = None,
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """An aio server with grpc.health.v1 and reflection for `service_names` installed;
    with `security`, every call is checked against its method's policy first."""
    # Credentials first: a stranger's bytes are not even parsed.
    interceptors: list[grpc.aio.ServerInterceptor] = []
    if security is not None and (auth := security.interceptor()) is not None:
        interceptors.append(auth)
    interceptors.append(MalformedGuard())
    server = grpc.aio.server(
        options=[*channel_options(max_message_bytes), *SERVER_OPTIONS], interceptors=interceptors
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    return server, health_servicer


def bind(
    server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None = None
) -> str:
    """Binds `address` (``unix:///path`` or ``host:port``; port 0 picks one), with TLS when
    `credentials` are given.

    Returns the address peers should dial.
    """

    def add_port(where: str) -> int:
        try:
            if credentials is None:
                return server.add_insecure_port(where)
            return server.add_secure_port(where, credentials)
        except RuntimeError as exc:  # grpc's "Failed to bind to address ..."
            # An address in use or not this host's is the caller's to fix: said as one
            # OSError line (the CLI prints it), not a traceback from inside grpc.
            raise OSError(f"cannot listen on {where}: {exc}") from None

    if address.startswith("unix:"):
        path = address.split(":", 1)[1].removeprefix("//")
        if os.path.exists(path):
            os.unlink(path)  # a stale socket from a killed process
        add_port(address)
        return address
    port = add_port(address)
    if port == 0:
        raise OSError(f"cannot bind {address}")
    host = address.rsplit(":", 1)[0]
    if host in ("", "0.0.0.0", "[::]"):
        host = "127.0.0.1"
    return f"{host}:{port}"


async def write_until_read_ends(
    context: grpc.aio.ServicerContext,
    read: Coroutine[Any, Any, None],
    wake: asyncio.Event,
    take: Callable[[], Any | None],
) -> None:
    """The write side of a bidi servicer: runs `read` as a task and, until it ends, writes
    whatever `take()` returns each time `wake` is set (None: nothing pending). Whoever
    queues something sets `wake`, so a burst goes out as one write.
    """
    reader = asyncio.get_running_loop().create_task(read)
    reader.add_done_callback(lambda _: wake.set())
    try:
        while True:
            message = take()
            if message is not None:
                await context.write(message)
            elif reader.done():
                if not reader.cancelled() and reader.exception() is not None:
                    log.warning("stream reader ended: %s", reader.exception())
                return
            else:
                wake.clear()
                await wake.wait()
    finally:
        reader.cancel()
