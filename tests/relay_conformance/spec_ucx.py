"""What the conformance suite knows about the `ucx` relay backend."""

from __future__ import annotations

from tests.relay_conformance.backends import BackendSpec, Garbage, pool_footprint, with_fields

UCX = BackendSpec(
    "ucx",
    options={"peer_wait_s": 1.0, "fetch_timeout_s": 30.0},
    footprint=pool_footprint,
    # Descriptors naming a live sender but no live transfer of it: the sender answers with
    # an error status (the receiver must raise, not wait for bytes that never come).
    garbage=(
        Garbage("stale-transfer-id", lambda d, p: with_fields(d, transfer_id=d.transfer_id + 999)),
        Garbage("transfer-id-zero", lambda d, p: with_fields(d, transfer_id=0)),
        Garbage("shifted-offset", lambda d, p: with_fields(d, offset=d.offset + 4096)),
        Garbage("short-nbytes", lambda d, p: with_fields(d, nbytes=d.nbytes - 1)),
        Garbage("long-nbytes", lambda d, p: with_fields(d, nbytes=d.nbytes + 4096)),
    ),
)
