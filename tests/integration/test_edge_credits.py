"""Per-edge credits in one process (LocalMesh): one sender, one shm relay, three edges with their
own `credits`; a slow receiver on each shows how many transfers its edge lets out."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator

import pytest

from omnirail.client.sdk import Client
from omnirail.testing.local_mesh import LocalMesh
from tests.integration.conftest import shm_names, start_local

REQUESTS = 12  # per edge, all at once


@pytest.fixture(scope="module")
def mesh() -> Iterator[LocalMesh]:
    mesh = start_local("edge_credits")
    yield mesh
    mesh.stop()
    assert shm_names(mesh.shm_prefix) == [], "shared memory left after shutdown"


def waiting_on(mesh: LocalMesh, target: str) -> list[int]:
    """Sends REQUESTS requests to `target` at once; how many inputs waited behind each."""

    def one(i: int) -> int:
        with Client(mesh.address or "", timeout=60) as client:
            out = client.generate({"i": i, "want": [target]}).outputs[target]
        assert out["i"] == i and out["bytes"] == 64 << 10
        return int(out["waiting"])

    with concurrent.futures.ThreadPoolExecutor(REQUESTS) as pool:
        return list(pool.map(one, range(REQUESTS)))


def test_each_edge_is_bounded_by_its_own_credits(mesh: LocalMesh) -> None:
    # relay_to credits 1: never a second transfer out on the edge, so nothing waits.
    assert max(waiting_on(mesh, "one")) == 0
    # relay_to credits 4: one computing and at most three waiting; more than one of them
    # does wait, so the edge is not held to another edge's bound of 1.
    four = waiting_on(mesh, "four")
    assert 2 <= max(four) <= 3, four
    # The stage's own credits (64): every request's transfer goes out at once.
    wide = waiting_on(mesh, "wide")
    assert max(wide) >= 6, wide
