"""Conformance: a dying receiver, garbage descriptors, and closed relays."""

from __future__ import annotations

import asyncio
import zlib

import pytest

from omnirail.relay.base import RelayError, RelaySettings, create_relay
from omnirail.wire.payload import pack
from tests.relay_conformance.backends import (
    BACKENDS,
    GENERIC_GARBAGE,
    BackendSpec,
    Garbage,
)
from tests.relay_conformance.conftest import MakeRelay, MiB, OpenPeer
from tests.relay_conformance.harness import (
    TIMEOUT,
    PeerGone,
    Reply,
    check,
    crc_of,
    pattern,
    settled_outstanding,
    still_blocked,
)

# Garbage cases depend on the backend (each may add its own), so the pairs are listed here.
GARBAGE_CASES = [
    pytest.param(
        spec,
        case,
        id=f"{spec.name}-{case.name}",
        marks=[pytest.mark.xfail(strict=True, reason=case.xfail)] if case.xfail else [],
    )
    for spec in BACKENDS
    for case in (*GENERIC_GARBAGE, *spec.garbage)
]
with_garbage = pytest.mark.parametrize(("backend", "garbage"), GARBAGE_CASES, indirect=["backend"])


# ----------------------------------------------------------------------------- peer death


@pytest.mark.parametrize("recovery", ["cleanup", "close"])
async def test_killed_receiver_never_hangs_the_sender(
    backend: BackendSpec, prefix: str, open_peer: OpenPeer, recovery: str
) -> None:
    peer = await open_peer(credit_slots=3)
    relay = peer.relay
    held = [
        await peer.put(pattern(n, i), request_id="victim", hold=True)
        for i, n in enumerate([100, MiB, 70_000])
    ]
    for transfer in held:
        check(transfer, await transfer.result())
    blocked = asyncio.create_task(relay.put(pack(pattern(4096, 9)), "victim", "edge"))
    assert await still_blocked(blocked)
    # Maybe read, maybe not when the kill lands: either way the answer must not hang.
    racing = await peer.put(pattern(16 * MiB, 10), request_id="victim", edge="big")

    peer.kill()
    await peer.wait_gone()
    outcome = await asyncio.wait_for(asyncio.gather(racing.reply, return_exceptions=True), TIMEOUT)
    assert isinstance(outcome[0], Reply | PeerGone), outcome
    with pytest.raises(PeerGone):
        await peer.probe(held[0].handle.descriptor)

    if recovery == "cleanup":
        relay.cleanup("victim")  # what a stage does for requests whose receiver died
        late = await asyncio.wait_for(blocked, TIMEOUT)  # the dead peer's credit came back
        relay.cleanup("victim")
        assert late.request_id == "victim"
        if hasattr(relay, "outstanding"):
            for edge in ("edge", "big"):
                assert await settled_outstanding(relay, edge, (0, 0)) == (0, 0)
        relay.close()
    else:
        relay.close()  # with a put still waiting for credit the dead peer holds
        with pytest.raises(RelayError):
            await asyncio.wait_for(blocked, TIMEOUT)
    relay.close()
    if not backend.receiver_names:
        assert backend.leftovers(prefix) == [], "close left names behind"
    backend.sweep(prefix)
    assert backend.leftovers(prefix) == []


async def test_sender_close_while_receiver_holds_views(open_peer: OpenPeer) -> None:
    """Views the receiver holds stay readable and intact after the sender relay closes."""
    peer = await open_peer()
    held = [await peer.put(pattern(n, i), hold=True) for i, n in enumerate([10, 2 * MiB])]
    for transfer in held:
        check(transfer, await transfer.result())
    peer.relay.close()
    assert await peer.release(held) == {t.seq: t.crc for t in held}


# ----------------------------------------------------------------------------- garbage


