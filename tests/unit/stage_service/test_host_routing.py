"""Which replica a stage process sends an item to: results by the request id's hash (every
producer agrees); a stream stays on the replica its first chunk went to while that replica
is in the topology, even when another joins (it would never have seen the start)."""

from __future__ import annotations

import zlib

from omnirail.stage_service.host import StageHost
from omnirail.v1 import mesh_pb2
from tests.unit.stage_service.stage_fakes import chunk, pipeline


def _host() -> StageHost:
    cfg = pipeline({"name": "a", "next": "b", "stream_to": ["b"]}, {"name": "b", "terminal": True})
    return StageHost(cfg, ["a"], coordinator="unix:///nowhere", listen="unix:///nowhere")


def _rid_hashing_to(index: int, n: int) -> str:
    return next(r for r in (f"r{i}" for i in range(1000)) if zlib.crc32(r.encode()) % n == index)


def test_results_follow_the_hash_and_streams_stay_put() -> None:
    host = _host()
    one, two = ["b-0"], ["b-0", "b-1"]
    rid = _rid_hashing_to(1, 2)  # with two replicas, the hash says b-1
    assert host.router.route(chunk(rid, 0, 1.0), one) == "b-0"
    # b-1 joins mid-stream: the stream stays on b-0.
    assert host.router.route(chunk(rid, 1, 1.0), two) == "b-0"
    result = mesh_pb2.DeliverItem(request_id=rid, to_stage="b")
    assert host.router.route(result, two) == "b-1"  # results: the hash, as every producer computes
    done = mesh_pb2.DeliverItem(
        request_id=rid, to_stage="b", stream=mesh_pb2.StreamSignal(chunk_id=2, done=True)
    )
    assert host.router.route(done, two) == "b-0"  # the end goes where the chunks went...
    assert host.router.route(chunk(rid, 0, 1.0), two) == "b-1"  # ...and is forgotten after it


def test_a_stream_whose_replica_left_moves_to_the_hash() -> None:
    host = _host()
    rid = _rid_hashing_to(0, 2)
    assert host.router.route(chunk(rid, 0, 1.0), ["b-0", "b-1"]) == "b-0"
    assert host.router.route(chunk(rid, 1, 1.0), ["b-1"]) == "b-1"
