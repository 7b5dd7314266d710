"""Integration fixtures: real meshes (coordinator + one process per stage group)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from omnirail.client.sdk import Chunk, Client, GenerateResult
from omnirail.ops.launcher import Mesh

PIPELINES = Path(__file__).parent / "pipelines"


def shm_names(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix + "-"))


def collect_stream(events: Iterable[Any]) -> tuple[list[Chunk], GenerateResult]:
    """A stream's chunks in arrival order, and its result."""
    chunks: list[Chunk] = []
    for event in events:
        if isinstance(event, Chunk):
            chunks.append(event)
        else:
            return chunks, event
    raise AssertionError("stream ended without a result")


def wait_nothing_in_flight(client: Client, timeout: float = 15.0) -> None:
    """Until no stage replica reports a request in flight (loads refresh every moment)."""
    deadline = time.monotonic() + timeout
    while busy := [
        (s.name, r.inflight) for s in client.describe().stages for r in s.replicas if r.inflight
    ]:
        assert time.monotonic() < deadline, busy
        time.sleep(0.2)


def start_mesh(name: str, **kwargs: object) -> Mesh:
    mesh = Mesh(PIPELINES / f"{name}.yaml", **kwargs)  # type: ignore[arg-type]
    mesh.start(timeout=240)
    return mesh


@pytest.fixture(scope="module")
def linear_mesh() -> Iterator[Mesh]:
    mesh = start_mesh("linear")
    yield mesh
    mesh.stop()
    assert shm_names(mesh.shm_prefix) == [], "shared memory left after shutdown"
