"""Stages that pass a received tensor on forward the shm view instead of copying it."""

from __future__ import annotations

import concurrent.futures

from omnirail.client import Client
from tests.integration.conftest import shm_names, start_mesh


def _segments_of(prefix: str, pid: int) -> list[str]:
    return [n for n in shm_names(prefix) if n.startswith(f"{prefix}-{pid}.")]


def test_pass_through_stages_forward_without_copies_and_nothing_is_reused_early() -> None:
    mesh = start_mesh("forward")
    try:
        with Client(mesh.address or "", timeout=60) as client:
            # 256 KiB per request, 4 credits per edge, 2 MiB pools: extents are reused
            # constantly, by requests in flight at the same time.
            with concurrent.futures.ThreadPoolExecutor(12) as pool:
                outs = list(pool.map(lambda i: client.generate({"i": i}).output, range(240)))
        assert [o["i"] for o in outs] == list(range(240))
        assert all(o["intact"] and o["n"] == 1 << 16 for o in outs)
        pids = mesh.processes()
        # The stamp stage copied each tensor into its pool once; the two stages in the
        # middle never needed a pool of their own.
        assert _segments_of(mesh.shm_prefix, pids["stage-stamp"])
        for middle in ("stage-first", "stage-second"):
            assert _segments_of(mesh.shm_prefix, pids[middle]) == [], middle
    finally:
        mesh.stop()
    assert shm_names(mesh.shm_prefix) == [], "shared memory left after shutdown"
