"""shm receiver: it trusts only what is its own (issue 20 findings).

A descriptor comes from a peer over Deliver. The receiver maps only data segments of its own
name prefix and of prefixes the mesh announced (compose gives each service its own), checks
the extent against the file before mapping it, caches nothing for a get that fails, and
refuses anything malformed with RelayError.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import time
import uuid
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest

from omnirail.relay.base import RelayError, RelaySettings, create_relay
from omnirail.relay.shm import ShmRelay, sweep_segments
from omnirail.relay.shm_pool import (
    MARKS_BYTES,
    SHM_DIR,
    data_segment_prefix,
    marks_name,
    segment_prefix,
)
from omnirail.v1 import common_pb2
from omnirail.wire.payload import pack
from tests.unit.relay.shm_files import shm_file, write_grant

MiB = 1 << 20
GiB = 1 << 30
Descriptor = common_pb2.RelayDescriptor


def mapped(path: str) -> bool:
    """Whether this process maps the file at `path` (a line of /proc/self/maps names it)."""
    with open("/proc/self/maps") as f:
        return any(line.rstrip("\n").endswith(" " + path) for line in f)


segment = shm_file


@pytest.fixture
def prefix() -> Iterator[str]:
    name = f"ortrust{uuid.uuid4().hex[:10]}"
    yield name
    sweep_segments(name)


@pytest.fixture
def relays(prefix: str) -> Iterator[list[ShmRelay]]:
    made: list[ShmRelay] = []
    yield made
    for relay in made:
        relay.close()


@pytest.fixture
def receiver(prefix: str, relays: list[ShmRelay]) -> ShmRelay:
    relay = create_relay("shm", RelaySettings(name_prefix=prefix, pool_bytes=MiB))
    assert isinstance(relay, ShmRelay)
    relay._peer_wait_s = 0.0  # an unannounced prefix is refused at once (see test_late_...)
    relays.append(relay)
    return relay


def info(prefix: str) -> bytes:
    """What an shm relay of `prefix` announces (`local_info`)."""
    return msgpack.packb({"backend": "shm", "id": prefix})


@pytest.fixture
def sender(prefix: str, relays: list[ShmRelay]) -> ShmRelay:
    relay = create_relay("shm", RelaySettings(name_prefix=prefix, pool_bytes=MiB))
    assert isinstance(relay, ShmRelay)
    relays.append(relay)
    return relay


def desc(region: str, offset: int = 0, nbytes: int = 16, tid: int = 1, **kw: object) -> Descriptor:
    return Descriptor(
        backend="shm", region=region, offset=offset, nbytes=nbytes, transfer_id=tid, **kw
    )


# ----------------------------------------------------------------------------- 1: prefix


@pytest.mark.parametrize("other", ["zz{u}", "{p}x", "{p}-x", "x{p}"])
async def test_foreign_prefix_is_refused_before_anything_is_opened(
    receiver: ShmRelay, prefix: str, other: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A segment of another prefix (another mesh, or anyone's file that looks like one) is
    refused by name: nothing is stat'ed or opened, its bytes never come back, and no
    release writes into its marks."""
    foreign = other.format(p=prefix, u=uuid.uuid4().hex[:8])
    name = f"{foreign}-1.0-0"
    data = segment(name, 4096, b"secret" * 8)
    marks = segment(marks_name(name), MARKS_BYTES)
    touched: list[str] = []
    for fn in ("lstat", "open"):
        real = getattr(os, fn)
        monkeypatch.setattr(
            os, fn, lambda path, *a, _real=real, **k: touched.append(path) or _real(path, *a, **k)
        )
    try:
        with pytest.raises(RelayError, match="neither this relay's nor announced"):
            await receiver.get(desc(name))
        assert touched == []
        assert not mapped(data) and not mapped(marks)
        with open(marks, "rb") as f:
            assert f.read(16) == bytes(16), "something wrote into the foreign marks"
    finally:
        monkeypatch.undo()
        os.unlink(data)
        os.unlink(marks)


