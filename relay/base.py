"""Relay interface and backend registry.

A relay moves one packed tensor buffer per payload between processes. The sender
`put`s (copying into its pool, waiting for edge credits), sends the handle's descriptor
in a control message, and releases the handle when the receiver acks. The receiver
`get`s a read-only view and releases it when done. All methods are called from the
owning process's event loop thread.

Backends are listed in `omnirail.relay.registry` (name, options model, module), imported
only when a relay of theirs is made; each reads its typed options (`omnirail.relay.options`).

Descriptors are bound to their sender: a receiver that got a descriptor on a Deliver stream
passes `get` the relay peer ids the stream's authenticated sender announced (`owners`: the
"id" of each of its `local_info()` maps, see omnirail/transport/members.py), and the
backend refuses a descriptor whose region, pool or transfer is not one of theirs before
it maps or fetches anything (`check_owner`). How a backend names its owner, and how a
forwarded descriptor (one naming the original sender's bytes, handed on by a stage that
received them) is accepted, is the backend's to say (shm: omnirail/relay/shm.py).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from google.protobuf.unknown_fields import UnknownFieldSet

from omnirail.relay import registry
from omnirail.relay.options import OptionsError, RelayOptions, parse_options
from omnirail.v1 import common_pb2
from omnirail.wire.payload import Packed


class RelayError(RuntimeError):
    """A transfer cannot be done: bad descriptor, peer gone, closed relay."""


def shown(value: str, limit: int = 80) -> str:
    """`value` for an error message: repr'd and cut, since it may come from a peer (a
    100 kB region name must not become a 100 kB log line)."""
    return repr(value[:limit]) + ("..." if len(value) > limit else "")


def check_descriptor(descriptor: object, backend: str) -> common_pb2.RelayDescriptor:
    """`descriptor` if it is a descriptor for `backend` that carries nothing this version
    does not read; RelayError otherwise. Every receiver calls it first, before any field
    reaches a syscall or a lookup.

    Refused besides the wrong type and backend: `extra` bytes and fields unknown to this
    version's proto. No backend reads either, so a sender that set them expects something
    this receiver would silently not do (fail closed rather than guess).
    """
    if type(descriptor) is not common_pb2.RelayDescriptor:
        raise RelayError(
            f"{backend} relay: expected a RelayDescriptor, got {type(descriptor).__name__}"
        )
    if descriptor.backend != backend:
        raise RelayError(f"{backend} relay got a descriptor of backend {shown(descriptor.backend)}")
    if descriptor.extra:
        raise RelayError(f"{backend} relay: descriptor carries extra bytes it does not read")
    # Unknown field numbers survive parsing (proto3 keeps them); ~0.1 us to look.
    if len(UnknownFieldSet(descriptor)):
        raise RelayError(f"{backend} relay: descriptor has fields this version does not know")
    return descriptor


def check_owner(owners: frozenset[str] | None, owner: str, backend: str, what: str) -> None:
    """RelayError unless `owner` (the relay peer id a descriptor names as the holder of
    its bytes) is among `owners` (None: no binding). `what` names the field it came from."""
    if owners is not None and owner not in owners:
        raise RelayError(
            f"{backend} relay: descriptor {what} names {shown(owner)}, which the sender of "
            "this stream did not announce"
        )


OptionsT = TypeVar("OptionsT", bound=RelayOptions)


@dataclass(frozen=True)
class RelaySettings:
    """What one relay object is opened with (built from `RelayConfig.to_settings`).

    Everything here is per relay object, i.e. per process and backend, except the credits:
    they are the default bound of an edge that `Relay.set_edge_credits` did not set.
    """

    # Bytes of the first pool segment; more segments are added when a payload does not fit.
    pool_bytes: int = 256 << 20
    # Credits per edge: outstanding (unacked) transfers and bytes. A full edge blocks `put`;
    # a single payload larger than `credit_bytes` is still sent once the edge is empty.
    credit_slots: int = 64
    credit_bytes: int = 1 << 30
    # Prefix of every OS-visible name (shm segments) so a launcher can sweep leftovers.
    name_prefix: str = "omnirail"
    # Device of the stage's tensors ("cpu", "cuda:0").
    device: str = "cpu"
    # torchdist: this process's rank and the group's size.
    rank: int | None = None
    world_size: int | None = None
    # The backend's typed options; a mapping is parsed by `create_relay` (or `options_as`).
    options: RelayOptions | Mapping[str, Any] = field(default_factory=dict)

    def options_as(self, backend: str, model: type[OptionsT]) -> OptionsT:
        """The options as `model` (parsed when given as a mapping); RelayError when the
        backend refuses them."""
        if isinstance(self.options, model):
            return self.options
        try:
            return parse_options(backend, model, self.options)  # type: ignore[return-value]
        except OptionsError as e:
            raise RelayError(str(e)) from None

    def options_dict(self) -> dict[str, Any]:
        """The options as set (plain values, no defaults filled in)."""
        if isinstance(self.options, RelayOptions):
            return self.options.model_dump(mode="json", exclude_unset=True)
        return dict(self.options)

    def as_dict(self) -> dict[str, Any]:
        """JSON-able fields (`RelaySettings(**as_dict())` makes these settings again)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**fields, "options": self.options_dict()}


