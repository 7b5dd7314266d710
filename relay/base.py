"""Relay interface and backend registry.

A relay moves one packed tensor buffer per payload between processes. The sender
`put`s (copying into its pool, waiting for edge credits), sends the handle's descriptor
in a control message, and releases the handle when the receiver acks. The receiver
`get`s a read-only view and releases it when done. All methods are called from the
owning process's event loop thread.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omnirail.v1 import common_pb2
from omnirail.wire.payload import Packed


class RelayError(RuntimeError):
    """A transfer cannot be done: bad descriptor, peer gone, closed relay."""


@dataclass(frozen=True)
class RelaySettings:
    """Backend knobs (built from `RelayConfig`)."""

    # Bytes of the first pool segment; more segments are added when a payload does not fit.
    pool_bytes: int = 256 << 20
    # Credits per edge: outstanding (unacked) transfers and bytes. A full edge blocks `put`;
    # a single payload larger than `credit_bytes` is still sent once the edge is empty.
    credit_slots: int = 64
    credit_bytes: int = 1 << 30
    # Prefix of every OS-visible name (shm segments) so a launcher can sweep leftovers.
    name_prefix: str = "omnirail"
    options: dict[str, Any] = field(default_factory=dict)


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
    async def get(self, descriptor: common_pb2.RelayDescriptor) -> Received:
        """Maps the bytes a descriptor names; raises RelayError for a bad descriptor."""

    @abc.abstractmethod
    def cleanup(self, request_id: str) -> None:
        """Releases every unacked handle of `request_id` (abort path)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Frees the pool and every OS resource; idempotent."""

    # ---- peers: for backends whose receivers reach the sender by themselves ----------
    # The mesh publishes each process's `local_info()` through the coordinator (Attach,
    # then the topology it broadcasts) and hands every process the infos of all live
    # processes with `set_peers`. Backends that need no exchange (shm, inline) keep these.

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


RelayFactory = Callable[[RelaySettings], Relay]
_REGISTRY: dict[str, RelayFactory] = {}


def register_relay(name: str, factory: RelayFactory) -> None:
    _REGISTRY[name] = factory


def relay_backends() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def create_relay(name: str, settings: RelaySettings | None = None) -> Relay:
    _load_builtin()
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise RelayError(
            f"unknown relay backend {name!r}; known: {', '.join(sorted(_REGISTRY))}"
        ) from None
    return factory(settings or RelaySettings())


def _load_builtin() -> None:
    # Importing registers them; kept lazy so `omnirail.relay.base` stays cheap to import.
    from omnirail.relay import inline, shm  # noqa: F401

    # Optional backends register lazily: importing them must not need their libraries.
    for name, module in _OPTIONAL.items():
        if name not in _REGISTRY:
            _REGISTRY[name] = _lazy(module)


_OPTIONAL = {
    "nixl": "omnirail.relay.nixl",
    "ucx": "omnirail.relay.ucx",
    "torchdist": "omnirail.relay.torchdist",
}


def _lazy(module: str) -> RelayFactory:
    def factory(settings: RelaySettings) -> Relay:
        import importlib

        importlib.import_module(module)  # registers the real factory, replacing this one
        real = _REGISTRY[next(k for k, v in _OPTIONAL.items() if v == module)]
        if real is factory:
            raise RelayError(f"{module} did not register its relay backend")
        return real(settings)

    return factory
