"""Asks a server's grpc.health.v1 whether it is SERVING (`omnirail health`, container checks),
or an HTTP server's health URL whether it answers 200 (the gateway's `/health`).

Needs only grpcio and grpcio-health-checking: no torch, no pipeline file.
"""

from __future__ import annotations

import os
import ssl
import urllib.error
import urllib.request
from typing import Literal

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omnirail.transport.security import MeshSecurity, mesh_channel

DEFAULT_ADDRESS = "localhost:50051"
ADDRESS_ENV = "OMNIRAIL_HEALTH_ADDRESS"
SERVICE_ENV = "OMNIRAIL_HEALTH_SERVICE"

Reason = Literal["unreachable", "not_serving", "unknown_service", "error"]


class HealthCheckError(Exception):
    """The server is not SERVING; `str()` is a one-line reason, `reason` its kind."""

    def __init__(self, address: str, service: str, reason: Reason, detail: str) -> None:
        self.address = address
        self.service = service
        self.reason: Reason = reason
        self.detail = detail
        what = f"service {service!r} at {address}" if service else address
        super().__init__(f"{what}: {detail}")


def default_address() -> str:
    return os.environ.get(ADDRESS_ENV) or DEFAULT_ADDRESS


def default_service() -> str:
    return os.environ.get(SERVICE_ENV, "")


def check_health(
    address: str, service: str = "", timeout: float = 5.0, security: MeshSecurity | None = None
) -> None:
    """Returns when `service` at `address` reports SERVING; raises HealthCheckError otherwise.

    `address` is ``host:port`` or ``unix:///path`` (or an ``http(s)://`` URL: see
    `check_http_health`); `service` "" asks about the server as a
    whole (every omnirail process sets it once it serves), a full service name such as
    ``omnirail.v1.Omnirail`` about that service (the coordinator reports it SERVING once
    every stage has a live replica). With `security`, TLS as the mesh's own processes
    dial (its CA, and its certificate where the mesh is mutual).
    """
    if address.startswith(("http://", "https://")):
        check_http_health(address, timeout, security)
        return
    channel, _ = mesh_channel(security, address, [], aio=False)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as err:
            code = err.code() if isinstance(err, grpc.Call) else None
            detail = err.details() if isinstance(err, grpc.Call) else str(err)
            if code == grpc.StatusCode.NOT_FOUND:
                raise HealthCheckError(
                    address, service, "unknown_service", "unknown service"
                ) from None
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                first_line = (detail or "").splitlines()[0] if detail else ""
                raise HealthCheckError(
                    address,
                    service,
                    "unreachable",
                    f"unreachable ({code.name}{': ' + first_line if first_line else ''})",
                ) from None
            if code == grpc.StatusCode.UNIMPLEMENTED:
                raise HealthCheckError(
                    address, service, "error", "the server has no grpc.health.v1 service"
                ) from None
            name = code.name if code is not None else "error"
            raise HealthCheckError(address, service, "error", f"{name}: {detail}") from None
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        if reply.status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN:
            raise HealthCheckError(address, service, "unknown_service", "unknown service")
        raise HealthCheckError(address, service, "not_serving", status)


def check_http_health(url: str, timeout: float, security: MeshSecurity | None) -> None:
    """Returns when GET `url` answers 200; raises HealthCheckError otherwise. HTTPS is
    verified against the mesh's CA when it has one (the name checked is the URL's host)."""
    context = None
    if url.startswith("https://"):
        ca = security.config.tls.ca if security is not None and security.config.tls else None
        context = ssl.create_default_context(cafile=ca)
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as reply:
            status = reply.status
    except urllib.error.HTTPError as exc:
        raise HealthCheckError(url, "", "not_serving", f"HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise HealthCheckError(url, "", "unreachable", f"unreachable ({reason})") from None
    if status != 200:
        raise HealthCheckError(url, "", "not_serving", f"HTTP {status}")
