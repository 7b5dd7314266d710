"""ucx relay: what the conformance suite does not reach (its receiver gets one at a time and
its senders never die): concurrent gets on one endpoint, not-live transfers, a sender that
dies or stalls, credit returned on release, use from a loop other than the creating one."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import ipaddress
import os
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest

pytest.importorskip("ucxx")

from omnirail.relay.base import Relay, RelayError, RelaySettings, create_relay
from omnirail.relay.ucx import UcxRelay
from omnirail.v1 import common_pb2
from omnirail.wire.payload import pack

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[3]
Remote = tuple[subprocess.Popen[str], bytes, list[common_pb2.RelayDescriptor]]
OpenRemote = Callable[[UcxRelay], Remote]

# A sender in its own process: prints its info, reads the receiver's (it serves only
# announced peers), then prints the descriptors of three puts (hex).
SENDER = """
import asyncio, sys
import numpy as np
from omnirail.wire.payload import pack
from omnirail.relay.base import RelaySettings, create_relay

async def main():
    relay = create_relay("ucx", RelaySettings(pool_bytes=1 << 20))
    print(relay.local_info().hex(), flush=True)
    receiver = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    relay.set_peers([bytes.fromhex(receiver)])
    for i, n in enumerate((1000, 3 << 20, 3 << 20)):
        handle = await relay.put(pack(np.full(n, 7, np.uint8)), "req", f"edge{i}")
        print(handle.descriptor.SerializeToString().hex(), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def make(**options: object) -> UcxRelay:
    relay = create_relay("ucx", RelaySettings(pool_bytes=MiB, options=dict(options)))
    assert isinstance(relay, UcxRelay)
    return relay


@pytest.fixture
async def pair() -> AsyncIterator[tuple[UcxRelay, UcxRelay]]:
    sender, receiver = make(), make(peer_wait_s=0.5)
    infos = [sender.local_info(), receiver.local_info()]
    for relay in (sender, receiver):
        relay.set_peers(infos)
        await relay.connect(10)
    yield sender, receiver
    sender.close()
    receiver.close()


@pytest.fixture
def remote() -> Iterator[OpenRemote]:
    """`remote(receiver)`: a sender process that knows `receiver`, its info and puts."""
    procs: list[subprocess.Popen[str]] = []

    def open_(receiver: UcxRelay) -> Remote:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        proc = subprocess.Popen(
            [sys.executable, "-c", SENDER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env,
        )
        procs.append(proc)
        assert proc.stdout is not None and proc.stdin is not None
        info = bytes.fromhex(proc.stdout.readline())
        proc.stdin.write(receiver.local_info().hex() + "\n")
        proc.stdin.flush()
        descs = [
            common_pb2.RelayDescriptor.FromString(bytes.fromhex(proc.stdout.readline()))
            for _ in range(3)
        ]
        return proc, info, descs

    yield open_
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        proc.wait()


def pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(seed).bytes(nbytes), np.uint8)


async def test_concurrent_gets_share_one_endpoint(pair: tuple[UcxRelay, UcxRelay]) -> None:
    sender, receiver = pair
    sizes = [1, 4096, 8191, 8193, 65536, MiB + 3, 3 * MiB] * 4
    values = [pattern(n, i) for i, n in enumerate(sizes)]
    handles = [await sender.put(pack(v), "req", f"edge{i}") for i, v in enumerate(values)]
    got = await asyncio.gather(*(receiver.get(h.descriptor) for h in handles))
    for value, received in zip(values, got, strict=True):
        assert zlib.crc32(received.buffer) == zlib.crc32(value.tobytes())
        received.release()
    (peer,) = receiver._peers.values()
    assert peer.gen == 1, "one endpoint carried every get"


async def test_release_returns_credit(pair: tuple[UcxRelay, UcxRelay]) -> None:
    sender, receiver = pair
    first = await sender.put(pack(pattern(5000, 1)), "req", "edge")
    received = await receiver.get(first.descriptor)
    assert sender.outstanding("edge") == (1, first.nbytes), "credit held while the view is"
    received.release()
    deadline = time.monotonic() + 10
    while sender.outstanding("edge") != (0, 0) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert sender.outstanding("edge") == (0, 0)


async def test_not_live_transfer_raises_and_endpoint_survives(
    pair: tuple[UcxRelay, UcxRelay],
) -> None:
    sender, receiver = pair
    handle = await sender.put(pack(pattern(70_000, 2)), "req", "edge")
    (await receiver.get(handle.descriptor)).release()
    sender.cleanup("req")  # in case the release has not arrived yet
    with pytest.raises(RelayError, match="not live"):
        await asyncio.wait_for(receiver.get(handle.descriptor), 10)
    again = await sender.put(pack(pattern(70_000, 3)), "req", "edge")
    (await receiver.get(again.descriptor)).release()
    (peer,) = receiver._peers.values()
    assert peer.gen == 1, "a refused transfer must not cost the endpoint"


async def test_dead_sender_fails_fetches_at_once(remote: OpenRemote) -> None:
    receiver = make(fetch_timeout_s=60)
    try:
        proc, info, descs = remote(receiver)
        receiver.set_peers([info])
        received = await receiver.get(descs[0])
        assert bytes(received.buffer[:3]) == b"\x07\x07\x07"
        received.release()
        proc.send_signal(signal.SIGSTOP)
        pending = asyncio.create_task(receiver.get(descs[1]))  # asked, never answered
        await asyncio.sleep(0.5)
        proc.kill()
        # Reaped: over shared memory UCX's keepalive asks whether the process exists, and a
        # zombie still does.
        proc.wait()
        t0 = time.monotonic()
        for fetch in (pending, receiver.get(descs[2])):
            with pytest.raises(RelayError):
                await asyncio.wait_for(fetch, 30)
        assert time.monotonic() - t0 < 15, "a dead peer must not wait for the fetch timeout"
    finally:
        receiver.close()


async def test_stalled_sender_times_out_then_recovers(remote: OpenRemote) -> None:
    receiver = make(fetch_timeout_s=1.0)
    try:
        proc, info, descs = remote(receiver)
        receiver.set_peers([info])
        proc.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(RelayError, match="no answer"):
            await receiver.get(descs[1])
        assert time.monotonic() - t0 < 10
        proc.send_signal(signal.SIGCONT)
        received = await asyncio.wait_for(receiver.get(descs[2]), 30)  # a fresh endpoint
        assert len(received.buffer) == 3 << 20 and received.buffer[-1] == 7
        received.release()
    finally:
        receiver.close()


def test_created_outside_a_loop() -> None:
    sender, receiver = make(), make()
    infos = [sender.local_info(), receiver.local_info()]
    for relay in (sender, receiver):
        relay.set_peers(infos)

    async def transfer(relays: tuple[Relay, Relay]) -> int:
        handle = await relays[0].put(pack(pattern(MiB, 4)), "req", "edge")
        received = await relays[1].get(handle.descriptor)
        crc = zlib.crc32(received.buffer)
        received.release()
        return crc

    want = zlib.crc32(pattern(MiB, 4).tobytes())
    assert asyncio.run(transfer((sender, receiver))) == want
    assert asyncio.run(transfer((sender, receiver))) == want  # a second loop takes over
    sender.close()
    receiver.close()


def test_closed_relays_free_their_workers() -> None:
    """Closing frees every UCX resource (a posted stream or AM receive would pin them)."""

    async def cycle() -> None:
        sender, receiver = make(), make()
        infos = [sender.local_info(), receiver.local_info()]
        for relay in (sender, receiver):
            relay.set_peers(infos)
        handle = await sender.put(pack(pattern(100_000, 5)), "req", "edge")
        (await receiver.get(handle.descriptor)).release()
        sender.close()
        receiver.close()

    def fds() -> int:
        gc.collect()
        return len(os.listdir("/proc/self/fd"))

    asyncio.run(cycle())
    before = fds()
    for _ in range(5):
        asyncio.run(cycle())
    assert fds() <= before + 2, "file descriptors of closed relays stay open"


def test_options_and_info() -> None:
    with pytest.raises(RelayError, match="progress"):
        make(progress="sometimes")
    with pytest.raises(RelayError, match="option listen"):
        make(listen="192.0.2.254")  # no interface here has it
    relay = make(host="10.1.2.3", listen="127.0.0.1")
    try:
        info = msgpack.unpackb(relay.local_info())
        assert info["host"] == "10.1.2.3" and "port" not in info
        assert isinstance(info["address"], bytes) and info["address"]  # its worker address
        assert len(info["key"]) == 32  # the key's digest: the key itself is never published
        bad = [
            {"backend": "ucx", "id": "x-1", "host": 5, "address": b"a", "key": bytes(32)},
            {"backend": "ucx", "id": "x-2", "host": "h", "address": "no", "key": bytes(32)},
            {"backend": "ucx", "id": "x-3", "host": "h", "address": b"", "key": bytes(32)},
            {"backend": "ucx", "id": "x-4", "host": "h", "address": b"a", "key": b"short"},
        ]
        relay.set_peers([*map(msgpack.packb, bad), b"\xff", relay.local_info()])
        assert relay._peers == {}
    finally:
        relay.close()
    # Peers connect by worker address: there is no listener port to set.
    with pytest.raises(RelayError, match="port: unknown option"):
        make(port=7000)


# ----------------------------------------------------------------------------- trust


async def test_unregistered_or_impersonating_peer_is_refused_and_reads_nothing(
    pair: tuple[UcxRelay, UcxRelay],
) -> None:
    """A relay the sender was never announced (it knows the sender's worker address) proves
    no registered id: the sender refuses its HELLO and answers nothing (it has no address of
    the stranger's to answer to), so its fetch fails and nothing is sent. So does one
    announcing a registered peer's id with a key of its own: answers would go to that
    peer's announced address anyway."""
    sender, receiver = pair
    stranger = make(peer_wait_s=0.5, fetch_timeout_s=1.5)
    try:
        stranger.set_peers([sender.local_info()])
        handle = await sender.put(pack(pattern(70_000, 7)), "req", "edge")
        for refused, claimed in enumerate((stranger.peer_id, receiver.peer_id), 1):
            stranger.peer_id = claimed
            started = time.monotonic()
            with pytest.raises(RelayError, match="no answer"):
                await asyncio.wait_for(stranger.get(handle.descriptor), 30)
            assert time.monotonic() - started < 10
            assert sender._refused == refused, "its HELLO was refused"
            assert sender.bytes_out == 0 and stranger.bytes_in == 0
            assert not sender._ctls, "none of its requests is taken up"
        received = await receiver.get(handle.descriptor)  # the registered peer is served
        assert sender.bytes_out == handle.nbytes
        received.release()
    finally:
        stranger.close()


async def test_a_hello_before_its_announcement_is_taken_up_when_it_comes() -> None:
    """A receiver announced to the sender after its first fetch: its HELLO waits (for the
    sender's `peer_wait_s`) and is taken up once the announcement proves it."""
    sender, receiver = make(peer_wait_s=10), make(peer_wait_s=0.5)
    try:
        sender.set_peers([sender.local_info()])  # the receiver: not yet
        receiver.set_peers([sender.local_info(), receiver.local_info()])
        value = pattern(70_000, 13)
        handle = await sender.put(pack(value), "req", "edge")
        fetch = asyncio.create_task(receiver.get(handle.descriptor))
        deadline = time.monotonic() + 10
        while receiver.peer_id not in sender._early and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert receiver.peer_id in sender._early and not sender._ctls, "kept, not taken up"
        assert sender.bytes_out == 0
        sender.set_peers([sender.local_info(), receiver.local_info()])
        received = await asyncio.wait_for(fetch, 30)
        assert zlib.crc32(received.buffer) == zlib.crc32(value.tobytes())
        received.release()
    finally:
        sender.close()
        receiver.close()


async def test_a_transfer_is_served_to_one_peer(pair: tuple[UcxRelay, UcxRelay]) -> None:
    sender, receiver = pair
    other = make(peer_wait_s=0.5)
    try:
        infos = [sender.local_info(), receiver.local_info(), other.local_info()]
        for relay in (sender, receiver, other):
            relay.set_peers(infos)
        handle = await sender.put(pack(pattern(70_000, 8)), "req", "edge")
        held = await receiver.get(handle.descriptor)
        with pytest.raises(RelayError, match="not live"):
            await asyncio.wait_for(other.get(handle.descriptor), 30)
        assert sender.bytes_out == handle.nbytes and other.bytes_in == 0
        assert sender.outstanding("edge") == (1, handle.nbytes), "still the first peer's"
        held.release()
        mine = await sender.put(pack(pattern(1000, 9)), "req", "edge2")
        (await other.get(mine.descriptor)).release()  # the link itself is fine
    finally:
        other.close()


def _socket_inodes() -> set[int]:
    """Inodes of this process's sockets."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(int(link[8:-1]))
    return inodes


def _inet_sockets(
    inodes: set[int],
) -> list[tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """(protocol, local address, port) of the listening TCP and the bound UDP sockets among
    `inodes`, from /proc/net."""
    found = []
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        try:
            lines = Path(f"/proc/net/{proto}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            if inode not in inodes or (proto.startswith("tcp") and state != "0A"):  # LISTEN
                continue
            hexip, hexport = local.split(":")
            raw = bytes.fromhex(hexip)
            # /proc writes each 32-bit word of the address in host (little-endian) order.
            ip = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.append((proto, ipaddress.ip_address(ip), int(hexport, 16)))
    return found


def test_no_socket_listens_on_every_interface() -> None:
    """Peers connect by worker address, so there is no connection listener; the only
    sockets the relays open listen on the interface of `listen` (default: `host`, here
    127.0.0.1), none on 0.0.0.0 or ::, while they transfer too."""
    if not Path("/proc/net/tcp").exists():
        pytest.skip("no /proc/net")
    gc.collect()  # sockets of relays closed by earlier tests go with their last reference
    before = _socket_inodes()
    sender, receiver = make(), make()
    try:
        infos = [sender.local_info(), receiver.local_info()]
        for relay in (sender, receiver):
            relay.set_peers(infos)

        async def transfer() -> None:
            handle = await sender.put(pack(pattern(MiB, 12)), "req", "edge")
            (await receiver.get(handle.descriptor)).release()

        asyncio.run(transfer())
        opened = _inet_sockets(_socket_inodes() - before)
        assert opened, "UCX's TCP transport listens on the mesh interface"
        wildcard = [s for s in opened if s[1].is_unspecified]
        assert not wildcard, f"listening on every interface: {wildcard}"
        beyond = [s for s in opened if not s[1].is_loopback]
        assert not beyond, f"listening beyond the mesh interface (loopback): {beyond}"
    finally:
        sender.close()
        receiver.close()


async def test_a_peer_no_longer_announced_is_served_no_more(
    pair: tuple[UcxRelay, UcxRelay],
) -> None:
    sender, receiver = pair
    receiver._fetch_timeout_s = 2.0  # a sender that no longer knows it answers nothing
    handle = await sender.put(pack(pattern(5000, 10)), "req", "edge")
    (await receiver.get(handle.descriptor)).release()  # an open, proven endpoint
    assert sender._ctls, "its requests are taken up"
    sender.set_peers([sender.local_info()])  # the receiver left the topology
    assert not sender._ctls, "and are served no more"
    handle = await sender.put(pack(pattern(5000, 11)), "req", "edge2")
    sent = sender.bytes_out
    with pytest.raises(RelayError):
        await asyncio.wait_for(receiver.get(handle.descriptor), 30)
    assert sender.bytes_out == sent
