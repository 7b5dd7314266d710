"""Turning values into wire payloads and back: the one place the stage layer uses.

Payloads up to the inline bound (and those without tensors) travel inside the message
(`inline_if_small`); larger ones go through the relay and the message carries the
descriptor (`relayed_payload`). The sending itself (inline, forward, put without waiting
or awaited, then the message) is each edge's `omnirail.stage_service.edge_sender`;
`receive_payload` reads either kind. Never imports torch (the codec imports it lazily when
it meets a torch tensor).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omnirail.relay.base import Received, Relay, RelayError, RelayHandle, shown
from omnirail.relay.inline import BACKEND as INLINE
from omnirail.relay.inline import oversize_error
from omnirail.v1 import common_pb2
from omnirail.wire.payload import Packed, PayloadError, decode_inline, encode_inline, unpack

__all__ = [
    "PayloadError",
    "ReceivedPayload",
    "RelayError",
    "decode_inline",
    "encode_inline",
    "inline_if_small",
    "inline_payload",
    "receive_payload",
    "relayed_payload",
]


def inline_payload(packed: Packed) -> common_pb2.Payload:
    """`packed` with its tensor bytes inside the message."""
    return common_pb2.Payload(header=packed.header, inline_data=packed.to_bytes())


def inline_if_small(packed: Packed, relay: Relay, inline_bytes: int) -> common_pb2.Payload | None:
    """The inline payload when `packed` travels in the message; None when it must go
    through `relay`. Raises when it is too large and the relay cannot carry it."""
    if packed.nbytes <= inline_bytes or packed.num_tensors == 0:
        return inline_payload(packed)
    if relay.name == INLINE:
        raise oversize_error(packed.nbytes, inline_bytes)
    return None


def relayed_payload(packed: Packed, handle: RelayHandle) -> common_pb2.Payload:
    """`packed`'s header with the descriptor of where `relay.put` left its bytes."""
    pb = common_pb2.Payload(header=packed.header)
    pb.relay.CopyFrom(handle.descriptor)  # cheaper than passing relay= to the constructor
    return pb


class ReceivedPayload:
    """A decoded value; with zero-copy views they are valid until `release()`."""

    __slots__ = ("_received", "value")

    def __init__(self, value: Any, received: Received | None = None) -> None:
        self.value = value
        self._received = received

    def release(self) -> None:
        """Returns the relay view; idempotent. Views in `value` must not be used after."""
        received, self._received = self._received, None
        if received is not None:
            received.release()

    def __enter__(self) -> ReceivedPayload:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


async def receive_payload(
    pb: common_pb2.Payload,
    relays: Mapping[str, Relay],
    *,
    copy: bool = False,
    device: str | None = None,
    owners: frozenset[str] | None = None,
) -> ReceivedPayload:
    """Decodes `pb`, reading through `relays[backend]` when it names a relay.

    copy=False: tensors are read-only views (of the relay segment, or of the message's
    bytes when inline). device: where tensors the sender had on a GPU go (the receiving
    stage's GPU; None: the CPU). owners: the relay peer ids the item's authenticated sender
    announced (`Relay.get`); None: no binding (in-process callers). Raises PayloadError
    for a bad header, RelayError for a bad descriptor or unknown backend; nothing stays
    acquired on error.
    """
    if pb.WhichOneof("body") != "relay":
        return ReceivedPayload(unpack(pb.header, pb.inline_data, copy=copy, device=device))
    desc = pb.relay
    relay = relays.get(desc.backend)
    if relay is None:
        raise RelayError(
            f"payload uses relay backend {shown(desc.backend)}, which this process has not "
            f"configured (have: {', '.join(sorted(relays)) or 'none'})"
        )
    received = await relay.get(desc, owners)
    try:
        if len(received.buffer) != desc.nbytes:
            raise RelayError(
                f"relay returned {len(received.buffer)} bytes for a descriptor of {desc.nbytes}"
            )
        value = unpack(pb.header, received.buffer, copy=copy, device=device)
    except BaseException:
        received.release()
        raise
    if copy:
        received.release()
        return ReceivedPayload(value)
    return ReceivedPayload(value, received)
