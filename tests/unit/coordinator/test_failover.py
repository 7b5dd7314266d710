"""Which requests a lost replica touched, when one may run again, and the liveness
watch (which must not blame the stages for the coordinator's own stall)."""

from __future__ import annotations

import asyncio
import time
import zlib

import pytest

from omnirail.coordinator.failover import can_redispatch, touched, watch_liveness
from omnirail.coordinator.registry import Replica, StageRegistry
from omnirail.coordinator.requests import RequestRecord


def _rec(rid: str, stages: set[str], **kw: object) -> RequestRecord:
    rec = RequestRecord(rid, ("c",), frozenset(stages), deadline=time.time() + 60)
    for key, value in kw.items():
        setattr(rec, key, value)
    return rec


def _replicas(stage: str, n: int) -> list[Replica]:
    return [Replica(stage, f"{stage}-{i}", f"addr-{stage}-{i}", 100 + i) for i in range(n)]


def test_the_entry_replica_is_the_one_the_request_was_sent_to() -> None:
    a0, a1 = _replicas("a", 2)
    rec = _rec("r1", {"a", "b"}, entry=a1)
    assert touched(a1, [a0, a1], rec, entry="a")
    assert not touched(a0, [a0, a1], rec, entry="a")


def test_a_later_stage_replica_is_the_one_the_stages_hash_to() -> None:
    reps = _replicas("b", 3)
    for rid in (f"q{i}" for i in range(20)):
        rec = _rec(rid, {"a", "b"})
        owner = zlib.crc32(rid.encode()) % 3
        assert [touched(r, reps, rec, entry="a") for r in reps] == [i == owner for i in range(3)]
        # A re-dispatched attempt is routed by its own wire id.
        rec.wire_id = f"{rid}#2"
        owner = zlib.crc32(rec.wire_id.encode()) % 3
        assert touched(reps[owner], reps, rec, entry="a")


def test_a_stage_the_request_cannot_pass_is_never_touched() -> None:
    (c0,) = _replicas("c", 1)
    assert not touched(c0, [c0], _rec("r", {"a", "b"}), entry="a")
    assert touched(c0, [c0], _rec("r", {"a", "c"}), entry="a")


@pytest.mark.parametrize(
    ("change", "ok"),
    [
        ({}, True),
        ({"chunks": 1}, False),  # the client has seen output
        ({"outputs": {"c": object()}}, False),  # a terminal answered
        ({"attempt": 3}, False),  # out of re-dispatches (2)
        ({"deadline": 0.0}, False),  # past its deadline
        ({"possible": frozenset({"a", "x"})}, False),  # x is not retry-safe
    ],
)
def test_can_redispatch(change: dict[str, object], ok: bool) -> None:
    rec = _rec("r", {"a", "c"}, **change)
    assert can_redispatch(rec, frozenset({"a", "c"}), attempts=2) is ok


def test_the_wire_id_starts_as_the_request_id() -> None:
    assert _rec("abc", {"a"}).wire_id == "abc"


async def test_a_silent_replica_is_reported_and_a_stalled_watch_blames_no_one() -> None:
    registry = StageRegistry(["a"])
    quiet, chatty = _replicas("a", 2)
    registry.add(quiet)
    registry.add(chatty)
    silent: list[str] = []
    task = asyncio.get_running_loop().create_task(
        watch_liveness(registry, 0.4, lambda r, s: silent.append(r.replica_id))
    )
    try:
        for _ in range(8):
            chatty.last_heard = time.monotonic()
            await asyncio.sleep(0.1)
        assert "a-0" in silent and "a-1" not in silent
        silent.clear()
        quiet.last_heard = chatty.last_heard = time.monotonic()
        time.sleep(0.6)  # the loop itself stalls past the timeout
        await asyncio.sleep(0.15)
        assert silent == []
    finally:
        task.cancel()
