"""What the conformance suite knows about the `nixl` relay backend."""

from __future__ import annotations

from tests.relay_conformance.backends import BackendSpec, Garbage, pool_footprint, with_fields

NIXL = BackendSpec(
    "nixl",
    # Short waits: a garbage descriptor naming an unknown peer or segment fails fast.
    options={"peer_wait_s": 1.0, "fetch_timeout_s": 20.0},
    footprint=pool_footprint,
    garbage=(
        # A segment the sender never had: it answers "no such segment".
        Garbage("unknown-segment", lambda d, p: with_fields(d, offset=(7 << 40) | 64)),
        # Inside a real segment's index but past its end (the offset is within 2**40).
        Garbage("past-segment-end", lambda d, p: with_fields(d, nbytes=d.nbytes + (1 << 30))),
        Garbage("offset-past-segment", lambda d, p: with_fields(d, offset=d.offset + (1 << 36))),
    ),
)
