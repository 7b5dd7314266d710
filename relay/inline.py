"""`inline` relay: payload bytes ride inside the control message, up to the inline bound.

A sender never calls `put` for payloads within the bound (`relay.io.inline_if_small`), so
with this backend configured a larger payload is an error rather than a silent MiB-sized
protobuf.
"""

from __future__ import annotations

from omnirail.relay.base import (
    Received,
    Relay,
    RelayError,
    RelayHandle,
    RelaySettings,
    shown,
)
from omnirail.relay.options import InlineOptions
from omnirail.v1 import common_pb2
from omnirail.wire.payload import Packed

BACKEND = "inline"


def oversize_error(nbytes: int, inline_bytes: int) -> RelayError:
    return RelayError(
        f"payload of {nbytes} bytes exceeds the inline bound {inline_bytes}; "
        "configure a relay backend such as shm"
    )


class InlineRelay(Relay):
    name = BACKEND

    def __init__(self, settings: RelaySettings | None = None) -> None:
        self.settings = settings or RelaySettings()
        self.options = self.settings.options_as(BACKEND, InlineOptions)

    async def put(self, packed: Packed, request_id: str, edge: str) -> RelayHandle:
        raise RelayError(
            f"payload of {packed.nbytes} bytes cannot leave the message with the inline "
            "relay; configure a relay backend such as shm"
        )

    async def get(
        self, descriptor: common_pb2.RelayDescriptor, owners: frozenset[str] | None = None
    ) -> Received:
        # Whatever came in (not even a descriptor, maybe), only RelayError goes out.
        if type(descriptor) is common_pb2.RelayDescriptor:
            what = f"one for {shown(descriptor.backend)}"
        else:
            what = f"a {type(descriptor).__name__}"
        raise RelayError(f"the inline relay reads no descriptors (got {what})")

    def cleanup(self, request_id: str) -> None:
        pass

    def close(self) -> None:
        pass
