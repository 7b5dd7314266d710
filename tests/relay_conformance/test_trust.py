"""Conformance: descriptors bound to their sender, unguessable and live transfer ids (issue 37).

A receiver takes a descriptor only from the peer whose relay it names (`get(d, owners)`,
owners = the ids of the stream's authenticated sender), and a sender serves only a live
transfer id, drawn at random: a descriptor from someone else's stream, a guessed id or a
released one fails with RelayError and moves no payload byte. "Moves" is what the relays
count: the receiver's `bytes_in` (fetched) and the sender's `bytes_out` (handed to a peer),
where the backend counts them (the pulled ones do).

Backends with `trust_pending` set run these as non-strict xfails until their work lands.
"""

from __future__ import annotations

import secrets

import pytest

from omnirail.relay.base import Relay
from omnirail.wire.payload import pack
from tests.relay_conformance.backends import BackendSpec, with_fields
from tests.relay_conformance.conftest import OpenPeer
from tests.relay_conformance.harness import Peer, Reply, pattern, settled_outstanding


@pytest.fixture
def trusted(backend: BackendSpec, request: pytest.FixtureRequest) -> BackendSpec:
    if backend.trust_pending:
        request.applymarker(pytest.mark.xfail(reason=backend.trust_pending, strict=False))
    return backend


@pytest.fixture
async def bound_peer(trusted: BackendSpec, open_peer: OpenPeer) -> Peer:
    peer = await open_peer()
    assert peer.bound, f"{trusted.name}: the receiver's get takes no owners"
    return peer


def bytes_out(relay: Relay) -> int | None:
    return getattr(relay, "bytes_out", None)


class Moved:
    """Payload bytes both sides moved so far; `still(reply)` asserts none moved since."""

    def __init__(self, peer: Peer, bytes_in: int | None) -> None:
        self.peer = peer
        self.bytes_in = bytes_in
        self.bytes_out = bytes_out(peer.relay)

    def still(self, reply: Reply) -> None:
        assert reply.bytes_in == self.bytes_in, "the refused get fetched payload bytes"
        assert bytes_out(self.peer.relay) == self.bytes_out, "the sender served payload bytes"


def refused(reply: Reply) -> None:
    assert not reply.ok, "taken"
    assert reply.relay_error, f"not a RelayError: {reply.error}: {reply.message}"


async def test_descriptor_from_another_senders_stream_is_refused(bound_peer: Peer) -> None:
    peer = bound_peer
    moved = Moved(peer, (await peer.send(pattern(1000, 1))).bytes_in)
    handle = await peer.relay.put(pack(pattern(70_000, 2)), "req", "edge")
    for owners in (["someone-else"], [], [handle.descriptor.region + "x"]):
        reply = await peer.probe(handle.descriptor, owners=owners)
        refused(reply)
        moved.still(reply)
    # The same descriptor on its own sender's stream is taken.
    assert (await peer.probe(handle.descriptor, as_sender=True)).ok


async def test_guessed_transfer_id_is_refused_and_reads_nothing(bound_peer: Peer) -> None:
    peer = bound_peer
    handle = await peer.relay.put(pack(pattern(70_000, 3)), "req", "edge")
    good = handle.descriptor
    assert good.transfer_id >= 1 << 32, "transfer ids are not random (or drew a tiny one)"

    def guesses() -> list[int]:
        near = [good.transfer_id + 1, good.transfer_id - 1, good.transfer_id ^ (1 << 40)]
        return [*near, secrets.randbits(63) | 1]

    # Before the receiver fetched anything from this sender (nixl: asks for the segment)...
    moved = Moved(peer, 0 if bytes_out(peer.relay) is not None else None)
    for tid in guesses():
        reply = await peer.probe(with_fields(good, transfer_id=tid), as_sender=True)
        refused(reply)
        moved.still(reply)
    # ...and after (nixl: knows the segment, checks the ticket).
    moved = Moved(peer, (await peer.send(pattern(1000, 4))).bytes_in)
    for tid in guesses():
        reply = await peer.probe(with_fields(good, transfer_id=tid), as_sender=True)
        refused(reply)
        moved.still(reply)
    assert (await peer.probe(good, as_sender=True)).ok  # the real one is still served


async def test_stale_transfer_id_is_refused_and_reads_nothing(bound_peer: Peer) -> None:
    peer = bound_peer
    # Fetched and released by the receiver: once the sender took the release in, it is gone.
    transfer = await peer.put(pattern(70_000, 5))
    moved = Moved(peer, (await transfer.result()).bytes_in)
    assert await settled_outstanding(peer.relay, "edge", (0, 0)) == (0, 0)
    reply = await peer.probe(transfer.handle.descriptor, as_sender=True)
    refused(reply)
    moved.still(reply)
    # Put, never fetched, released by the sender's cleanup (an aborted request).
    handle = await peer.relay.put(pack(pattern(70_000, 6)), "aborted", "edge")
    peer.relay.cleanup("aborted")
    reply = await peer.probe(handle.descriptor, as_sender=True)
    refused(reply)
    moved.still(reply)
    await peer.send(pattern(70_000, 7))  # the link still works
