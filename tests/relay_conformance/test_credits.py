"""Conformance: edge credits (slots and bytes), release on ack, reuse, cleanup on abort."""

from __future__ import annotations

import asyncio

import pytest

from omnirail.wire.payload import pack
from tests.relay_conformance.backends import BackendSpec
from tests.relay_conformance.conftest import MiB, OpenPeer
from tests.relay_conformance.harness import (
    TIMEOUT,
    check,
    outstanding_probe,
    pattern,
    settled_outstanding,
    still_blocked,
)

KiB = 1 << 10


async def test_full_slots_block_until_the_receiver_releases(open_peer: OpenPeer) -> None:
    peer = await open_peer(credit_slots=2, credit_bytes=64 * MiB)
    held = [await peer.put(pattern(1000, i), hold=True) for i in range(2)]
    for transfer in held:
        check(transfer, await transfer.result())
    blocked = asyncio.create_task(peer.put(pattern(1000, 9)))
    assert await still_blocked(blocked), "a put beyond the slot credit completed"
    await peer.send(pattern(10, 3), edge="other")  # another edge has its own credit
    assert not blocked.done()
    await peer.release(held[:1])
    third = await asyncio.wait_for(blocked, TIMEOUT)
    check(third, await third.result())
    assert await peer.release(held[1:]) == {held[1].seq: held[1].crc}


async def test_an_edge_keeps_its_own_credits(open_peer: OpenPeer) -> None:
    """`set_edge_credits` bounds one edge; the settings' credits bound the others."""
    peer = await open_peer(credit_slots=8, credit_bytes=64 * MiB)
    peer.relay.set_edge_credits("one", 1, 64 * MiB)
    held = [await peer.put(pattern(1000, 1), edge="one", hold=True)]
    check(held[0], await held[0].result())
    blocked = asyncio.create_task(peer.put(pattern(1000, 2), edge="one"))
    assert await still_blocked(blocked), "a put beyond the edge's own credit completed"
    for i in range(3):  # the other edge still has the settings' 8 slots
        held.append(await peer.put(pattern(1000, 10 + i), edge="edge", hold=True))
        check(held[-1], await held[-1].result())
    assert not blocked.done()
    await peer.release(held[:1])
    second = await asyncio.wait_for(blocked, TIMEOUT)
    check(second, await second.result())
    await peer.release(held[1:])


async def test_byte_credit_blocks_and_oversize_payload_goes_alone(open_peer: OpenPeer) -> None:
    peer = await open_peer(credit_slots=64, credit_bytes=256 * KiB)
    first = await peer.put(pattern(200 * KiB, 1), hold=True)
    check(first, await first.result())
    blocked = asyncio.create_task(peer.put(pattern(100 * KiB, 2)))
    assert await still_blocked(blocked), "200 KiB + 100 KiB went over a 256 KiB credit"
    await peer.release([first])
    second = await asyncio.wait_for(blocked, TIMEOUT)
    check(second, await second.result())

    # Larger than the edge's whole byte credit: never rejected, but waits for an idle edge.
    small = await peer.put(pattern(10, 3), hold=True)
    check(small, await small.result())
    oversize = asyncio.create_task(peer.put(pattern(4 * MiB, 4), hold=True))
    assert await still_blocked(oversize), "an oversize payload shared a busy edge"
    await peer.release([small])
    big = await asyncio.wait_for(oversize, TIMEOUT)
    check(big, await big.result())
    after = asyncio.create_task(peer.put(pattern(1, 5)))
    assert await still_blocked(after), "a put went alongside an oversize payload"
    await peer.release([big])
    last = await asyncio.wait_for(after, TIMEOUT)
    check(last, await last.result())


async def test_put_nowait_never_waits_or_overdraws(open_peer: OpenPeer) -> None:
    peer = await open_peer(credit_slots=1)
    packed = pack(pattern(100, 1))
    handle = peer.relay.put_nowait(packed, "req", "edge")
    if handle is None:  # backends may always decline; `put` is the fallback
        handle = await peer.relay.put(packed, "req", "edge")
    first = peer.submit(packed, handle, hold=True)
    check(first, await first.result())
    assert peer.relay.put_nowait(pack(pattern(100, 2)), "req", "edge") is None
    other = pack(pattern(300, 3))
    handle = peer.relay.put_nowait(other, "req", "other")
    if handle is not None:  # another edge's credit is free: if it went, it must be right
        transfer = peer.submit(other, handle)
        check(transfer, await transfer.result())
    await peer.release([first])


