"""shm relay: allocator, pool growth, credits, cleanup, descriptors, OS resources."""

from __future__ import annotations

import asyncio
import os
import re
import uuid

import numpy as np
import pytest

from omnirail.relay.base import RelayError, RelaySettings, create_relay, relay_backends
from omnirail.relay.shm import ShmRelay, sweep_segments
from omnirail.relay.shm_pool import ALIGN, SHM_DIR, ExtentAllocator, marks_name
from omnirail.v1 import common_pb2
from omnirail.wire.payload import pack, unpack
from tests.unit.relay.shm_files import shm_file, write_grant

MiB = 1 << 20


def leftovers(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix + "-"))


def data_segments(prefix: str) -> list[str]:
    return [n for n in leftovers(prefix) if not n.endswith("-marks")]


@pytest.fixture
def prefix():
    name = f"ortest{uuid.uuid4().hex[:10]}"
    yield name
    left = leftovers(name)
    sweep_segments(name)
    assert not left, f"segments left behind: {left}"


@pytest.fixture
def make_relay(prefix):
    relays: list[ShmRelay] = []

    def make(**kw) -> ShmRelay:
        kw.setdefault("pool_bytes", MiB)
        relay = create_relay("shm", RelaySettings(name_prefix=prefix, **kw))
        assert isinstance(relay, ShmRelay)
        relays.append(relay)
        return relay

    yield make
    for relay in relays:
        relay.close()


def payload(nbytes: int, fill: int = 1):
    return pack(np.full(nbytes, fill, np.uint8))


async def settle() -> None:
    # Lets every runnable task take its turn; blocked ones stay blocked.
    for _ in range(5):
        await asyncio.sleep(0)


# ----------------------------------------------------------------------------- allocator


def test_allocator_first_fit_and_coalescing():
    a = ExtentAllocator(10 * ALIGN)
    offs = [a.alloc(2 * ALIGN) for _ in range(5)]
    assert offs == [0, 128, 256, 384, 512]
    assert a.alloc(ALIGN) is None
    a.free(128, 2 * ALIGN)
    a.free(384, 2 * ALIGN)
    # Fragmented: 256 bytes free in total but no 3-unit hole.
    assert a.alloc(3 * ALIGN) is None
    a.free(256, 2 * ALIGN)  # merges with both neighbours
    assert a.free_extents == [(128, 6 * ALIGN)]
    assert a.alloc(6 * ALIGN) == 128
    for off in (0, 128, 512):
        a.free(off, 2 * ALIGN if off != 128 else 6 * ALIGN)
    assert a.free_extents == [(0, 10 * ALIGN)] and a.used == 0


def test_allocator_rejects_double_free():
    a = ExtentAllocator(4 * ALIGN)
    off = a.alloc(ALIGN)
    a.free(off, ALIGN)
    with pytest.raises(ValueError, match="double free"):
        a.free(off, ALIGN)


def test_allocator_reuses_lowest_offsets():
    a = ExtentAllocator(8 * ALIGN)
    first = a.alloc(ALIGN)
    second = a.alloc(ALIGN)
    a.free(first, ALIGN)
    assert a.alloc(ALIGN) == first
    assert second == ALIGN


# ----------------------------------------------------------------------------- pool


async def test_extents_aligned_and_reused(make_relay):
    relay = make_relay()
    h1 = await relay.put(payload(100), "r", "e")
    h2 = await relay.put(payload(100), "r", "e")
    assert h1.descriptor.offset == 0 and h2.descriptor.offset == 128
    assert h1.descriptor.region == h2.descriptor.region
    assert re.fullmatch(rf"{relay.settings.name_prefix}-{os.getpid()}\.\d+-0", h1.descriptor.region)
    h1.release()
    h3 = await relay.put(payload(64), "r", "e")
    assert h3.descriptor.offset == 0
    assert h3.descriptor.transfer_id not in (h1.descriptor.transfer_id, h2.descriptor.transfer_id)


