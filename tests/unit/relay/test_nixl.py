"""nixl relay: options, peer infos, notifications, handle reuse, chunking, and a sender that
dies (the conformance suite covers transfers, credits, garbage and a dying receiver)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from omnirail.relay.base import Relay, RelayError, RelaySettings, create_relay
from omnirail.wire.payload import pack

nixl = pytest.importorskip("omnirail.relay.nixl")
ROOT = Path(__file__).resolve().parents[3]
MiB = 1 << 20


@pytest.fixture
def make() -> Iterator[Any]:
    relays: list[Relay] = []

    def make_(**options: Any) -> Any:
        relay = create_relay("nixl", RelaySettings(pool_bytes=MiB, options=options))
        relays.append(relay)
        infos = [r.local_info() for r in relays]
        for r in relays:
            r.set_peers(infos)
        return relay

    yield make_
    for relay in relays:
        relay.close()


def data(nbytes: int, seed: int = 0) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(seed).bytes(nbytes), np.uint8)


async def roundtrip(sender: Any, receiver: Any, nbytes: int, seed: int = 0) -> None:
    packed = pack(data(nbytes, seed))
    handle = await sender.put(packed, "req", "edge")
    received = await receiver.get(handle.descriptor)
    assert zlib.crc32(received.buffer) == zlib.crc32(packed.to_bytes())
    received.release()


def test_bad_error_handling_mode_is_refused() -> None:
    with pytest.raises(RelayError, match="ucx_error_handling_mode: input should be 'none' or"):
        create_relay("nixl", RelaySettings(options={"ucx_error_handling_mode": "maybe"}))


def test_info_is_msgpack_with_opaque_metadata(make: Any) -> None:
    relay = make()
    info = msgpack.unpackb(relay.local_info(), raw=False)
    assert info["backend"] == "nixl" and info["id"] == relay.peer_id
    assert isinstance(info["meta"], bytes) and info["meta"]


async def test_malformed_or_mismatched_metadata_makes_no_peer(make: Any) -> None:
    sender, receiver = make(), make(peer_wait_s=0.2)
    handle = await sender.put(pack(data(100)), "req", "edge")
    garbage = {"backend": "nixl", "id": sender.peer_id, "meta": b"\x00garbage"}
    # Metadata of one agent announced under another agent's id: refused too.
    other = msgpack.unpackb(sender.local_info(), raw=False)
    other["id"] = "someone-else"
    receiver.set_peers([msgpack.packb(garbage), msgpack.packb(other), b"\xc1", b"not msgpack"])
    for region in (sender.peer_id, "someone-else"):
        handle.descriptor.region = region
        with pytest.raises(RelayError, match="unknown peer"):
            await receiver.get(handle.descriptor)


async def test_release_notification_must_match_the_extent(make: Any) -> None:
    sender, receiver = make(), make()
    handle = await sender.put(pack(data(1000)), "req", "edge")
    desc = handle.descriptor
    stray = nixl._RELEASE.pack(b"R", desc.transfer_id, desc.offset + 64)
    receiver.agent.send_notif(sender.peer_id, stray)
    await asyncio.sleep(0.05)
    sender._drain()
    assert sender.outstanding("edge") == (1, 1000), "a stray release freed a live extent"
    received = await receiver.get(desc)
    assert sender.outstanding("edge") == (1, 1000), "released before the receiver was done"
    received.release()
    deadline = time.monotonic() + 10
    while sender.outstanding("edge") != (0, 0) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert sender.outstanding("edge") == (0, 0)


async def test_new_sender_segments_are_learned_and_bounded(make: Any) -> None:
    sender, receiver = make(), make(handle_cache=2)
    # 3 MiB: a second segment, made after the receiver loaded the sender's metadata.
    for i, n in enumerate([100, 3 * MiB, 5000, 70_000, 3 * MiB + 1, 100]):
        await roundtrip(sender, receiver, n, seed=i)
    peer = receiver._peers[sender.peer_id]
    assert set(peer.segments) == {0, 1}
    assert len(peer.handles) <= 2


async def test_extent_past_the_senders_segment_is_refused_before_allocating(
    make: Any,
) -> None:
    """The sender's bounds of the segment are learned before the receiver allocates what
    a descriptor claims (it used to grow its receive pool, and register it, first)."""
    sender, receiver = make(), make()
    await roundtrip(sender, receiver, 100)
    handle = await sender.put(pack(data(100)), "req", "edge")
    pool = receiver.receive_pool
    segments = list(pool.segments)
    regs = len(receiver._regs)
    for nbytes in (64 * MiB, (1 << 40) - 1):
        bad = type(handle.descriptor)()
        bad.CopyFrom(handle.descriptor)
        bad.nbytes = nbytes
        with pytest.raises(RelayError, match="outside segment"):
            await receiver.get(bad)
    assert pool.segments == segments and len(receiver._regs) == regs
    handle.release()


async def test_failed_fetch_deregisters_the_receive_segment_it_grew(make: Any) -> None:
    sender, receiver = make(), make(fetch_timeout_s=1.0)
    await roundtrip(sender, receiver, 100)
    handle = await sender.put(pack(data(3 * MiB)), "req", "edge")
    pool = receiver.receive_pool
    segments, regs = list(pool.segments), len(receiver._regs)

    async def fail(*args: Any) -> None:
        raise RelayError("READ failed")

    receiver._complete = fail  # the READ fails after the pool grew for it
    receiver._post = lambda *a: (None, None, "PROC")
    with pytest.raises(RelayError, match="READ failed"):
        await receiver.get(handle.descriptor)
    assert pool.segments == segments and len(receiver._regs) == regs
    del receiver._complete, receiver._post
    received = await receiver.get(handle.descriptor)  # grows (and registers) it again
    assert len(received.buffer) == 3 * MiB
    received.release()


async def test_large_fetches_are_chunked(make: Any) -> None:
    sender, receiver = make(), make(chunk_bytes=64 << 10)
    await roundtrip(sender, receiver, MiB + 13)


async def test_closed_relay_keeps_held_views_readable(make: Any) -> None:
    sender, receiver = make(), make()
    packed = pack(data(5000))
    handle = await sender.put(packed, "req", "edge")
    received = await receiver.get(handle.descriptor)
    receiver.close()
    sender.close()
    assert zlib.crc32(received.buffer) == zlib.crc32(packed.to_bytes())
    received.release()  # no agent left to notify: harmless


# A sender in another process: puts, prints its info and descriptor, then serves its loop.
_SENDER = """
import asyncio, sys, json
import numpy as np
from omnirail.wire.payload import pack
from omnirail.relay.base import RelaySettings, create_relay

