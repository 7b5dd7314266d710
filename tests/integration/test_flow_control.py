"""A fast producer against a slow consumer: bounded queues, producer slowed, fairness."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from omnirail.client.sdk import Chunk, Client
from omnirail.testing.local_mesh import LocalMesh
from tests.integration.conftest import shm_names, start_local

CREDITS = 8  # stream.credits of the thinker's edges in slow_consumer.yaml
REQUEST_CREDITS = 4  # stream.request_credits there
CHUNK_MS = 4  # the vocoder's time per chunk


@pytest.fixture(scope="module")
def slow_mesh() -> Iterator[LocalMesh]:
    mesh = start_local("slow_consumer")
    yield mesh
    mesh.stop()
    assert shm_names(mesh.shm_prefix) == [], "shared memory left after shutdown"


def _run(client: Client, inputs: dict[str, Any], rid: str) -> tuple[int, Any, float]:
    count, result = 0, None
    for event in client.stream(inputs, request_id=rid):
        if isinstance(event, Chunk):
            count += 1
        else:
            result = event
    return count, result, time.monotonic()


@pytest.mark.parametrize("chunk_bytes", [0, 128 << 10], ids=["inline", "relayed"])
def test_slow_consumer_slows_the_producer_with_bounded_queues(
    slow_mesh: LocalMesh, chunk_bytes: int
) -> None:
    n = 300
    with Client(slow_mesh.address or "", timeout=120) as client:
        count, result, _ = _run(client, {"n": n, "chunk_bytes": chunk_bytes}, f"slow-{chunk_bytes}")
    assert count == n
    vocoder, thinker = result.outputs["vocoder"], result.outputs["thinker"]
    assert vocoder["chunks"] == n
    # The consumers never held more than the edge's credit (the AR one: its request's).
    assert vocoder["max_queue"] <= CREDITS
    assert result.outputs["ar_sink"]["chunks"] == n
    assert result.outputs["ar_sink"]["max_inputs"] <= REQUEST_CREDITS
    # The producer could not run ahead: it finished no sooner than the consumer allowed,
    # less what the credits and its outbox (16) could hold.
    assert thinker["elapsed_s"] >= (n - CREDITS - 16 - 32) * CHUNK_MS / 1000.0


def test_a_long_stream_does_not_starve_a_short_one(slow_mesh: LocalMesh) -> None:
    ends: dict[str, float] = {}

    def long() -> None:
        with Client(slow_mesh.address or "", timeout=120) as client:
            ends["long"] = _run(client, {"n": 400}, "fair-long")[2]

    thread = threading.Thread(target=long)
    thread.start()
    time.sleep(0.3)  # the long stream has filled the edge by now
    with Client(slow_mesh.address or "", timeout=120) as client:
        count, _, ends["short"] = _run(client, {"n": 5}, "fair-short")
    thread.join(120)
    assert count == 5
    assert ends["short"] < ends["long"]
