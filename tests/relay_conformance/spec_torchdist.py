"""What the conformance suite knows about the `torchdist` relay backend."""

from __future__ import annotations

from omnirail.relay.base import Relay, RelaySettings
from tests.relay_conformance.backends import BackendSpec, pool_footprint


def _pair(first: Relay, settings: RelaySettings, index: int) -> RelaySettings:
    # Imported here: importing torch for a spec would slow every backend's collection.
    from omnirail.relay.torchdist import pair_settings

    return pair_settings(first, settings, index)


TORCHDIST = BackendSpec(
    "torchdist",
    # The first relay of a test is rank 0 of 2 on a free port; `_pair` makes the other.
    settings={"rank": 0, "world_size": 2},
    options={
        "peer_wait_s": 1.0,
        "init_method": "tcp://127.0.0.1:0",
        # Short: a rendezvous nobody joins (the availability probe) gives up soon, and
        # sends to a killed receiver fail soon; still far above any transfer here.
        "timeout_s": 30.0,
        "fetch_timeout_s": 20.0,
    },
    footprint=pool_footprint,
    pair_settings=_pair,
)