# ----------------------------------------------------------------------------- release


async def test_release_returns_outstanding_to_zero(open_peer: OpenPeer) -> None:
    peer = await open_peer(credit_slots=8)
    outstanding_probe(peer.relay)
    for i, n in enumerate([0, 1, 4097, MiB + 3]):
        await peer.send(pattern(n, i))
        assert await settled_outstanding(peer.relay, "edge", (0, 0)) == (0, 0)
    held = [await peer.put(pattern(n, 10 + i), hold=True) for i, n in enumerate([5, 70_000, MiB])]
    for transfer in held:
        check(transfer, await transfer.result())
    want = (len(held), sum(t.nbytes for t in held))
    assert await settled_outstanding(peer.relay, "edge", want) == want
    await peer.release(held)
    assert await settled_outstanding(peer.relay, "edge", (0, 0)) == (0, 0)


async def test_repeated_transfers_reuse_pool_memory(
    backend: BackendSpec, prefix: str, open_peer: OpenPeer
) -> None:
    if backend.footprint is None:
        pytest.skip(f"no pool footprint probe for {backend.name!r} in backends.py")
    peer = await open_peer(credit_slots=4)
    await peer.send(pattern(MiB, 0))
    footprint, names = backend.footprint(peer.relay), backend.leftovers(prefix)
    # One at a time, every transfer fits where the previous one was: no growth at all.
    for i in range(40):
        await peer.send(pattern(MiB - 64 * (i % 3), i))
    assert backend.footprint(peer.relay) == footprint
    assert backend.leftovers(prefix) == names
    # Pipelined up to the credit, memory stays bounded by the credit, not the transfer count
    # (a leak of 100+ MiB here; fragmentation may add a segment or two).
    values = [pattern([MiB, 300_000, 4097, 1][i % 4], 100 + i) for i in range(120)]
    await peer.send_many(values)
    assert backend.footprint(peer.relay) <= 4 * footprint


# ----------------------------------------------------------------------------- cleanup


async def test_cleanup_frees_only_the_aborted_request(open_peer: OpenPeer) -> None:
    peer = await open_peer(credit_slots=4)
    relay = peer.relay
    doomed = [await peer.put(pattern(1000 + i, i), request_id="doomed", hold=True) for i in (0, 1)]
    kept = [await peer.put(pattern(MiB + i, 10 + i), request_id="kept", hold=True) for i in (0, 1)]
    for transfer in doomed + kept:
        check(transfer, await transfer.result())
    blocked = asyncio.create_task(peer.put(pattern(500, 20), request_id="late", hold=True))
    assert await still_blocked(blocked)  # the edge is full

    relay.cleanup("doomed")  # the abort path: no ack will ever come for these
    late = await asyncio.wait_for(blocked, TIMEOUT)  # their credit came back
    check(late, await late.result())
    live = [*kept, late]
    want = (len(live), sum(t.nbytes for t in live))
    if hasattr(relay, "outstanding"):
        assert await settled_outstanding(relay, "edge", want) == want
    relay.cleanup("doomed")  # nothing left of it
    relay.cleanup("no-such-request")
    # Churn reuses whatever the cleanup freed: if it freed a kept extent, this overwrites it.
    await peer.send_many([pattern(n, 30 + n) for n in (900, MiB, 2000, MiB + 1)], edge="churn")

    await peer.release(doomed)  # a late release of aborted transfers changes nothing
    if hasattr(relay, "outstanding"):
        assert await settled_outstanding(relay, "edge", want) == want
    assert await peer.release(live) == {t.seq: t.crc for t in live}
    if hasattr(relay, "outstanding"):
        assert await settled_outstanding(relay, "edge", (0, 0)) == (0, 0)