async def test_pool_grows_when_full_and_takes_huge_payloads(make_relay, prefix):
    relay = make_relay(pool_bytes=MiB)
    handles = [await relay.put(payload(MiB // 2), f"r{i}", "e") for i in range(3)]
    regions = [h.descriptor.region for h in handles]
    assert regions[0] == regions[1] != regions[2]
    assert len(data_segments(prefix)) == 2
    huge = await relay.put(payload(5 * MiB, fill=7), "big", "other")
    assert huge.descriptor.region not in regions
    received = await relay.get(huge.descriptor)
    assert len(received.buffer) == 5 * MiB
    assert received.buffer[0] == 7 and received.buffer[-1] == 7
    received.release()
    for h in [*handles, huge]:
        h.release()
    # Segments stay for reuse: a second huge payload needs no new one.
    again = await relay.put(payload(5 * MiB), "big", "other")
    assert again.descriptor.region == huge.descriptor.region
    assert len(data_segments(prefix)) == 3


async def test_put_get_roundtrip_zero_copy(make_relay):
    sender, receiver = make_relay(), make_relay()
    value = {"a": np.arange(1000, dtype=np.float32), "b": [np.ones((3, 3), np.int8)]}
    packed = pack(value)
    handle = await sender.put(packed, "r", "e")
    desc = common_pb2.RelayDescriptor.FromString(handle.descriptor.SerializeToString())
    assert desc.backend == "shm" and desc.nbytes == packed.nbytes
    received = await receiver.get(desc)
    assert received.buffer.readonly
    out = unpack(packed.header, received.buffer)
    np.testing.assert_array_equal(out["a"], value["a"])
    assert not out["a"].flags.writeable
    received.release()
    received.release()
    handle.release()
    handle.release()  # idempotent


# ----------------------------------------------------------------------------- credits


async def test_full_edge_blocks_until_release(make_relay):
    relay = make_relay(credit_slots=2, credit_bytes=10 * MiB)
    h1 = await relay.put(payload(10), "r", "e")
    h2 = await relay.put(payload(10), "r", "e")
    third = asyncio.create_task(relay.put(payload(10), "r", "e"))
    await settle()
    assert not third.done()
    assert relay.outstanding("e") == (2, 20)
    # Another edge has its own credits.
    other = await relay.put(payload(10), "r", "other")
    await settle()
    assert not third.done()
    h1.release()
    h3 = await asyncio.wait_for(third, timeout=30)
    assert relay.outstanding("e") == (2, 20)
    for h in (h2, h3, other):
        h.release()
    assert relay.outstanding("e") == (0, 0) and relay.outstanding("other") == (0, 0)


async def test_byte_credits_and_oversize_payload(make_relay):
    relay = make_relay(credit_slots=64, credit_bytes=1000)
    small = await relay.put(payload(600), "r", "e")
    waiting = asyncio.create_task(relay.put(payload(600), "r", "e"))
    await settle()
    assert not waiting.done()  # 600 + 600 > 1000
    small.release()
    second = await asyncio.wait_for(waiting, timeout=30)
    second.release()
    # Larger than all the edge's byte credit: admitted because the edge is empty.
    big = await asyncio.wait_for(relay.put(payload(5000), "r", "e"), timeout=30)
    blocked = asyncio.create_task(relay.put(payload(1), "r", "e"))
    await settle()
    assert not blocked.done()
    big.release()
    (await asyncio.wait_for(blocked, timeout=30)).release()


async def test_waiters_are_served_in_order(make_relay):
    relay = make_relay(credit_slots=1)
    first = await relay.put(payload(8), "r", "e")
    tasks = [asyncio.create_task(relay.put(payload(8, fill=i), "r", "e")) for i in range(3)]
    await settle()
    got = []
    current = first
    for task in tasks:
        current.release()
        current = await asyncio.wait_for(task, timeout=30)
        got.append((await relay.get(current.descriptor)).buffer[0])
    assert got == [0, 1, 2]
    current.release()


async def test_cancelled_waiter_gives_up_its_place(make_relay):
    relay = make_relay(credit_slots=1)
    first = await relay.put(payload(8), "r", "e")
    doomed = asyncio.create_task(relay.put(payload(8), "r", "e"))
    later = asyncio.create_task(relay.put(payload(8), "r", "e"))
    await settle()
    doomed.cancel()
    await settle()
    first.release()
    (await asyncio.wait_for(later, timeout=30)).release()
    assert relay.outstanding("e") == (0, 0)


async def test_cleanup_releases_a_request(make_relay):
    relay = make_relay(credit_slots=4)
    mine = [await relay.put(payload(100), "abort-me", "e") for _ in range(3)]
    keep = await relay.put(payload(100), "keep", "e")
    assert relay.outstanding("e") == (4, 400)
    relay.cleanup("abort-me")
    assert all(h.released for h in mine)
    assert relay.outstanding("e") == (1, 100)
    relay.cleanup("abort-me")  # nothing left: no-op
    relay.cleanup("unknown")
    assert not keep.released
    keep.release()
    assert relay.pool.segments[0].alloc.used == 0


# ----------------------------------------------------------------------------- descriptors


@pytest.mark.parametrize("region", ["", ".", "..", "../etc/passwd", "a/b", "x y", "a" * 300])
async def test_bad_region_names(make_relay, region):
    relay = make_relay()
    with pytest.raises(RelayError, match="bad shm segment name"):
        await relay.get(
            common_pb2.RelayDescriptor(backend="shm", region=region, nbytes=1, transfer_id=1)
        )


async def test_garbage_descriptors(make_relay, prefix):
    relay = make_relay()
    handle = await relay.put(payload(100), "r", "e")
    region = handle.descriptor.region
    with pytest.raises(RelayError, match="does not exist"):
        await relay.get(
            common_pb2.RelayDescriptor(backend="shm", region=f"{prefix}-1.0-9", transfer_id=1)
        )
    tid = handle.descriptor.transfer_id
    # Bytes outside the extent its transfer id was granted: refused by the grant.
    with pytest.raises(RelayError, match="not the extent its transfer_id was granted"):
        await relay.get(
            common_pb2.RelayDescriptor(
                backend="shm", region=region, offset=MiB, nbytes=1, transfer_id=tid
            )
        )
    with pytest.raises(RelayError, match="not the extent its transfer_id was granted"):
        await relay.get(
            common_pb2.RelayDescriptor(
                backend="shm", region=region, offset=2**64 - 1, nbytes=2, transfer_id=tid
            )
        )
    with pytest.raises(RelayError, match="backend"):
        await relay.get(common_pb2.RelayDescriptor(backend="nixl", region=region))
    # Something in /dev/shm that is not a plain file is refused, symlinks included.
    link = f"{prefix}-1.0-7"  # a name of the receiver's prefix, but not a plain file
    os.symlink("/etc/hostname", os.path.join(SHM_DIR, link))
    # A grant for it: the check on the data file comes after the grant's.
    marks = write_grant(marks_name(link), tid=1, number=7, start=0, end=1)
    try:
        with pytest.raises(RelayError, match="not a regular file"):
            await relay.get(
                common_pb2.RelayDescriptor(backend="shm", region=link, nbytes=1, transfer_id=1)
            )
    finally:
        os.unlink(os.path.join(SHM_DIR, link))
        os.unlink(marks)
    handle.release()


async def test_receiver_remaps_when_sender_restarts(make_relay, prefix):
    receiver = make_relay()
    name = f"{prefix}-1.0-0"
    path = os.path.join(SHM_DIR, name)
    marks = os.path.join(SHM_DIR, f"{prefix}-1.0-marks")
    try:
        for fill in (1, 2):
            shm_file(name, 4096, bytes([fill]) * 4096)
            write_grant(marks, tid=1, number=0, start=0, end=4096)
            received = await receiver.get(
                common_pb2.RelayDescriptor(backend="shm", region=name, nbytes=16, transfer_id=1)
            )
            assert bytes(received.buffer) == bytes([fill]) * 16
            view = received.buffer  # outlives the file being replaced
            received.release()
            os.unlink(path)
        assert view[0] == 2
    finally:
        for p in (path, marks):
            if os.path.exists(p):
                os.unlink(p)


# ----------------------------------------------------------------------------- lifetime


async def test_close_unlinks_and_is_idempotent(make_relay, prefix):
    sender, receiver = make_relay(), make_relay()
    handle = await sender.put(payload(3 * MiB), "r", "e")
    received = await receiver.get(handle.descriptor)
    value = unpack(pack(np.zeros(3 * MiB, np.uint8)).header, received.buffer)
    assert leftovers(prefix)
    sender.close()
    sender.close()
    assert leftovers(prefix) == []
    # The receiver's views outlive the unlink and even its own close.
    receiver.close()
    assert int(value[-1]) == 1
    handle.release()  # after close: a no-op
    with pytest.raises(RelayError, match="closed"):
        await sender.put(payload(1), "r", "e")
    with pytest.raises(RelayError, match="closed"):
        await receiver.get(handle.descriptor)


async def test_close_fails_blocked_puts(make_relay):
    relay = make_relay(credit_slots=1)
    await relay.put(payload(8), "r", "e")
    blocked = asyncio.create_task(relay.put(payload(8), "r", "e"))
    await settle()
    relay.close()
    with pytest.raises(RelayError):
        await asyncio.wait_for(blocked, timeout=30)


def test_sweep_segments(prefix):
    for i in range(3):
        with open(os.path.join(SHM_DIR, f"{prefix}-999999-{i}"), "wb"):
            pass
    keep = os.path.join(SHM_DIR, f"{prefix}x-1-0")  # another prefix that merely starts alike
    open(keep, "wb").close()
    try:
        assert sweep_segments(prefix) == 3
        assert leftovers(prefix) == [] and os.path.exists(keep)
    finally:
        os.unlink(keep)
    with pytest.raises(ValueError):
        sweep_segments("")
    with pytest.raises(ValueError):
        sweep_segments("../x")


def test_registry():
    assert {"inline", "shm"} <= set(relay_backends())
    with pytest.raises(RelayError, match="unknown relay backend"):
        create_relay("carrier-pigeon")


async def test_receiver_forgets_mappings_of_gone_senders(make_relay):
    receiver = make_relay()
    first, second = make_relay(), make_relay()
    h1 = await first.put(payload(10), "r", "e")
    (await receiver.get(h1.descriptor)).release()
    assert set(receiver._maps.mapped) == {h1.descriptor.region, marks_name(h1.descriptor.region)}
    first.close()
    with pytest.raises(RelayError, match="does not exist"):
        await receiver.get(h1.descriptor)
    assert receiver._maps.mapped == {}
    h2 = await second.put(payload(10), "r", "e")
    (await receiver.get(h2.descriptor)).release()
    assert set(receiver._maps.mapped) == {h2.descriptor.region, marks_name(h2.descriptor.region)}
    h2.release()


async def test_put_cancelled_during_threaded_copy_frees_after_copy(make_relay):
    relay = make_relay(options={"copy_thread_bytes": 1})
    task = asyncio.create_task(relay.put(payload(4 * MiB), "r", "e"))
    await asyncio.sleep(0)  # the put is now waiting on its copy thread
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(3000):  # the extent returns once the thread's copy has finished
        if relay.outstanding("e") == (0, 0):
            break
        await asyncio.sleep(0.01)
    assert relay.outstanding("e") == (0, 0)
    assert all(seg.alloc.used == 0 for seg in relay.pool.segments)
    handle = await relay.put(payload(10), "r", "e")  # still usable
    handle.release()


# ------------------------------------------------------------------- release marks


async def test_receiver_release_returns_credit_without_an_ack(make_relay):
    sender, receiver = make_relay(credit_slots=1), make_relay()
    first = await sender.put(payload(1000), "r1", "e")
    assert not first.acked_in_band and not sender.acks_in_band
    received = await receiver.get(first.descriptor)
    blocked = asyncio.ensure_future(sender.put(payload(1000), "r2", "e"))
    await asyncio.sleep(0.01)
    assert not blocked.done()  # the edge's only credit is still out
    received.release()  # marks the slot; the sender's poller notices
    second = await asyncio.wait_for(blocked, 5)
    assert first.released and sender.outstanding("e") == (1, second.nbytes)
    received.release()  # idempotent: no second mark
    second.release()


async def test_put_reclaims_marked_transfers_first(make_relay):
    sender, receiver = make_relay(), make_relay()
    handles = [await sender.put(payload(4096), f"r{i}", "e") for i in range(4)]
    for h in handles[:3]:
        (await receiver.get(h.descriptor)).release()
    assert sender.outstanding("e")[0] == 4
    fresh = await sender.put(payload(4096), "r9", "e")
    assert [h.released for h in handles] == [True, True, True, False]
    assert sender.outstanding("e")[0] == 2
    # The freed extent is reused: first-fit puts the new transfer at offset 0.
    assert fresh.descriptor.offset == 0
    handles[3].release()
    fresh.release()


async def test_threaded_put_reclaims_before_it_allocates(make_relay, prefix):
    # Payloads copied in a worker thread skip put_nowait; they must still reuse what
    # receivers released instead of growing the pool with fresh (page-faulting) segments.
    sender = make_relay(options={"copy_thread_bytes": 4096})
    receiver = make_relay()
    first = await sender.put(payload(MiB // 2), "r1", "e")
    (await receiver.get(first.descriptor)).release()
    second = await sender.put(payload(MiB // 2), "r2", "e")
    assert first.released
    assert second.descriptor.offset == first.descriptor.offset
    assert len(data_segments(prefix)) == 1
    second.release()


async def test_stale_mark_after_cleanup_does_not_free_a_newer_transfer(make_relay):
    sender, receiver = make_relay(), make_relay()
    old = await sender.put(payload(64), "aborted", "e")
    received = await receiver.get(old.descriptor)
    sender.cleanup("aborted")  # abort: freed without the receiver's mark
    newer = await sender.put(payload(64), "live", "e")
    received.release()  # the late mark names the old transfer id only
    assert sender.reclaim() == 0
    assert not newer.released
    newer.release()


async def test_descriptor_without_slot_is_rejected(make_relay):
    sender, receiver = make_relay(), make_relay()
    handle = await sender.put(payload(64), "r", "e")
    bad = common_pb2.RelayDescriptor()
    bad.CopyFrom(handle.descriptor)
    bad.transfer_id = handle.descriptor.transfer_id & ~0xFFFF
    with pytest.raises(RelayError, match="release slot"):
        await receiver.get(bad)
    handle.release()


async def test_put_nowait_only_when_nothing_must_wait(make_relay):
    relay = make_relay(credit_slots=1, options={"copy_thread_bytes": MiB})
    first = relay.put_nowait(pack(np.ones(100, np.uint8)), "r", "e")
    assert first is not None and relay.outstanding("e") == (1, first.nbytes)
    assert relay.put_nowait(pack(np.ones(100, np.uint8)), "r", "e") is None  # no credit
    first.release()
    assert relay.put_nowait(pack(np.ones(2 * MiB, np.uint8)), "r", "e") is None  # threaded copy
    assert relay.outstanding("e") == (0, 0)


async def test_cached_get_checks_one_file_and_marks_its_pools_slot(make_relay, monkeypatch):
    sender, receiver = make_relay(), make_relay()
    first = await sender.put(payload(64), "r", "e")
    (await receiver.get(first.descriptor)).release()
    stats: list[str] = []
    real_lstat = os.lstat
    monkeypatch.setattr(os, "lstat", lambda path: stats.append(path) or real_lstat(path))
    second = await sender.put(payload(64), "r", "e")
    received = await receiver.get(second.descriptor)
    # The marks segment was mapped with the data segment: only the data file is checked
    # (for a restarted sender), and the release still lands in the sender's marks.
    assert stats == [os.path.join(SHM_DIR, second.descriptor.region)]
    received.release()
    assert sender.reclaim() == 1 and sender.outstanding("e") == (0, 0)
    # The marks segment, mapped and cached by now, is still no data region.
    marks = common_pb2.RelayDescriptor(
        backend="shm", region=marks_name(second.descriptor.region), nbytes=8, transfer_id=1
    )
    with pytest.raises(RelayError, match="release-marks segment"):
        receiver.get_nowait(marks)


async def test_large_put_copied_in_parts_arrives_whole(make_relay):
    sender, receiver = make_relay(options={"copy_threads": 2}), make_relay()
    data = np.random.default_rng(1).integers(0, 255, 9 * MiB + 3, dtype=np.uint8)
    handle = await sender.put(pack(data), "r", "e")
    received = await receiver.get(handle.descriptor)
    assert np.array_equal(np.frombuffer(received.buffer, np.uint8)[: data.size], data)
    received.release()
    handle.release()


def test_bad_copy_option_fails_at_creation(prefix):
    with pytest.raises(RelayError, match="copy_threads"):
        create_relay("shm", RelaySettings(name_prefix=prefix, options={"copy_threads": -2}))
