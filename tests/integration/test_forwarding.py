"""Stages that pass a received tensor on forward the shm view instead of copying it."""

from __future__ import annotations

import concurrent.futures
import time

from omnirail.bench.pipeline_bench import TRACING_ENV
from omnirail.client.sdk import Client
from omnirail.ops.launcher import Mesh
from omnirail.telemetry.export import read_span_files
from tests.integration.conftest import shm_names, start_mesh


def _relay_puts(mesh: Mesh) -> dict[str, set[bool]]:
    """Edge -> the `omnirail.relay.forwarded` values its relay.put spans carry."""
    puts: dict[str, set[bool]] = {}
    for span in read_span_files(mesh.span_dir.glob("*.otlp")):
        if span["name"] == "relay.put":
            attrs = span["attributes"]
            forwarded = attrs.get("omnirail.relay.forwarded", False)
            puts.setdefault(attrs["omnirail.edge"], set()).add(forwarded)
    return puts


def _segments_of(prefix: str, pid: int) -> list[str]:
    return [n for n in shm_names(prefix) if n.startswith(f"{prefix}-{pid}.")]


def test_pass_through_stages_forward_without_copies_and_nothing_is_reused_early() -> None:
    mesh = start_mesh("forward", env=TRACING_ENV["on"])
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
        # Traces say so too: the middle stages' relay.put spans are marked forwarded.
        want = {"stamp->first": {False}, "first->second": {True}, "second->check": {True}}
        deadline = time.monotonic() + 30
        while (puts := _relay_puts(mesh)) != want and time.monotonic() < deadline:
            time.sleep(0.2)  # spans are exported in batches
        assert puts == want
    finally:
        mesh.stop()
    assert shm_names(mesh.shm_prefix) == [], "shared memory left after shutdown"
