"""Receiver-pulled relays (nixl, ucx, torchdist share `PullRelay`): what a receiver trusts.

A fake backend that copies within the process stands in for the libraries, so these run
anywhere: peer ids match exactly, `trust_peers` narrows the announced peers, a malformed
descriptor raises RelayError only, and a failed get keeps no receive memory it grew.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest

from omnirail.relay.base import RelayError, RelaySettings, check_descriptor
from omnirail.relay.host_pool import HostExtent, HostPool
from omnirail.v1 import common_pb2
from omnirail.wire.payload import pack
from tests.unit.relay.fake_pull import FakePull

MiB = 1 << 20
Descriptor = common_pb2.RelayDescriptor


@pytest.fixture
def make() -> Iterator[Any]:
    made: list[FakePull] = []

    def make_(**options: Any) -> FakePull:
        relay = FakePull(RelaySettings(pool_bytes=MiB, options=options))
        made.append(relay)
        infos = [r.local_info() for r in made]
        for r in made:
            r.set_peers(infos)
        return relay

    yield make_
    for relay in made:
        relay.close()
        FakePull.by_id.pop(relay.peer_id, None)


def copy(d: Descriptor, **fields: Any) -> Descriptor:
    out = Descriptor()
    out.CopyFrom(d)
    for key, value in fields.items():
        setattr(out, key, value)
    return out


def maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


async def test_round_trip(make: Any) -> None:
    sender, receiver = make(), make()
    handle = await sender.put(pack(np.arange(100, dtype=np.uint8)), "r", "e")
    received = await receiver.get(handle.descriptor)
    assert bytes(received.buffer) == bytes(range(100))
    received.release()


# ----------------------------------------------------------------------------- peer ids


async def test_peer_id_with_a_trailing_newline_is_malformed(make: Any) -> None:
    """PEER_ID_RE ended in `$`, which matches before a final newline."""
    sender, receiver = make(), make(peer_wait_s=0.0)
    handle = await sender.put(pack(np.ones(10, np.uint8)), "r", "e")
    with pytest.raises(RelayError, match="malformed region"):
        await receiver.get(copy(handle.descriptor, region=handle.descriptor.region + "\n"))
    forged = msgpack.packb({"backend": FakePull.name, "id": sender.peer_id + "\n"})
    receiver.set_peers([forged, sender.local_info()])
    assert list(receiver._peers) == [sender.peer_id]


# ----------------------------------------------------------------------------- trust


async def test_an_id_announced_twice_differently_is_taken_up_by_neither(make: Any) -> None:
    """A forged info that claims a live peer's id (with its own address or metadata) used
    to replace the real one whenever it came later in the topology."""
    sender, receiver = make(), make(peer_wait_s=0.0)
    handle = await sender.put(pack(np.ones(10, np.uint8)), "r", "e")
    real = sender.local_info()
    forged = msgpack.packb({"backend": FakePull.name, "id": sender.peer_id, "host": "evil"})
    for infos in ([real, forged], [forged, real]):
        receiver.set_peers(infos)
        assert sender.peer_id not in receiver._peers
        with pytest.raises(RelayError, match="unknown peer"):
            await receiver.get(handle.descriptor)
    receiver.set_peers([real, real])  # the same info twice (two endpoints): fine
    (await receiver.get(handle.descriptor)).release()


async def test_trust_peers_narrows_the_announced_peers(make: Any) -> None:
    sender, receiver = make(), make()  # peer_wait_s: the default 5 s
    handle = await sender.put(pack(np.ones(10, np.uint8)), "r", "e")
    receiver.trust_peers(["someone-else"])
    assert sender.peer_id not in receiver._peers  # dropped at once
    started = time.monotonic()
    with pytest.raises(RelayError, match="not trusted"):
        await receiver.get(handle.descriptor)
    assert time.monotonic() - started < 1, "waited for an announcement it would not take"
    # A later announcement of the same peer is not taken up either.
    receiver.set_peers([sender.local_info(), receiver.local_info()])
    assert sender.peer_id not in receiver._peers
    receiver.trust_peers([sender.peer_id])  # vouched for: taken up from what was announced
    (await receiver.get(handle.descriptor)).release()
    handle = await sender.put(pack(np.ones(10, np.uint8)), "r", "e")
    receiver.trust_peers(None)  # the default: every announced peer
    (await receiver.get(handle.descriptor)).release()


@pytest.mark.parametrize("bad", ["one-id", b"one-id", [1], [None], [[1]], 5])
def test_trust_peers_takes_an_iterable_of_ids(make: Any, bad: Any) -> None:
    with pytest.raises(RelayError):
        make().trust_peers(bad)


# ----------------------------------------------------------------------------- malformed


async def test_malformed_descriptors_raise_relay_error_only(make: Any) -> None:
    sender, receiver = make(), make(peer_wait_s=0.0)
    handle = await sender.put(pack(np.ones(10, np.uint8)), "r", "e")
    good = handle.descriptor
    cases: list[Any] = [
        None,
        "descriptor",
        {"backend": FakePull.name},
        common_pb2.Payload(),
        Descriptor.FromString(good.SerializeToString() + b"\x38\x05"),  # unknown field 7
        copy(good, extra=b"x"),
        copy(good, backend="shm"),
        copy(good, backend=""),
        copy(good, region=""),
        copy(good, region="a" * 100_000),
        copy(good, region="../x"),
        copy(good, region="unknown-peer"),
        copy(good, offset=2**64 - 1),
        copy(good, nbytes=2**64 - 1),
        copy(good, transfer_id=0),
        copy(good, transfer_id=good.transfer_id + 1),
    ]
    for case in cases:
        with pytest.raises(RelayError):
            await receiver.get(case)
    (await receiver.get(good)).release()


def test_check_descriptor_refuses_what_no_backend_reads() -> None:
    good = Descriptor(backend="b", region="r", offset=1, nbytes=2, transfer_id=3)
    assert check_descriptor(good, "b") is good
    for bad in (copy(good, extra=b"\x00"), Descriptor.FromString(b"\x0a\x01b\x38\x01")):
        with pytest.raises(RelayError):
            check_descriptor(bad, "b")
    with pytest.raises(RelayError, match=r"'xxxx.*'\.\.\."):
        check_descriptor(copy(good, backend="x" * 10_000), "b")  # named, but cut short


# ----------------------------------------------------------------------------- memory


@pytest.mark.parametrize("nbytes", [64 * MiB, (1 << 40) - 1])
async def test_failed_get_keeps_no_receive_memory_it_grew(make: Any, nbytes: int) -> None:
    """A descriptor claiming more bytes than the sender holds grew the receive pool to
    its claim (up to 1 TiB: an OSError came out when that could not be mapped) and kept
    the segment after the fetch failed."""
    sender, receiver = make(), make()
    handle = await sender.put(pack(np.ones(10, np.uint8)), "r", "e")
    (await receiver.get(handle.descriptor)).release()  # the receive pool's first segment
    handle = await sender.put(pack(np.ones(10, np.uint8)), "r", "e")
    before, pool = maps(), receiver.receive_pool
    segments = list(pool.segments)
    with pytest.raises(RelayError):
        await receiver.get(copy(handle.descriptor, nbytes=nbytes))
    assert pool.segments == segments
    assert maps() <= before
    (await receiver.get(handle.descriptor)).release()


async def test_allocation_failure_is_a_relay_error(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    sender, receiver = make(), make()
    handle = await sender.put(pack(np.ones(10, np.uint8)), "r", "e")

    def no_memory(self: HostPool, nbytes: int) -> HostExtent:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(HostPool, "alloc", no_memory)
    with pytest.raises(RelayError, match="cannot allocate"):
        await receiver.get(handle.descriptor)


# ----------------------------------------------------------------------------- issue 37


async def test_a_descriptor_of_another_owner_is_refused_before_anything(make: Any) -> None:
    """`owners`: the ids the stream's sender announced. A descriptor naming another relay is
    refused at once (no wait for an announcement, no receive pool), whatever it names."""
    sender, receiver = make(), make()  # peer_wait_s: the default 5 s
    handle = await sender.put(pack(np.ones(10, np.uint8)), "r", "e")
    desc = handle.descriptor
    for owners in (frozenset(), frozenset({"someone-else"}), frozenset({desc.region + "x"})):
        started = time.monotonic()
        with pytest.raises(RelayError, match="did not announce"):
            await receiver.get(desc, owners)
        with pytest.raises(RelayError, match="did not announce"):
            await receiver.get(copy(desc, region="not-announced-at-all"), owners)
        assert time.monotonic() - started < 1
    assert receiver._recv_pool is None, "allocated for a refused descriptor"
    for bad in (desc.region, [desc.region]):  # a string would match its substrings
        with pytest.raises(RelayError, match="owners"):
            await receiver.get(desc, bad)  # type: ignore[arg-type]
    (await receiver.get(desc, frozenset({desc.region}))).release()


async def test_transfer_ids_are_random(make: Any) -> None:
    sender = make()
    ids = [(await sender.put(pack(np.ones(10, np.uint8)), "r", "e")).tid for _ in range(64)]
    assert len(set(ids)) == 64 and all(0 < t < 1 << 63 for t in ids)
    assert sum(t >= 1 << 40 for t in ids) > 60, "not 63 random bits"
    assert sorted(ids) != ids, "in order: sequential, not random"


async def test_a_transfer_is_bound_to_the_first_peer_served(make: Any) -> None:
    sender = make()
    handle = await sender.put(pack(np.ones(100, np.uint8)), "r", "e")
    tid, offset, nbytes = handle.tid, handle.descriptor.offset, handle.nbytes
    assert sender.source(tid, offset, nbytes, "a") is not None
    sender.end_send(tid)
    assert sender.source(tid, offset, nbytes, "b") is None, "served to a second peer"
    assert sender.bytes_out == nbytes
    assert not sender.served(tid, "b"), "released by a peer it was not served to"
    assert sender.outstanding("e") == (1, nbytes)
    assert sender.served(tid, "a")
    assert sender.outstanding("e") == (0, 0)
    assert sender.source(tid, offset, nbytes, "a") is None, "served after its release"