class Releasable(Protocol):
    """What the sender keeps with an item it delivered, released as the item is done
    with: a relay transfer (`RelayHandle`) or a stream chunk's credit (which holds its
    transfer). `acked_in_band`: the receiver's ack on the Deliver stream releases it
    (inline items carry none; pulled relays' acks); False where the backend learns of
    the receiver's release by itself (shm's release marks)."""

    acked_in_band: bool

    def release(self) -> None: ...


class RelayHandle(abc.ABC):
    """Sender side of one transfer. `release()` frees its pool extent and edge credit."""

    descriptor: common_pb2.RelayDescriptor
    request_id: str
    # True: the sender releases it when the receiver's ack arrives on the Deliver stream.
    # False: the backend learns of the receiver's release by itself (shm release marks).
    acked_in_band: bool = True

    @abc.abstractmethod
    def release(self) -> None: ...


class Received(abc.ABC):
    """Receiver side: `buffer` is a read-only view valid until `release()`."""

    buffer: memoryview

    @abc.abstractmethod
    def release(self) -> None: ...


class Relay(abc.ABC):
    name: str
    # Whether receivers must ack each transfer over the Deliver stream (see RelayHandle).
    acks_in_band: bool = True

    @abc.abstractmethod
    async def put(self, packed: Packed, request_id: str, edge: str) -> RelayHandle:
        """Copies `packed` into the pool once `edge` has credit; never rejects for size."""

    def put_nowait(self, packed: Packed, request_id: str, edge: str) -> RelayHandle | None:
        """`put` when it can finish without waiting (credit free, no async copy); else None.

        Lets callers skip a task switch on the common path; backends may leave it None.
        """
        return None

    def forward_nowait(self, packed: Packed, request_id: str, edge: str) -> RelayHandle | None:
        """Sends bytes this relay received on to the next receiver without copying them,
        when `packed` consists of them; None when it cannot (the caller then puts).

        Only for a payload that goes to a single receiver and whose tensors the caller
        never reads again: the next receiver may hand the bytes back to their original
        sender at any time. Edge credit is not taken: the original transfer's still is.
        """
        return None

    @abc.abstractmethod
    async def get(
        self, descriptor: common_pb2.RelayDescriptor, owners: frozenset[str] | None = None
    ) -> Received:
        """Maps the bytes a descriptor names; raises RelayError for a bad descriptor.

        The descriptor comes from a peer: whatever it holds, only RelayError may come out,
        and a refused one leaves nothing mapped, open or allocated.

        `owners`: the relay peer ids (`local_info()` "id"s) that the authenticated sender
        of the Deliver stream carrying the descriptor announced. A descriptor whose
        region/owner is not among them is refused with RelayError before anything is
        mapped or fetched (backends that forward say what else they accept). None: no
        binding (in-process callers, benches). The coordinator announces none: an empty
        set refuses every descriptor (clients send tensors inline)."""

    @abc.abstractmethod
    def cleanup(self, request_id: str) -> None:
        """Releases every unacked handle of `request_id` (abort path)."""

    def held(self) -> int:
        """Payloads this side holds for receivers (put, not yet released): 0 once every
        request through it ended. Backends that track none report 0."""
        return 0

    @abc.abstractmethod
    def close(self) -> None:
        """Frees the pool and every OS resource; idempotent."""

    def set_edge_credits(self, edge: str, slots: int, nbytes: int) -> None:
        """Bounds edge `edge` to `slots` unacked transfers and `nbytes` bytes (instead of
        the settings' defaults); called for every edge before its first put. Backends
        without edge credit ignore it."""
        return None

    # ---- peers: for backends whose receivers reach the sender by themselves ----------
    # The mesh publishes each process's `local_info()` through the coordinator (Attach,
    # then the topology it broadcasts) and hands every process the infos of all live
    # processes with `set_peers`. shm announces its name prefix (receivers map only the
    # segments of prefixes announced, and their own); inline keeps these.

    def local_info(self) -> bytes:
        """What peers need to reach this relay (msgpack, never pickle); b"": nothing."""
        return b""

    def set_peers(self, infos: list[bytes]) -> None:
        """The `local_info()` of every live peer (all of them, each time); unknown or
        malformed infos of other backends' shapes are ignored, never unpickled."""
        return None

    async def connect(self, timeout: float) -> None:
        """Returns once the backend can transfer (library up, rendezvous done); raises
        RelayError naming what is missing after `timeout` seconds."""
        return None

    def trust_peers(self, peer_ids: Iterable[str] | None) -> None:
        """Restricts the peers this receiver fetches from to `peer_ids` (the ids in their
        `local_info()`); None: every peer `set_peers` announces (the default). Peer infos
        of other ids are ignored, and descriptors naming them are refused at once.

        For whoever vouches for peers (the coordinator's registry). Backends whose
        receivers reach no peer by themselves (shm: the name prefix bounds what it maps;
        inline) ignore it."""
        return None


def relay_backends() -> list[str]:
    return sorted(registry.BACKENDS)


def create_relay(name: str, settings: RelaySettings | None = None) -> Relay:
    """A relay of backend `name`; its module is imported now, its options parsed first
    (RelayError names every option it refuses)."""
    entry = registry.backend(name)
    if entry is None:
        raise RelayError(f"unknown relay backend {name!r}; known: {', '.join(relay_backends())}")
    settings = settings or RelaySettings()
    options = settings.options_as(name, entry.options)
    if options is not settings.options:
        settings = dataclasses.replace(settings, options=options)
    return entry.load()(settings)