async def main():
    relay = create_relay("nixl", RelaySettings(pool_bytes=1 << 20))
    relay.set_peers([relay.local_info(), bytes.fromhex(sys.stdin.readline())])
    handles = [await relay.put(pack(np.full(n, 7, np.uint8)), "r", "e") for n in (4096, 3 << 20)]
    print(json.dumps([relay.local_info().hex()] + [h.descriptor.SerializeToString().hex()
                      for h in handles]), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_fetch_from_a_killed_sender_fails_fast(make: Any) -> None:
    from omnirail.v1 import common_pb2

    receiver = make(peer_wait_s=2.0, fetch_timeout_s=5.0)
    proc = subprocess.Popen(
        [sys.executable, "-c", _SENDER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=ROOT,
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(receiver.local_info().hex().encode() + b"\n")
        proc.stdin.flush()
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
        info, *descs = json.loads(line)
        receiver.set_peers([receiver.local_info(), bytes.fromhex(info)])
        small, big = (common_pb2.RelayDescriptor.FromString(bytes.fromhex(d)) for d in descs)
        received = await receiver.get(small)  # warm: endpoint and segment 0 known
        assert bytes(received.buffer[:3]) == b"\x07\x07\x07"
        received.release()
        proc.kill()
        proc.wait(30)
        for desc in (small, big):  # a known segment, and one never asked about
            started = time.monotonic()
            with pytest.raises(RelayError):
                (await asyncio.wait_for(receiver.get(desc), 30)).release()
            assert time.monotonic() - started < 10
    finally:
        proc.kill()
        proc.wait(30)


# ----------------------------------------------------------------------------- trust


async def test_unregistered_agent_gets_no_segment_and_reads_nothing(make: Any) -> None:
    """A NIXL agent the sender was never announced (it loaded the sender's announced
    metadata, so it can notify it) asks for a segment: the sender does not answer it, and
    its fetch fails with RelayError before reading anything."""
    sender = make()
    stranger = create_relay("nixl", RelaySettings(options={"peer_wait_s": 0.5}))
    try:
        stranger.set_peers([sender.local_info()])
        handle = await sender.put(pack(data(70_000)), "req", "edge")
        with pytest.raises(RelayError, match="timed out"):
            await asyncio.wait_for(stranger.get(handle.descriptor), 30)
        assert stranger.bytes_in == 0
        assert not stranger._peers[sender.peer_id].segments, "it learned a segment"
        # Nor can it release the transfer of someone else.
        release = nixl._RELEASE.pack(b"R", handle.descriptor.transfer_id, handle.descriptor.offset)
        stranger.agent.send_notif(sender.peer_id, release)
        await asyncio.sleep(0.05)
        sender._drain()
        assert sender.outstanding("edge") == (1, handle.nbytes)
    finally:
        stranger.close()


async def test_a_segment_is_handed_out_for_a_transfer_of_ones_own(make: Any) -> None:
    """A registered peer asking for a segment with a transfer that went to another peer is
    refused (and learns nothing); that transfer's release counts only from its peer."""
    sender, receiver, other = make(), make(), make(peer_wait_s=1.0)
    handle = await sender.put(pack(data(70_000, 1)), "req", "edge")
    desc = handle.descriptor
    held = await receiver.get(desc)
    with pytest.raises(RelayError, match="refused segment"):
        await asyncio.wait_for(other.get(desc), 30)
    assert other.bytes_in == 0 and not other._peers[sender.peer_id].segments
    other.agent.send_notif(sender.peer_id, nixl._RELEASE.pack(b"R", desc.transfer_id, desc.offset))
    await asyncio.sleep(0.05)
    sender._drain()
    assert sender.outstanding("edge") == (1, handle.nbytes), "another peer released it"
    held.release()
    await roundtrip(sender, other, 1000)  # its own transfers are served


async def test_ticket_is_checked_before_the_payload(make: Any) -> None:
    """With the segment known, a released or guessed id is refused by its ticket."""
    sender, receiver = make(), make()
    handle = await sender.put(pack(data(70_000, 2)), "req", "edge")
    desc = handle.descriptor
    (await receiver.get(desc)).release()
    deadline = time.monotonic() + 10
    while sender.outstanding("edge") != (0, 0) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    fetched = receiver.bytes_in
    assert receiver._peers[sender.peer_id].segments, "segment 0 is known"
    for tid in (desc.transfer_id, desc.transfer_id ^ (1 << 20), desc.transfer_id + 1):
        desc.transfer_id = tid
        with pytest.raises(RelayError, match=r"not live|no ticket"):
            await receiver.get(desc)
    assert receiver.bytes_in == fetched


def test_ucx_listens_on_the_mesh_interface_only() -> None:
    """With `host` (a stage's gRPC host) or `listen` set, NIXL's UCX backend listens on
    that address's interface only; an address no interface has is refused, naming it."""
    with pytest.raises(RelayError, match="option listen"):
        create_relay("nixl", RelaySettings(options={"listen": "192.0.2.254"}))
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        pytest.skip("ss is not available")
    import gc

    gc.collect()  # agents of relays closed by earlier tests go with their last reference
    pid = os.getpid()

    def listening() -> set[str]:
        out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=False)
        return {line.split()[3] for line in out.stdout.splitlines() if f"pid={pid}," in line}

    before = listening()
    relay = create_relay("nixl", RelaySettings(options={"host": "127.0.0.1"}))
    try:
        new = listening() - before
        assert new, "NIXL's UCX backend listens nowhere"
        assert all(a.startswith("127.") for a in new), f"beyond loopback: {new}"
    finally:
        relay.close()
