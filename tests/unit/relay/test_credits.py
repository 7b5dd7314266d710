"""relay.credits: the one credit class, edge-wide (relays) and with a request's share (streams)."""

from __future__ import annotations

import asyncio

import pytest

from omnirail.relay.base import RelayError
from omnirail.relay.credits import Credits


def test_edge_bounds_slots_and_bytes_but_an_oversize_payload_goes_alone() -> None:
    credits = Credits(2, 100)
    edge = credits.edge("a->b")
    assert credits.try_take(edge, 60)
    assert not credits.try_take(edge, 50)  # 110 bytes > 100
    assert credits.try_take(edge, 40)
    assert not credits.try_take(edge, 0)  # 2 slots
    assert credits.outstanding("a->b") == (2, 100)
    credits.give_back(edge, 60)
    credits.give_back(edge, 40)
    assert credits.try_take(edge, 1000)  # larger than the byte credit: alone on an idle edge
    assert not credits.try_take(edge, 1)
    credits.give_back(edge, 1000)
    assert credits.outstanding("a->b") == (0, 0)
    assert credits.outstanding("nowhere") == (0, 0)


def test_request_share_bounds_one_request_not_the_others() -> None:
    credits = Credits(4, 1 << 20, request_slots=2)
    edge = credits.edge("s->t")
    assert credits.try_take(edge, 10, "r1")
    assert credits.try_take(edge, 10, "r1")
    assert not credits.try_take(edge, 10, "r1")  # r1's share is full
    assert credits.try_take(edge, 10, "r2")
    assert credits.try_take(edge, 10, "r3")
    assert not credits.try_take(edge, 10, "r4")  # the edge is full
    assert edge.by_request == {"r1": 2, "r2": 1, "r3": 1}
    credits.give_back(edge, 10, "r1")
    assert edge.by_request["r1"] == 1
    assert credits.try_take(edge, 10, "r1")
    for rid in ("r1", "r1", "r2", "r3"):
        credits.give_back(edge, 10, rid)
    assert edge.by_request == {} and credits.outstanding("s->t") == (0, 0)


def test_without_a_request_share_only_the_edge_bounds() -> None:
    credits = Credits(3, 1 << 20)
    edge = credits.edge("e")
    assert all(credits.try_take(edge, 1, "r") for _ in range(3))
    assert not credits.try_take(edge, 1, "r")
    assert credits.try_take(credits.edge("other"), 1)  # edges are apart


def test_limit_bounds_one_edge() -> None:
    credits = Credits(8, 1 << 20, request_slots=8)
    credits.limit("small", 1, 10)
    small, big = credits.edge("small"), credits.edge("big")
    assert credits.try_take(small, 5, "r") and not credits.try_take(small, 1, "q")
    assert credits.try_take(big, 5, "r") and credits.try_take(big, 5, "q")


async def test_take_queues_fifo_and_try_take_does_not_overtake() -> None:
    credits = Credits(1, 100)
    edge = credits.edge("e")
    assert credits.try_take(edge, 10)
    order: list[str] = []

    async def taker(name: str, nbytes: int) -> None:
        await credits.take(edge, nbytes)
        order.append(name)

    tasks = [asyncio.create_task(taker(n, 10)) for n in ("first", "second")]
    await asyncio.sleep(0)
    assert credits.waiting()
    assert not credits.try_take(edge, 1)  # someone queues before us
    credits.give_back(edge, 10)
    await asyncio.sleep(0)
    assert order == ["first"]
    credits.give_back(edge, 10)
    await asyncio.gather(*tasks)
    assert order == ["first", "second"] and not credits.waiting()
    credits.give_back(edge, 10)
    assert credits.outstanding("e") == (0, 0)


async def test_cancelled_after_grant_hands_credit_back() -> None:
    credits = Credits(1, 100)
    edge = credits.edge("e")
    assert credits.try_take(edge, 10)
    task = asyncio.create_task(credits.take(edge, 10))
    await asyncio.sleep(0)
    credits.give_back(edge, 10)  # granted to the waiter...
    task.cancel()  # ...which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await task
    assert credits.outstanding("e") == (0, 0)


async def test_fail_waiters() -> None:
    credits = Credits(1, 100)
    edge = credits.edge("e")
    assert credits.try_take(edge, 10)
    task = asyncio.create_task(credits.take(edge, 10))
    await asyncio.sleep(0)
    credits.fail_waiters("closed")
    with pytest.raises(RelayError, match="closed"):
        await task
    assert not credits.waiting()
