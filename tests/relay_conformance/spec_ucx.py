"""What the conformance suite knows about the `ucx` relay backend."""

from __future__ import annotations

from typing import Any

from omnirail.v1 import common_pb2
from relay.base import Relay
from tests.relay_conformance.backends import BackendSpec, Garbage


def _with(good: common_pb2.RelayDescriptor, **fields: Any) -> common_pb2.RelayDescriptor:
    bad = common_pb2.RelayDescriptor()
    bad.CopyFrom(good)
    for key, value in fields.items():
        setattr(bad, key, value)
    return bad


def _footprint(relay: Relay) -> int:
    return relay.pool.nbytes  # type: ignore[attr-defined]


UCX = BackendSpec(
    "ucx",
    options={"peer_wait_s": 1.0, "fetch_timeout_s": 30.0},
    footprint=_footprint,
    # Descriptors naming a live sender but no live transfer of it: the sender answers with
    # an error status (the receiver must raise, not wait for bytes that never come).
    garbage=(
        Garbage("stale-transfer-id", lambda d, p: _with(d, transfer_id=d.transfer_id + 999)),
        Garbage("transfer-id-zero", lambda d, p: _with(d, transfer_id=0)),
        Garbage("shifted-offset", lambda d, p: _with(d, offset=d.offset + 4096)),
        Garbage("short-nbytes", lambda d, p: _with(d, nbytes=d.nbytes - 1)),
        Garbage("long-nbytes", lambda d, p: _with(d, nbytes=d.nbytes + 4096)),
    ),
)
