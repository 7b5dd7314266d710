"""What the conformance suite knows about the `nixl` relay backend."""

from __future__ import annotations

from typing import Any

from omnirail.v1 import common_pb2
from relay.base import Relay
from tests.relay_conformance.backends import BackendSpec, Garbage

Descriptor = common_pb2.RelayDescriptor


def _with(good: Descriptor, **fields: Any) -> Descriptor:
    bad = Descriptor()
    bad.CopyFrom(good)
    for key, value in fields.items():
        setattr(bad, key, value)
    return bad


def _footprint(relay: Relay) -> int:
    return relay.pool.nbytes  # type: ignore[attr-defined]


NIXL = BackendSpec(
    "nixl",
    # Short waits: a garbage descriptor naming an unknown peer or segment fails fast.
    options={"peer_wait_s": 1.0, "fetch_timeout_s": 20.0},
    footprint=_footprint,
    garbage=(
        # A segment the sender never had: it answers "no such segment".
        Garbage("unknown-segment", lambda d, p: _with(d, offset=(7 << 40) | 64)),
        # Inside a real segment's index but past its end (the offset is within 2**40).
        Garbage("past-segment-end", lambda d, p: _with(d, nbytes=d.nbytes + (1 << 30))),
        Garbage("offset-past-segment", lambda d, p: _with(d, offset=d.offset + (1 << 36))),
    ),
)
