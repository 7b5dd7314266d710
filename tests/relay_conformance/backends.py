"""The relay backends under test and what the suite may know about each of them.

Adding a backend is one line in `BACKENDS`. Everything in `BackendSpec` beyond the name is
optional: a probe left out makes the tests that need it skip with a reason, never fail.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omnirail.relay.base import Relay, RelaySettings
from omnirail.v1 import common_pb2

Descriptor = common_pb2.RelayDescriptor


@dataclass(frozen=True)
class Garbage:
    """A descriptor a receiver must refuse with RelayError, derived from a good one."""

    name: str
    corrupt: Callable[[Descriptor, str], Descriptor]  # (good descriptor, name prefix)
    # Set while a backend is known to accept it: the case then runs as a strict xfail.
    xfail: str | None = None


@dataclass(frozen=True)
class BackendSpec:
    name: str
    # Whether it carries torch.cuda tensors: every backend does, staged through host memory
    # by `pack` (a backend moving device memory itself would be tested by the same cases).
    # The `device=cuda` cases skip without CUDA.
    gpu: bool = True
    options: dict[str, Any] = field(default_factory=dict)  # RelaySettings.options
    # Other RelaySettings fields every relay of the backend needs (torchdist: rank, world).
    settings: dict[str, Any] = field(default_factory=dict)
    # Bytes of pool memory a sender holds (to see that repeated transfers reuse it).
    footprint: Callable[[Relay], int] | None = None
    # OS-visible names (files, segments) under a name prefix, and how to remove leftovers.
    leftovers: Callable[[str], list[str]] = lambda prefix: []
    sweep: Callable[[str], object] = lambda prefix: None
    # Whether a receiver creates such names too (a killed one leaves them for `sweep`).
    receiver_names: bool = False
    garbage: tuple[Garbage, ...] = ()
    # Set while the backend does not yet bind descriptors to their sender or refuse stale
    # and guessed transfer ids (issue 37): its trust cases then run as non-strict xfails.
    trust_pending: str | None = None
    # Settings of a further relay that must pair with the first one made in a test (ranks
    # and rendezvous address of torchdist): (first relay, base settings, index) -> settings.
    pair_settings: Callable[[Relay, RelaySettings, int], RelaySettings] | None = None


def with_fields(good: Descriptor, **fields: Any) -> Descriptor:
    """A copy of `good` with `fields` changed (garbage cases derive from good descriptors)."""
    bad = Descriptor()
    bad.CopyFrom(good)
    for key, value in fields.items():
        setattr(bad, key, value)
    return bad


# Garbage every backend must refuse. Regions are opaque strings whose meaning differs per
# backend, so these only use what no backend may accept: names it never handed out,
# path syntax, and offsets or sizes no pool can have.
GENERIC_GARBAGE = (
    Garbage("wrong-backend", lambda d, p: with_fields(d, backend="no-such-backend")),
    Garbage("empty-backend", lambda d, p: with_fields(d, backend="")),
    Garbage("unknown-region", lambda d, p: with_fields(d, region=f"{p}-no-such-region")),
    Garbage("region-suffix", lambda d, p: with_fields(d, region=d.region + "9")),
    Garbage("empty-region", lambda d, p: with_fields(d, region="")),
    Garbage("traversal-relative", lambda d, p: with_fields(d, region="../../../../etc/passwd")),
    Garbage("traversal-absolute", lambda d, p: with_fields(d, region="/etc/passwd")),
    Garbage("traversal-dotdot", lambda d, p: with_fields(d, region="..")),
    Garbage("traversal-dot", lambda d, p: with_fields(d, region=".")),
    Garbage(
        "traversal-inside", lambda d, p: with_fields(d, region=d.region + "/../../etc/hostname")
    ),
    Garbage("nul-in-region", lambda d, p: with_fields(d, region=d.region + "\x00")),
    Garbage("huge-region-name", lambda d, p: with_fields(d, region="a" * 100_000)),
    Garbage("offset-past-pool", lambda d, p: with_fields(d, offset=d.offset + (1 << 40))),
    Garbage("absurd-nbytes", lambda d, p: with_fields(d, nbytes=1 << 62)),
    Garbage("offset-wraps", lambda d, p: with_fields(d, offset=2**64 - 1, nbytes=2)),
    Garbage("all-max", lambda d, p: with_fields(d, offset=2**64 - 1, nbytes=2**64 - 1)),
)


def pool_footprint(relay: Relay) -> int:
    """Pool bytes of a receiver-pulled relay (`omnirail.relay.pull.PullRelay`)."""
    return relay.pool.nbytes  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------- shm


def _shm_names(prefix: str) -> list[str]:
    from omnirail.relay.shm_pool import SHM_DIR

    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix + "-"))


def _shm_footprint(relay: Relay) -> int:
    return sum(seg.size for seg in relay.pool.segments)  # type: ignore[attr-defined]


def _shm_sweep(prefix: str) -> int:
    from omnirail.relay.shm import sweep_segments

    return sweep_segments(prefix)


def _shm_marks_region(d: Descriptor, prefix: str) -> Descriptor:
    from omnirail.relay.shm_pool import marks_name

    return with_fields(d, region=marks_name(d.region), offset=0, nbytes=8)


SHM = BackendSpec(
    "shm",
    footprint=_shm_footprint,
    leftovers=_shm_names,
    sweep=_shm_sweep,
    garbage=(
        # shm returns credit through the transfer id's release slot; slot 0 names none.
        Garbage("no-release-slot", lambda d, p: with_fields(d, transfer_id=0)),
        Garbage("marks-segment-as-region", _shm_marks_region),
    ),
)


def _all() -> list[BackendSpec]:
    # Each backend's spec lives in its own module (spec_<name>.py).
    from tests.relay_conformance.spec_nixl import NIXL
    from tests.relay_conformance.spec_torchdist import TORCHDIST
    from tests.relay_conformance.spec_ucx import UCX

    return [SHM, NIXL, UCX, TORCHDIST]


BACKENDS: list[BackendSpec] = _all()
