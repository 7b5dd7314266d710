"""Asks a server's grpc.health.v1 whether it is SERVING (`omnirail health`, container checks).

Needs only grpcio and grpcio-health-checking: no torch, no pipeline file.
"""

from __future__ import annotations

import os
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

    `address` is ``host:port`` or ``unix:///path``; `service` "" asks about the server as a
    whole (every omnirail process sets it once it serves), a full service name such as
    ``omnirail.v1.Omnirail`` about that service (the coordinator reports it SERVING once
    every stage has a live replica). With `security`, TLS as the mesh's own processes
    dial (its CA, and its certificate where the mesh is mutual).
    """
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
