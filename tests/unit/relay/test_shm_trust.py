"""shm descriptors bound to their sender (issue 37): unguessable transfer ids, the grant
table a receiver checks before it reads, the owner check against the ids the stream's
authenticated sender announced, forwarding by the tag a forwarder writes, owner-only files.
"""

from __future__ import annotations

import os
import stat
import uuid
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest

from omnirail.relay.base import RelayError, RelaySettings, create_relay
from omnirail.relay.shm import ShmRelay, forward_tag, sweep_segments
from omnirail.relay.shm_handles import SLOT_MASK
from omnirail.relay.shm_pool import GRANT_FORWARDER, MARK_SLOTS, grant_index
from omnirail.v1 import common_pb2
from omnirail.wire.payload import pack, unpack

MiB = 1 << 20


@pytest.fixture
def relays() -> Iterator[list[ShmRelay]]:
    made: list[ShmRelay] = []
    prefixes: set[str] = set()

    yield made
    for relay in made:
        prefixes.add(relay.settings.name_prefix)
        relay.close()
    for prefix in prefixes:
        sweep_segments(prefix)


@pytest.fixture
def make(relays: list[ShmRelay]):
    def make(prefix: str | None = None) -> ShmRelay:
        relay = create_relay(
            "shm",
            RelaySettings(name_prefix=prefix or f"ortrust{uuid.uuid4().hex[:8]}", pool_bytes=MiB),
        )
        assert isinstance(relay, ShmRelay)
        relay._peer_wait_s = 0.0
        relays.append(relay)
        return relay

    return make


def peer_id(relay: ShmRelay) -> str:
    return msgpack.unpackb(relay.local_info())["id"]


def data(n: int, fill: int) -> object:
    return pack(np.full(n, fill, np.uint8))


def meet(*relays: ShmRelay) -> None:
    """Every relay learns every other's announcement (the topology)."""
    infos = [r.local_info() for r in relays]
    for relay in relays:
        relay.set_peers(infos)


def copy(d: common_pb2.RelayDescriptor, **fields: object) -> common_pb2.RelayDescriptor:
    out = common_pb2.RelayDescriptor()
    out.CopyFrom(d)
    for k, v in fields.items():
        setattr(out, k, v)
    return out


def marks_of(relay: ShmRelay) -> np.ndarray:
    assert relay._pool is not None
    return relay._pool.marks


async def test_the_owner_of_a_segment_is_its_sending_process(make) -> None:
    sender, receiver = make(), make()
    meet(sender, receiver)
    assert peer_id(sender) == f"{sender.settings.name_prefix}-{os.getpid()}"
    handle = await sender.put(data(100, 7), "r", "e")
    got = await receiver.get(handle.descriptor, frozenset({peer_id(sender)}))
    assert bytes(got.buffer)[-100:] == bytes([7]) * 100
    got.release()
    assert sender.reclaim() == 1


async def test_a_descriptor_of_a_process_the_sender_did_not_announce_is_refused(make) -> None:
    """Another sender's segment, named by a member that announced other ids: refused
    before a byte is read, and no release mark is written."""
    victim, hostile, receiver = make(), make(), make()
    meet(victim, hostile, receiver)
    handle = await victim.put(data(100, 9), "r", "e")
    with pytest.raises(RelayError, match="did not announce, and the sender did not hand"):
        await receiver.get(handle.descriptor, frozenset({peer_id(hostile)}))
    assert not receiver._held
    assert marks_of(victim)[handle.transfer_id & SLOT_MASK] == 0  # nothing marked
    with pytest.raises(RelayError, match="did not announce"):
        await receiver.get(handle.descriptor, frozenset())  # the coordinator: none
    handle.release()


async def test_transfer_ids_are_unguessable(make) -> None:
    sender = make()
    handles = [await sender.put(data(10, i), "r", "e") for i in range(64)]
    ids = [h.transfer_id for h in handles]
    randoms = {tid >> 16 for tid in ids}
    assert len(randoms) == len(ids)  # 48 random bits each: no repeats, no sequence
    assert all(tid & SLOT_MASK for tid in ids)  # the slot bits the marks need stay
    assert max(r.bit_length() for r in randoms) > 40
    for h in handles:
        h.release()


