"""How the coordinator sees a gRPC call: who it is for (its principal), and how it ends
with an OmniError (the status, and the trailers that carry its stage and an overloaded
mesh's retry hint)."""

from __future__ import annotations

import grpc

from omnirail.transport.security import MeshSecurity
from omnirail.wire.errors import RETRY_AFTER_KEY, STAGE_METADATA_KEY, OmniError

__all__ = ["RETRY_AFTER_KEY", "abort_call", "principal_of"]


async def abort_call(context: grpc.aio.ServicerContext, error: OmniError) -> None:
    metadata = []
    if error.stage:
        metadata.append((STAGE_METADATA_KEY, error.stage))
    if error.retry_after_ms:
        metadata.append((RETRY_AFTER_KEY, str(error.retry_after_ms)))
    if metadata:
        context.set_trailing_metadata(tuple(metadata))
    await context.abort(error.grpc_status, error.message)


def principal_of(
    security: MeshSecurity, context: grpc.aio.ServicerContext, on_behalf_of: str = ""
) -> str:
    """The principal a request on this call is for: the bearer token's, or `on_behalf_of`
    where the call shows the mesh secret (OmniError otherwise; `MeshSecurity.caller`)."""
    return security.caller(tuple(context.invocation_metadata() or ()), on_behalf_of)
