"""torchdist relay: options, rendezvous timeouts, and waits that a silent or dead peer
must not hang (the conformance suite covers transfers, credits and garbage)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import msgpack
import pytest

from omnirail.relay.base import RelayError, RelaySettings, create_relay
from omnirail.v1 import common_pb2

dist = pytest.importorskip("torch.distributed")
torchdist = pytest.importorskip("omnirail.relay.torchdist")


def settings(rank: Any = 0, world_size: Any = 2, **options: Any) -> RelaySettings:
    base = {"init_method": "tcp://127.0.0.1:0", "timeout_s": 20.0}
    return RelaySettings(
        pool_bytes=1 << 20, rank=rank, world_size=world_size, options={**base, **options}
    )


@pytest.mark.parametrize(
    "options",
    [
        {"rank": None},
        {"rank": 2},
        {"world_size": "two"},
        {"init_method": "127.0.0.1:1234"},
        {"init_method": "env://"},
        {"init_method": "tcp://127.0.0.1"},
    ],
)
def test_bad_options_raise_relay_error(options: dict[str, Any]) -> None:
    with pytest.raises(RelayError):
        create_relay("torchdist", settings(**options))


async def test_connect_times_out_naming_the_group_and_close_is_prompt() -> None:
    relay = create_relay("torchdist", settings())  # rank 1 never comes
    init = relay.init_method  # type: ignore[attr-defined]
    assert not init.endswith(":0")
    with pytest.raises(RelayError, match=r"rank 0/2") as err:
        await relay.connect(0.3)
    assert init in str(err.value)
    started = time.monotonic()
    relay.close()
    relay.close()
    assert time.monotonic() - started < 1.0


def test_pair_settings_join_the_first_relays_group() -> None:
    first = create_relay("torchdist", settings(peer_wait_s=0.5))
    try:
        paired = torchdist.pair_settings(first, settings(peer_wait_s=0.5), 1)
        assert paired.rank == 1
        assert paired.world_size == 2
        assert paired.options.init_method == first.init_method  # type: ignore[attr-defined,union-attr]
        assert paired.options.peer_wait_s == 0.5  # type: ignore[union-attr]
    finally:
        first.close()


class FakeRank0:
    """Rank 0 of a group as a bare gloo process group that never answers a fetch."""

    def __init__(self) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
        self.pg: Any = None
        self._thread = threading.Thread(target=self._join, daemon=True)
        self._thread.start()

    def _join(self) -> None:
        prefixed = dist.PrefixStore(torchdist._STORE_PREFIX, self.store)
        prefixed.add("joined", 1)  # the relay's check-in before gloo connects
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timedelta(seconds=20)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        self.pg = dist.ProcessGroupGloo(prefixed, 0, 2, opts)

    def wait(self) -> None:
        self._thread.join(20)
        assert self.pg is not None

    def die(self) -> None:
        """Closes its sockets, as a killed process's kernel would."""
        torchdist._break(self.pg, 0, 2)


@pytest.fixture
def fake() -> Iterator[FakeRank0]:
    yield FakeRank0()


async def receiver(fake: FakeRank0, **options: Any) -> Any:
    init = f"tcp://127.0.0.1:{fake.store.port}"
    relay = create_relay("torchdist", settings(rank=1, init_method=init, **options))
    await relay.connect(20)
    fake.wait()
    info = {"backend": "torchdist", "id": "fake-rank0", "rank": 0, "world": 2}
    relay.set_peers([msgpack.packb(info), relay.local_info()])
    return relay


def descriptor() -> common_pb2.RelayDescriptor:
    return common_pb2.RelayDescriptor(
        backend="torchdist", region="fake-rank0", offset=0, nbytes=1000, transfer_id=1
    )


async def test_fetch_from_a_silent_peer_ends_at_fetch_timeout(fake: FakeRank0) -> None:
    relay = await receiver(fake, fetch_timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(RelayError, match="transfer 1"):
        await asyncio.wait_for(relay.get(descriptor()), 10)
    assert time.monotonic() - started < 5
    relay.close()


async def test_close_ends_a_pending_fetch_at_once(fake: FakeRank0) -> None:
    relay = await receiver(fake)  # fetch_timeout_s: the default 30 s
    pending = asyncio.create_task(relay.get(descriptor()))
    await asyncio.sleep(0.2)
    assert not pending.done()
    started = time.monotonic()
    relay.close()
    with pytest.raises(RelayError):
        await asyncio.wait_for(pending, 5)
    assert time.monotonic() - started < 2


async def test_a_peer_dying_mid_fetch_fails_it_fast(fake: FakeRank0) -> None:
    relay = await receiver(fake)
    pending = asyncio.create_task(relay.get(descriptor()))
    await asyncio.sleep(0.2)
    started = time.monotonic()
    fake.die()
    with pytest.raises(RelayError, match="rank 0"):
        await asyncio.wait_for(pending, 5)
    assert time.monotonic() - started < 2
    # The group is broken now: later fetches fail at once, close stays prompt.
    with pytest.raises(RelayError):
        await asyncio.wait_for(relay.get(descriptor()), 5)
    relay.close()


async def test_a_rank_may_start_before_rank_0_hosts_the_store() -> None:
    with socket.socket() as probe:  # a free port for rank 0 to host the store on later
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    init = f"tcp://127.0.0.1:{port}"
    early = create_relay("torchdist", settings(rank=1, init_method=init))
    try:
        joining = asyncio.create_task(early.connect(20))
        await asyncio.sleep(0.5)
        assert not joining.done()
        late = create_relay("torchdist", settings(init_method=init))
        try:
            await asyncio.wait_for(asyncio.gather(joining, late.connect(20)), 30)
        finally:
            late.close()
    finally:
        early.close()


async def test_a_transfer_is_served_to_one_rank() -> None:
    """The first rank that fetches a transfer has it: another rank asking for it gets no
    bytes (a typed error), and cannot release it either."""
    import numpy as np

    from omnirail.wire.payload import pack

    first: Any = create_relay("torchdist", settings(0, 3))
    init = first.init_method
    relays: list[Any] = [first]
    relays += [create_relay("torchdist", settings(r, 3, init_method=init)) for r in (1, 2)]
    try:
        infos = [r.local_info() for r in relays]
        for relay in relays:
            relay.set_peers(infos)
        await asyncio.gather(*(relay.connect(30) for relay in relays))
        handle = await first.put(pack(np.full(70_000, 3, np.uint8)), "req", "edge")
        held = await relays[1].get(handle.descriptor)
        sent = first.bytes_out
        with pytest.raises(RelayError, match="no such live transfer"):
            await asyncio.wait_for(relays[2].get(handle.descriptor), 30)
        assert first.bytes_out == sent and relays[2].bytes_in == 0
        assert first.outstanding("edge") == (1, handle.nbytes)
        held.release()
        deadline = time.monotonic() + 20
        while first.outstanding("edge") != (0, 0) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert first.outstanding("edge") == (0, 0)
    finally:
        for relay in relays:
            relay.close()