@with_garbage
async def test_garbage_descriptor_is_refused_in_process(
    garbage: Garbage, prefix: str, make_relay: MakeRelay
) -> None:
    """A second relay instance as receiver; it meets the garbage before any good descriptor."""
    sender, receiver = make_relay(credit_slots=1), make_relay()
    packed = pack(pattern(1000, 1))
    handle = await sender.put(packed, "req", "edge")
    with pytest.raises(RelayError):
        await asyncio.wait_for(receiver.get(garbage.corrupt(handle.descriptor, prefix)), TIMEOUT)

    received = await receiver.get(handle.descriptor)  # still works for good descriptors
    assert zlib.crc32(received.buffer) == crc_of(packed)
    received.release()
    if handle.acked_in_band:
        handle.release()
    # One slot of credit: the next put goes only if that release returned it.
    again = await asyncio.wait_for(sender.put(pack(pattern(10, 2)), "req", "edge"), TIMEOUT)
    again.release()


@with_garbage
async def test_garbage_descriptor_is_refused_by_the_peer(
    garbage: Garbage, prefix: str, open_peer: OpenPeer
) -> None:
    """Across processes, after the receiver has mapped the sender's pool (warm caches)."""
    peer = await open_peer(credit_slots=1)
    good = await peer.put(pattern(1000, 1), hold=True)
    check(good, await good.result())
    reply = await peer.probe(garbage.corrupt(good.handle.descriptor, prefix))
    assert not reply.ok, "the receiver accepted a garbage descriptor"
    assert reply.relay_error, f"raised {reply.error}: {reply.message}, not RelayError"
    assert reply.elapsed < TIMEOUT / 4, f"took {reply.elapsed:.1f}s to refuse"

    assert await peer.release([good]) == {good.seq: good.crc}
    await peer.send(pattern(2000, 2))  # one slot: goes only if that release returned it


@pytest.mark.skipif("shm" not in [b.name for b in BACKENDS], reason="shm is not under test")
async def test_shm_marks_segment_descriptor_does_not_poison_later_releases(prefix: str) -> None:
    """A descriptor naming the release-marks segment is refused, and credit keeps
    returning for good transfers (accepting it once cached the marks read-only)."""
    from omnirail.relay.shm import ShmRelay, sweep_segments
    from omnirail.relay.shm_pool import marks_name

    sender = create_relay("shm", RelaySettings(name_prefix=prefix, pool_bytes=MiB))
    receiver = create_relay("shm", RelaySettings(name_prefix=prefix))
    assert isinstance(sender, ShmRelay)
    try:
        handle = await sender.put(pack(pattern(1000, 1)), "req", "edge")
        bad = type(handle.descriptor)()
        bad.CopyFrom(handle.descriptor)
        bad.region, bad.offset, bad.nbytes = marks_name(bad.region), 0, 8
        try:
            (await receiver.get(bad)).release()
        except RelayError:
            pass  # refusing it is the fix
        (await receiver.get(handle.descriptor)).release()
        sender.reclaim()  # reads the release marks now, as a waiting put would
        assert sender.outstanding("edge") == (0, 0), "the receiver's release never arrived"
    finally:
        sender.close()
        receiver.close()
        sweep_segments(prefix)


# ----------------------------------------------------------------------------- close


async def test_closed_relay_refuses_put_and_get(
    backend: BackendSpec, prefix: str, make_relay: MakeRelay
) -> None:
    sender, receiver = make_relay(), make_relay()
    packed = pack(pattern(1000, 1))
    handle = await sender.put(packed, "req", "edge")
    (await receiver.get(handle.descriptor)).release()
    for relay in (sender, receiver):
        relay.close()
        relay.close()  # idempotent
    for relay in (sender, receiver):
        with pytest.raises(RelayError, match="closed"):
            await relay.put(packed, "req", "edge")
        with pytest.raises(RelayError, match="closed"):
            await relay.get(handle.descriptor)
        try:
            assert relay.put_nowait(packed, "req", "edge") is None
        except RelayError:
            pass  # refusing loudly is as good as declining
        relay.cleanup("req")  # harmless after close
    handle.release()  # a handle outliving its relay: harmless too
    if not backend.receiver_names:
        assert backend.leftovers(prefix) == [], "close left names behind"


async def test_close_fails_a_blocked_put(make_relay: MakeRelay) -> None:
    relay = make_relay(credit_slots=1)
    await relay.put(pack(pattern(10, 1)), "req", "edge")
    blocked = asyncio.create_task(relay.put(pack(pattern(10, 2)), "req", "edge"))
    assert await still_blocked(blocked)
    relay.close()
    with pytest.raises(RelayError):
        await asyncio.wait_for(blocked, TIMEOUT)