def test_a_data_segment_name_tells_its_exact_prefix() -> None:
    assert data_segment_prefix("p-1234.0-0") == "p"
    assert data_segment_prefix("p-q.r-1.22-333") == "p-q.r"
    assert data_segment_prefix("a-1.2-3.4-5") == "a-1.2"  # the numbers end it, uniquely
    assert segment_prefix("p-1.0-marks") == "p" and segment_prefix("p-1.0-7") == "p"
    for bad in (
        "p-1.0-marks",  # the release marks are never a data region
        "p-1.0-0\n",
        "\np-1.0-0",
        "p-1.0-0/../x",
        "p/x-1.0-0",
        "p-1-0",
        "p-\u0661.0-0",  # ARABIC-INDIC DIGIT ONE: `\\d` would take it
        "p-1.0-",
        "p-12345678901.0-0",
        "-1.0-0",
        "p",
    ):
        assert data_segment_prefix(bad) is None, bad


@pytest.mark.parametrize("bad", ["", "a b", "a/b", "x\n", "ü"])
def test_bad_prefix_fails_at_creation(bad: str) -> None:
    with pytest.raises(RelayError, match="bad name prefix"):
        create_relay("shm", RelaySettings(name_prefix=bad))


async def test_announced_prefix_is_mapped_and_withdrawn_again(
    receiver: ShmRelay, prefix: str
) -> None:
    """compose gives each service its own prefix: a receiver maps a sender's segments once
    the mesh announced the sender's prefix, and forgets them once it no longer does."""
    other = f"{prefix}svc"
    sender = create_relay("shm", RelaySettings(name_prefix=other, pool_bytes=MiB))
    try:
        assert msgpack.unpackb(sender.local_info()) == {
            "backend": "shm",
            "id": f"{other}-{os.getpid()}",  # the process: what descriptors are bound to
            "prefix": other,  # what receivers map
        }
        handle = await sender.put(pack(np.arange(100, dtype=np.uint8)), "r", "e")
        with pytest.raises(RelayError, match="neither this relay's nor announced"):
            await receiver.get(handle.descriptor)
        assert receiver._maps.mapped == {}
        receiver.set_peers([sender.local_info(), receiver.local_info(), b"\xc1", b""])
        received = await receiver.get(handle.descriptor)
        assert bytes(received.buffer) == bytes(range(100))
        view = received.buffer
        received.release()
        assert sender.reclaim() == 1  # the release landed in the sender's marks
        handle = await sender.put(pack(np.arange(100, dtype=np.uint8)), "r", "e")
        receiver.set_peers([receiver.local_info()])  # the sender left the topology
        assert receiver._maps.mapped == {}
        with pytest.raises(RelayError, match="neither this relay's nor announced"):
            await receiver.get(handle.descriptor)
        # A view the receiver's caller still holds stays readable: dropping a mapping from
        # the cache never unmaps bytes under a live view.
        assert bytes(view) == bytes(range(100))
    finally:
        sender.close()
        sweep_segments(other)


async def test_trust_peers_narrows_the_announced_prefixes(receiver: ShmRelay, prefix: str) -> None:
    other = f"{prefix}svc"
    sender = create_relay("shm", RelaySettings(name_prefix=other, pool_bytes=MiB))
    try:
        handle = await sender.put(pack(np.ones(100, np.uint8)), "r", "e")
        receiver._peer_wait_s = 5.0  # an untrusted prefix is refused without the wait
        receiver.trust_peers(["someone-else"])
        receiver.set_peers([sender.local_info()])
        started = time.monotonic()
        with pytest.raises(RelayError, match="not trusted"):
            await receiver.get(handle.descriptor)
        assert time.monotonic() - started < 4  # not the 5 s wait for an unknown peer
        receiver.trust_peers([other])
        (await receiver.get(handle.descriptor)).release()
        receiver.trust_peers([])  # its own prefix only: the cache forgets the other's
        assert receiver._maps.mapped == {}
        own = await receiver.put(pack(np.ones(10, np.uint8)), "r", "e")
        (await receiver.get(own.descriptor)).release()  # its own: always
        receiver.trust_peers(None)
        (await receiver.get(handle.descriptor)).release()
    finally:
        sender.close()
        sweep_segments(other)


@pytest.mark.parametrize("bad", ["one-prefix", b"x", [1], [[1]], 5])
def test_trust_peers_takes_an_iterable_of_prefixes(receiver: ShmRelay, bad: object) -> None:
    with pytest.raises(RelayError):
        receiver.trust_peers(bad)  # type: ignore[arg-type]


