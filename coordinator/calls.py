"""How the coordinator ends a gRPC call with an OmniError: the status, and the trailers
that carry its stage and an overloaded mesh's retry hint."""

from __future__ import annotations

import grpc

from omnirail.coordinator.requests import Overloaded
from omnirail.wire.errors import STAGE_METADATA_KEY, OmniError

# Trailing metadata carrying an overloaded mesh's retry hint (`Overloaded`).
RETRY_AFTER_KEY = "retry-after-ms"


async def abort_call(context: grpc.aio.ServicerContext, error: OmniError) -> None:
    metadata = []
    if error.stage:
        metadata.append((STAGE_METADATA_KEY, error.stage))
    if isinstance(error, Overloaded):
        metadata.append((RETRY_AFTER_KEY, str(error.retry_after_ms)))
    if metadata:
        context.set_trailing_metadata(tuple(metadata))
    await context.abort(error.grpc_status, error.message)
