"""Fixtures of the relay conformance suite: backend, name prefix, relays, peers, device."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest

from omnirail.relay.base import Relay, RelayError, RelaySettings, create_relay
from tests.relay_conformance.backends import BACKENDS, BackendSpec
from tests.relay_conformance.harness import TIMEOUT, Peer

MiB = 1 << 20
# Small first pool segment so growth and reuse happen within a test's few transfers.
POOL_BYTES = 4 * MiB

MakeRelay = Callable[..., Relay]
OpenPeer = Callable[..., Awaitable[Peer]]


@pytest.fixture
def prefix() -> str:
    """A name prefix of this test alone, so sweeping it cannot touch anyone else's."""
    return f"conf_{uuid.uuid4().hex[:12]}"


@pytest.fixture(params=[pytest.param(spec, id=spec.name) for spec in BACKENDS])
def backend(request: pytest.FixtureRequest, prefix: str) -> BackendSpec:
    spec: BackendSpec = request.param
    try:
        create_relay(spec.name, settings_for(spec, prefix)).close()
    except (ImportError, RelayError) as e:
        # A backend whose library is not installed here (nixl, ucx, ...) is not a failure.
        pytest.skip(f"relay backend {spec.name!r} is unavailable here: {e}")
    return spec


def settings_for(backend: BackendSpec, prefix: str, **kw: Any) -> RelaySettings:
    kw.setdefault("pool_bytes", POOL_BYTES)
    kw = {**backend.settings, **kw}
    return RelaySettings(name_prefix=prefix, options=dict(backend.options), **kw)


def next_settings(backend: BackendSpec, prefix: str, made: list[Relay], **kw: Any) -> RelaySettings:
    settings = settings_for(backend, prefix, **kw)
    if made and backend.pair_settings is not None:
        settings = backend.pair_settings(made[0], settings, len(made))
    return settings


@pytest.fixture
def make_relay(backend: BackendSpec, prefix: str) -> Iterator[MakeRelay]:
    """Creates relays of the backend under test; closes them and checks nothing is left."""
    relays: list[Relay] = []

    def make(**kw: Any) -> Relay:
        relay = create_relay(backend.name, next_settings(backend, prefix, relays, **kw))
        relays.append(relay)
        # Every relay of this process knows the others, as the mesh's topology does.
        infos = [r.local_info() for r in relays]
        for r in relays:
            r.set_peers(infos)
        return relay

    yield make
    for relay in relays:
        relay.close()
    left = backend.leftovers(prefix)
    backend.sweep(prefix)
    assert not left, f"left behind after close: {left}"


@pytest.fixture
async def open_peer(
    backend: BackendSpec, prefix: str, make_relay: MakeRelay
) -> AsyncIterator[OpenPeer]:
    """`await open_peer(**settings)`: a sender relay with `settings` and a receiver process
    running the same backend with the same settings."""
    peers: list[Peer] = []

    async def open_(**kw: Any) -> Peer:
        relay = make_relay(**kw)
        settings = settings_for(backend, prefix, **kw)
        if backend.pair_settings is not None:
            settings = backend.pair_settings(relay, settings, 1)
        peer = await Peer.start(backend, relay, settings)
        peers.append(peer)
        relay.set_peers([relay.local_info(), peer.info])
        await asyncio.gather(peer.introduce([relay.local_info()]), relay.connect(TIMEOUT))
        return peer

    yield open_
    errors = []
    for peer in peers:
        try:
            await peer.aclose()
        except AssertionError as e:
            errors.append(str(e))
    assert not errors, errors


@pytest.fixture
async def peer(open_peer: OpenPeer) -> Peer:
    return await open_peer()


@pytest.fixture(params=["cpu", "cuda"])
def device(request: pytest.FixtureRequest, backend: BackendSpec) -> str:
    """Where test tensors live: on the CPU, or on the GPU (a CUDA host only)."""
    if request.param == "cuda":
        import torch

        if not torch.cuda.is_available():
            pytest.skip("CUDA is not available: GPU-memory transfers need a CUDA device")
        if not backend.gpu:
            pytest.skip(f"relay backend {backend.name!r} does not carry GPU tensors")
    return request.param