async def test_late_announcement_is_waited_for(receiver: ShmRelay, prefix: str) -> None:
    """A descriptor may overtake its sender's announcement (another stream): the get
    waits for it, up to the peer wait, as the pulled relays do."""
    other = f"{prefix}svc"
    sender = create_relay("shm", RelaySettings(name_prefix=other, pool_bytes=MiB))
    try:
        handle = await sender.put(pack(np.ones(100, np.uint8)), "r", "e")
        receiver._peer_wait_s = 5.0
        loop = asyncio.get_running_loop()
        loop.call_later(0.1, receiver.set_peers, [sender.local_info()])
        (await asyncio.wait_for(receiver.get(handle.descriptor), 4)).release()
        receiver._peer_wait_s = 0.2
        receiver.set_peers([])
        started = time.monotonic()
        with pytest.raises(RelayError, match="neither this relay's nor announced"):
            await receiver.get(handle.descriptor)
        assert 0.1 < time.monotonic() - started < 2
    finally:
        sender.close()
        sweep_segments(other)


def test_malformed_announcements_are_ignored(receiver: ShmRelay, prefix: str) -> None:
    receiver.set_peers(
        [
            info(prefix + "\n"),
            info("a b"),
            info("x" * 201),
            msgpack.packb({"backend": "shm", "id": 5}),
            msgpack.packb({"backend": "nixl", "id": "n"}),
            msgpack.packb(["shm", "p"]),
            b"\xc1",
            info("ok"),
        ]
    )
    assert receiver._accepted == {prefix, "ok"}


# ----------------------------------------------------------------------------- 2: marks


@pytest.mark.parametrize("marks_size", [None, 0, 8, MARKS_BYTES - 8, MARKS_BYTES + 8])
async def test_bad_marks_fail_every_get_and_cache_nothing(
    receiver: ShmRelay, prefix: str, marks_size: int | None
) -> None:
    """Marks missing or of the wrong size: every get fails alike (the data mapping used to
    stay cached, so the next get succeeded without marks: a release then marked nothing)."""
    name = f"{prefix}-1.0-0"
    data = segment(name, 4096, b"x" * 64)
    marks = os.path.join(SHM_DIR, marks_name(name))
    if marks_size is not None:
        segment(marks_name(name), marks_size)
    try:
        errors = []
        for _ in range(2):
            with pytest.raises(RelayError) as info:
                await receiver.get(desc(name))
            errors.append(str(info.value))
            assert receiver._maps.mapped == {}
            assert not mapped(data) and not mapped(marks)
        assert errors[0] == errors[1]
        # With good marks the same descriptor works, and its release lands in them.
        segment(marks_name(name), MARKS_BYTES)
        write_grant(marks, tid=(7 << 16) | 3, number=0, start=0, end=16)
        received = await receiver.get(desc(name, tid=(7 << 16) | 3))
        assert bytes(received.buffer) == b"x" * 16
        received.release()
        slots = np.fromfile(marks, np.uint64)
        assert slots[3] == (7 << 16) | 3
    finally:
        for path in (data, marks):
            if os.path.exists(path):
                os.unlink(path)


# ----------------------------------------------------------------------------- 3: sizes