async def test_a_guessed_or_stale_transfer_id_reads_nothing(make) -> None:
    sender, receiver = make(), make()
    meet(sender, receiver)
    owners = frozenset({peer_id(sender)})
    handle = await sender.put(data(100, 3), "r", "e")
    d = handle.descriptor
    slot = d.transfer_id & SLOT_MASK
    for guess in (slot | (1 << 16), d.transfer_id ^ (1 << 40), d.transfer_id + (1 << 16)):
        with pytest.raises(RelayError, match="not a live transfer"):
            await receiver.get(copy(d, transfer_id=guess), owners)
    assert not receiver._held and marks_of(sender)[slot] == 0
    got = await receiver.get(d, owners)
    got.release()
    assert sender.reclaim() == 1  # released: the grant is gone
    with pytest.raises(RelayError, match="not a live transfer"):
        await receiver.get(d, owners)  # stale: replayed after its release
    assert not receiver._held


async def test_another_edges_extent_is_refused(make) -> None:
    """A sender's own segment, but bytes of another of its transfers (another edge's):
    the grant names the extent each id may read."""
    sender, receiver = make(), make()
    meet(sender, receiver)
    owners = frozenset({peer_id(sender)})
    mine = await sender.put(data(256, 1), "r1", "edge-1")
    other = await sender.put(data(256, 2), "r2", "edge-2")
    m, o = mine.descriptor, other.descriptor
    assert m.region == o.region and m.offset != o.offset
    for base, offset, nbytes in (
        (m, o.offset, o.nbytes),  # the other edge's bytes, under this edge's id
        (o, m.offset, m.nbytes),  # and the reverse
        (m, m.offset, m.nbytes + 64),  # past its end
        (o, o.offset - 64, 64),  # before its start
    ):
        with pytest.raises(RelayError, match="not the extent its transfer_id was granted"):
            await receiver.get(copy(base, offset=offset, nbytes=nbytes), owners)
    assert not receiver._held
    # A part of its own extent is fine (what a forward names).
    part = await receiver.get(copy(m, offset=m.offset + 64, nbytes=64), owners)
    part.release()
    mine.release()
    other.release()


async def test_a_forward_is_accepted_from_the_process_that_handed_it_on(make) -> None:
    """A -> B -> C, B forwarding A's bytes: C accepts A's segment from B, whom the grant
    names as the forwarder, and from nobody else."""
    a, b, c, stranger = make(), make(), make(), make()
    meet(a, b, c, stranger)
    handle = await a.put(data(4096, 5), "r", "a->b")
    received = await b.get(handle.descriptor, frozenset({peer_id(a)}))
    tensors = unpack(pack(np.full(4096, 5, np.uint8)).header, received.buffer)
    forward = b.forward_nowait(pack(tensors), "r", "b->c")
    assert forward is not None and forward.descriptor.region == handle.descriptor.region
    g = grant_index(handle.transfer_id & SLOT_MASK)
    assert marks_of(a)[g + GRANT_FORWARDER] == forward_tag(peer_id(b))
    with pytest.raises(RelayError, match="did not hand that transfer on"):
        await c.get(forward.descriptor, frozenset({peer_id(stranger)}))
    got = await c.get(forward.descriptor, frozenset({peer_id(b)}))
    assert bytes(got.buffer) == bytes([5]) * 4096
    del tensors
    received.release()  # B is done: C answers for the mark now
    got.release()
    assert a.reclaim() == 1


async def test_no_owners_means_no_binding_but_the_grant_still_counts(make) -> None:
    sender, receiver = make(), make()
    meet(sender, receiver)
    handle = await sender.put(data(10, 1), "r", "e")
    (await receiver.get(handle.descriptor, None)).release()
    with pytest.raises(RelayError, match="not a live transfer"):
        await receiver.get(copy(handle.descriptor, transfer_id=handle.transfer_id ^ (1 << 20)))


async def test_segments_are_owner_only(make) -> None:
    old = os.umask(0)  # a permissive umask changes nothing: the pool sets 0600 itself
    try:
        sender = make()
        await sender.put(data(10, 1), "r", "e")
        big = await sender.put(data(3 * MiB, 1), "r", "e")  # a second data segment
    finally:
        os.umask(old)
    pool = sender._pool
    assert pool is not None and len(pool.segments) == 2
    for path in [s.path for s in pool.segments] + [pool._marks_segment.path]:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
    big.release()


def test_the_grant_table_follows_the_marks() -> None:
    assert grant_index(0) == MARK_SLOTS
    assert grant_index(SLOT_MASK) + GRANT_FORWARDER < MARK_SLOTS * 6
