"""Fan-out/fan-in, route_fn, wait_for_fn, several terminals, batching: real meshes."""

from __future__ import annotations

import collections
import concurrent.futures
import zlib
from collections.abc import Iterator

import numpy as np
import pytest

from omnirail.client.sdk import Client
from omnirail.wire.errors import Code, OmniError
from tests.integration.conftest import shm_names, start_local, start_mesh


def _client(name: str, processes: bool = False) -> Iterator[Client]:
    """A client of pipeline `name`: in one process (LocalMesh) unless the test tells
    processes apart."""
    mesh = start_mesh(name) if processes else start_local(name)
    try:
        with Client(mesh.address or "", timeout=60) as client:
            yield client
    finally:
        mesh.stop()
        assert shm_names(mesh.shm_prefix) == []


@pytest.fixture(scope="module")
def fanout() -> Iterator[Client]:
    yield from _client("fanout")


@pytest.fixture(scope="module")
def routing() -> Iterator[Client]:
    yield from _client("routing")


@pytest.fixture(scope="module")
def terminals() -> Iterator[Client]:
    yield from _client("terminals")


@pytest.mark.parametrize("n", [4, 5000])  # inline and through shm (inline bound 256 B)
def test_fan_out_projects_and_fan_in_merges(fanout: Client, n: int) -> None:
    out = fanout.generate({"n": n}).output
    assert out["left_sum"] == sum(range(n)) + n
    assert out["right_sum"] == pytest.approx(3.0 * n)
    # merge_fn sees its inputs in a stable order regardless of arrival order.
    assert out["order"] == ["left", "right"]


def test_fan_in_under_concurrency(fanout: Client) -> None:
    sizes = list(range(1, 200, 7))
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(lambda n: fanout.generate({"n": n}).output, sizes))
    assert [o["left_sum"] for o in outs] == [sum(range(n)) + n for n in sizes]


def test_route_fn_and_wait_for_fn_text_only(routing: Client) -> None:
    out = routing.generate({"text": "hi"}).output
    assert out == {"text": "hi", "sources": ["pre"]}


def test_route_fn_and_wait_for_fn_with_image(routing: Client) -> None:
    image = np.full((8, 8), 2.0, dtype=np.float32)
    out = routing.generate({"text": "hi", "image": image}).output
    assert out["sources"] == ["encoder", "pre"]
    assert out["image_feature"] == pytest.approx(2.0)


def test_route_fn_outside_next_fails_clearly(routing: Client) -> None:
    with pytest.raises(OmniError) as info:
        routing.generate({"text": "bad-route"})
    assert info.value.stage == "pre"
    assert "route_fn returned ['nowhere']" in info.value.message
    assert routing.generate({"text": "fine"}).output["sources"] == ["pre"]


def test_all_terminals_are_merged(terminals: Client) -> None:
    # `upper` and `length` share one process (`process: shared`), each with its own stream.
    info = terminals.describe()
    replicas = {s.name: s.replicas[0] for s in info.stages}
    assert replicas["upper"].address == replicas["length"].address != replicas["echo"].address
    result = terminals.generate({"value": "abc"})
    assert result.outputs == {"upper": {"text": "ABC"}, "length": {"length": 3}}
    assert result.output == result.outputs


def test_terminal_stages_fn_selects_per_request(terminals: Client) -> None:
    result = terminals.generate({"value": "abcd", "want": ["length"]})
    assert result.outputs == {"length": {"length": 4}}
    assert result.output == {"length": 4}


def test_terminal_stages_fn_bad_answer_fails_request(terminals: Client) -> None:
    with pytest.raises(OmniError) as info:
        terminals.generate({"value": "x", "want": ["echo"]})
    assert info.value.code == Code.INTERNAL
    assert "terminal_stages_fn" in info.value.message


@pytest.fixture(scope="module")
def replicas() -> Iterator[Client]:
    yield from _client("replicas", processes=True)


def test_replicas_share_the_load_and_fan_in_stays_consistent(replicas: Client) -> None:
    # Both producers pick the join replica by the same hash of the request id, so each
    # request's two halves meet at one replica.
    info = {s.name: s for s in replicas.describe().stages}
    assert len(info["left"].replicas) == 2 and len(info["join"].replicas) == 2
    sizes = list(range(1, 41))
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda n: replicas.generate({"n": n}).output, sizes))
    assert [o["left_sum"] for o in outs] == [sum(range(n)) + n for n in sizes]
    assert len({o["pid"] for o in outs}) == 2


def test_the_entry_replica_with_fewest_live_requests_gets_the_next() -> None:
    """least_outstanding (the default): 16 slow requests at once split 8 and 8, even when
    every request id hashes to the same replica (request_id balancing would send all 16
    to one)."""
    ids = [f"lo-{i}" for i in range(200) if zlib.crc32(f"lo-{i}".encode()) % 2 == 0][:16]
    clients = _client("entry_replicas", processes=True)
    client = next(clients)
    try:
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            outs = list(
                pool.map(lambda rid: client.generate({"sleep": 0.5}, request_id=rid).output, ids)
            )
    finally:
        clients.close()
    counts = collections.Counter(out["pid"] for out in outs)
    assert sorted(counts.values()) == [8, 8], counts