@pytest.mark.parametrize(
    ("offset", "nbytes"),
    [(0, 1 << 40), (1 << 40, 1), (2 * GiB, 1), (2 * GiB - 8, 16), (2**64 - 1, 2**64 - 1)],
)
async def test_extent_is_checked_against_the_file_before_mapping(
    receiver: ShmRelay, prefix: str, offset: int, nbytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An extent past the segment's end is refused from its size, before the data is
    mapped: neither the (sparse, 2 GiB) data segment nor its marks stay mapped. (The marks
    are mapped first, for the transfer's grant, which here covers every extent.)"""
    name = f"{prefix}-1.0-0"
    data = segment(name, 2 * GiB)
    marks = write_grant(marks_name(name), tid=1, number=0, start=0, end=2**64 - 1)
    maps: list[int] = []
    real_mmap = mmap.mmap
    monkeypatch.setattr(mmap, "mmap", lambda *a, **k: maps.append(a[1]) or real_mmap(*a, **k))
    try:
        # An end past 2**64 is outside any grant.
        with pytest.raises(RelayError, match=r"outside segment|not the extent"):
            await receiver.get(desc(name, offset=offset, nbytes=nbytes))
        assert maps in ([], [MARKS_BYTES]) and receiver._maps.mapped == {}
        assert not mapped(data) and not mapped(marks)
        monkeypatch.undo()
        # The segment itself is fine: its last bytes come back.
        received = await receiver.get(desc(name, offset=2 * GiB - 16, nbytes=16))
        assert bytes(received.buffer) == bytes(16)
        received.release()
    finally:
        monkeypatch.undo()
        os.unlink(data)
        os.unlink(marks)


async def test_failed_get_of_a_2gib_segment_leaves_nothing_mapped(
    receiver: ShmRelay, prefix: str
) -> None:
    """A get that fails after the data segment was mapped (its marks are missing) unmaps
    it again: 2 GiB of address space used to stay mapped and cached."""
    name = f"{prefix}-2.0-0"
    data = segment(name, 2 * GiB)
    try:
        with pytest.raises(RelayError, match="does not exist"):
            await receiver.get(desc(name, nbytes=GiB))
        assert not mapped(data) and receiver._maps.mapped == {}
    finally:
        os.unlink(data)


async def test_cached_segment_refuses_extents_past_its_end(
    sender: ShmRelay, receiver: ShmRelay
) -> None:
    handle = await sender.put(pack(np.ones(100, np.uint8)), "r", "e")
    d = handle.descriptor
    (await receiver.get(d)).release()  # now cached
    cached = dict(receiver._maps.mapped)
    for offset, nbytes in ((0, 1 << 40), (MiB, 1), (2**64 - 1, 2)):
        bad = desc(d.region, offset=offset, nbytes=nbytes, tid=d.transfer_id)
        with pytest.raises(RelayError, match="not the extent its transfer_id was granted"):
            await receiver.get(bad)
    assert receiver._maps.mapped == cached
    handle.release()


async def test_no_release_slot_is_refused_before_mapping(
    receiver: ShmRelay, sender: ShmRelay
) -> None:
    handle = await sender.put(pack(np.ones(100, np.uint8)), "r", "e")
    bad = Descriptor()
    bad.CopyFrom(handle.descriptor)
    bad.transfer_id = 1 << 16  # slot 0
    with pytest.raises(RelayError, match="no release slot"):
        await receiver.get(bad)
    assert receiver._maps.mapped == {}
    handle.release()


# ----------------------------------------------------------------------------- 4: names


async def test_trailing_newline_is_not_a_segment_name(sender: ShmRelay, receiver: ShmRelay) -> None:
    """`$` matches before a final newline: a name pattern ending in it took 'name\\n'."""
    handle = await sender.put(pack(np.ones(100, np.uint8)), "r", "e")
    for region in (handle.descriptor.region + "\n", "\n" + handle.descriptor.region):
        with pytest.raises(RelayError, match="bad shm segment name"):
            await receiver.get(desc(region, tid=handle.descriptor.transfer_id))
    with pytest.raises(ValueError, match="bad shm name prefix"):
        sweep_segments("omnirail\n")
    handle.release()


# ----------------------------------------------------------------------------- malformed


async def test_malformed_descriptors_raise_relay_error_only(
    sender: ShmRelay, receiver: ShmRelay
) -> None:
    handle = await sender.put(pack(np.ones(100, np.uint8)), "r", "e")
    good = handle.descriptor
    unknown = Descriptor.FromString(good.SerializeToString() + b"\x38\x05")  # field 7
    extra = Descriptor()
    extra.CopyFrom(good)
    extra.extra = b"\x00"
    cases: list[object] = [
        None,
        b"bytes",
        {"backend": "shm", "region": good.region},
        common_pb2.Payload(),
        unknown,
        extra,
        Descriptor(backend="SHM", region=good.region, nbytes=1, transfer_id=good.transfer_id),
        Descriptor(backend="shm\n", region=good.region, nbytes=1, transfer_id=good.transfer_id),
    ]
    for case in cases:
        with pytest.raises(RelayError):
            await receiver.get(case)  # type: ignore[arg-type]
    assert receiver._maps.mapped == {}
    received = await receiver.get(good)  # still fine
    received.release()
    assert sender.reclaim() == 1
