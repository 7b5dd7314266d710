"""Shared core of relays whose receiver fetches the bytes itself (nixl, ucx, torchdist).

Sender: `put` takes edge credit, copies the payload once into a private `HostPool` extent
and returns a handle whose descriptor names this relay (`region` = its peer id) and the
extent. The backend releases the handle when the receiver has released its view (`served`:
a release message over nixl notifications, UCX or gloo), so, as with shm, an edge's credit
stays taken while the receiver holds the bytes; `cleanup` releases what an abort left.
An extent that is being sent when it is released is freed only once that send ends.

Receiver: `get` checks the descriptor, finds the sender among the peers the mesh announced
(`set_peers`, waiting briefly for a peer announced late), allocates an extent of its own
receive pool, has the backend `_fetch` into it, and returns a read-only view that frees the
extent on release.

Peer infos are msgpack maps {"backend", "id", ...backend fields}; anything else is ignored.

Trust: a descriptor names its sender only by peer id (`region`), a key into the peers the
mesh announced; how to reach that peer (nixl agent metadata, UCX host and port, a gloo
rank) comes from its announced info, never from the descriptor. `trust_peers` narrows
the announced peers to those someone vouched for. `get(descriptor, owners)` refuses a
descriptor whose region is not one of `owners` (the peer ids of the authenticated sender
of the stream that carried it) before it waits, allocates or fetches anything.

Transfer ids are random (63 bits from `secrets`, drawn in batches), so a receiver cannot
name a transfer it was not given. The sender hands out bytes (`source`) only for a live
transfer id with the exact extent, and binds each transfer to the first peer it serves
(`source(..., peer)`): another peer asking for it later gets nothing, and only that
peer's release (`served(tid, peer)`) frees it. How far a backend can tell peers apart
(UCX: the key its HELLO proves; gloo: the rank of the pair; nixl: see its docstring)
decides how much this binding holds.
"""

from __future__ import annotations

import abc
import asyncio
import os
import re
import secrets
import socket
import struct
import uuid
from collections.abc import Iterable
from typing import Any

import msgpack

from omnirail.relay.base import (
    Relay,
    RelayError,
    RelaySettings,
    check_descriptor,
    check_owner,
    shown,
)
from omnirail.relay.copy import Copier
from omnirail.relay.credits import Credits, EdgeCredit
from omnirail.relay.host_pool import HostExtent, HostPool, HostSegment
from omnirail.relay.options import PulledOptions
from omnirail.relay.pull_handles import EMPTY_VIEW, PulledHandle, PulledReceived
from omnirail.tuning.aio import Changes
from omnirail.v1 import common_pb2
from omnirail.wire.payload import Packed

# Descriptor offsets are (segment index << OFFSET_BITS) | offset within the segment.
OFFSET_BITS = 40
OFFSET_MASK = (1 << OFFSET_BITS) - 1
MAX_SEGMENTS = 1 << 16
# Always fullmatch: `$` would also match before a trailing newline.
PEER_ID_RE = re.compile(r"[A-Za-z0-9_.-]{1,200}")
_POLL_MIN_S = 50e-6
_POLL_MAX_S = 2e-3
# Random transfer ids are drawn this many at a time (one getrandom call, not one per put).
_RANDOM_IDS = struct.Struct("<256Q")


def make_peer_id(prefix: str) -> str:
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())[:60]
    return f"{prefix}-{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class PullRelay(Relay):
    name = ""
    acks_in_band = False
    # The backend's options model (a subclass's own); `self.options` is one of it.
    options_model: type[PulledOptions] = PulledOptions

    def __init__(self, settings: RelaySettings | None = None) -> None:
        self.settings = settings or RelaySettings()
        self.options = self.settings.options_as(self.name, self.options_model)
        self.peer_id = make_peer_id(self.settings.name_prefix)
        self._credits = Credits(self.settings.credit_slots, self.settings.credit_bytes)
        self._pool: HostPool | None = None  # sender pool, made on the first put
        self._recv_pool: HostPool | None = None  # receive pool, made on the first get
        self._live: dict[int, PulledHandle] = {}
        self._by_request: dict[str, dict[int, PulledHandle]] = {}
        self._sending: dict[int, int] = {}  # tid -> sends in flight from its extent
        self._deferred: dict[int, HostExtent] = {}  # released while being sent
        self._random_ids: list[int] = []
        # Payload bytes handed to a peer (sender) and fetched from one (receiver): lets a
        # test see that a refused fetch moved nothing.
        self.bytes_out = 0
        self.bytes_in = 0
        self._peers: dict[str, Any] = {}
        self._peer_infos: dict[str, bytes] = {}
        self._announced: list[bytes] = []  # the last `set_peers` infos, for `trust_peers`
        self._trusted: frozenset[str] | None = None  # None: every announced peer
        self._peers_changed = Changes()
        self._poller: asyncio.Task[None] | None = None
        self._copier = Copier(self.options)
        self._peer_wait_s = self.options.peer_wait_s
        self.closed = False

    # ---------------------------------------------------------------- backend hooks

    def _info(self) -> dict[str, Any]:
        """Backend fields of `local_info()` (plain msgpack values)."""
        return {}

    def _add_peer(self, peer_id: str, info: dict[str, Any]) -> Any:
        """State for a peer announced by `info` (or re-announced with a new one)."""
        return info

    def _drop_peer(self, peer_id: str, state: Any) -> None:
        """A peer left (or is replaced by a new `_add_peer`)."""

    def _on_segment(self, segment: HostSegment, receive: bool) -> None:
        """A new pool segment (sender or receive pool): register it where needed."""

    def _off_segment(self, segment: HostSegment) -> bool:
        """A receive segment no extent uses is about to be unmapped: undo `_on_segment`.
        False keeps it (the library may still write into it)."""
        return True

    async def _check_extent(self, peer: Any, descriptor: common_pb2.RelayDescriptor) -> None:
        """Refuses a descriptor whose extent the backend can tell is not the sender's,
        before anything is allocated for it (RelayError)."""

    def _progress(self) -> int:
        """Polled while transfers are live; returns how many it released (`_served`)."""
        return 0

    @abc.abstractmethod
    async def _fetch(
        self, peer: Any, descriptor: common_pb2.RelayDescriptor, target: HostExtent
    ) -> None:
        """Copies the descriptor's bytes from `peer` into `target`; raises on failure."""

    # ---------------------------------------------------------------- peers

    def local_info(self) -> bytes:
        return msgpack.packb({"backend": self.name, "id": self.peer_id, **self._info()})

    def set_peers(self, infos: list[bytes]) -> None:
        self._announced = list(infos)
        trusted = self._trusted
        seen: dict[str, tuple[bytes, dict[str, Any]]] = {}
        # Ids announced with two different infos. Ids are unique per relay (a uuid part),
        # so one is a forgery: the later would win and take the peer's place (its address,
        # its agent metadata). Neither is taken up; descriptors naming it fail.
        conflicted: set[str] = set()
        for raw in infos:
            try:
                info = msgpack.unpackb(raw, raw=False, strict_map_key=True)
            except Exception:
                continue
            if not isinstance(info, dict) or info.get("backend") != self.name:
                continue
            peer_id = info.get("id")
            if (
                isinstance(peer_id, str)
                and PEER_ID_RE.fullmatch(peer_id)
                and peer_id != self.peer_id
                and (trusted is None or peer_id in trusted)
            ):
                if peer_id in seen and seen[peer_id][0] != raw:
                    conflicted.add(peer_id)
                seen[peer_id] = (raw, info)
        for peer_id in conflicted:
            del seen[peer_id]
        for peer_id in [p for p in self._peers if p not in seen]:
            self._drop_peer(peer_id, self._peers.pop(peer_id))
            self._peer_infos.pop(peer_id, None)
        for peer_id, (raw, info) in seen.items():
            if self._peer_infos.get(peer_id) == raw:
                continue
            if peer_id in self._peers:
                self._drop_peer(peer_id, self._peers.pop(peer_id))
            try:
                self._peers[peer_id] = self._add_peer(peer_id, info)
            except Exception:
                continue  # a malformed info: its descriptors fail as from an unknown peer
            self._peer_infos[peer_id] = raw
        self._peers_changed.changed()

    def trust_peers(self, peer_ids: Iterable[str] | None) -> None:
        """Fetches only from peers whose id is in `peer_ids` (None: from every announced
        one, the default); see `Relay.trust_peers`. Peers announced before are dropped or
        taken up again at once."""
        trusted: frozenset[str] | None = None
        if peer_ids is not None:
            # A lone string would iterate as its characters: a set of one-letter ids.
            if isinstance(peer_ids, str | bytes):
                raise RelayError(f"{self.name} relay: trust_peers takes ids, not one string")
            try:
                ids = list(peer_ids)
            except TypeError:
                raise RelayError(f"{self.name} relay: trust_peers takes an iterable") from None
            if not all(isinstance(p, str) for p in ids):
                raise RelayError(f"{self.name} relay: peer ids are strings")
            trusted = frozenset(ids)
        self._trusted = trusted
        self.set_peers(self._announced)

    async def _peer(self, peer_id: str) -> Any:
        if self._trusted is not None and peer_id not in self._trusted:
            # No wait for an announcement: none would be taken up.
            raise RelayError(f"{self.name} relay: peer {shown(peer_id)} is not trusted")
        await self._peers_changed.until(
            lambda: peer_id in self._peers or self.closed, self._peer_wait_s
        )
        if peer_id not in self._peers:
            raise RelayError(
                f"{self.name} relay: unknown peer {shown(peer_id)} (no live process announced it)"
            )
        return self._peers[peer_id]

    # ---------------------------------------------------------------- sender side

    @property
    def pool(self) -> HostPool:
        if self._pool is None:
            self._check_open()
            self._pool = HostPool(
                self.settings.pool_bytes, lambda seg: self._on_segment(seg, receive=False)
            )
        return self._pool

    def put_nowait(self, packed: Packed, request_id: str, edge: str) -> PulledHandle | None:
        nbytes = packed.nbytes
        if self.closed or nbytes >= self._copier.thread_bytes:
            return None
        if nbytes == 0:
            return self._handle(None, None, request_id, 0)
        credit = self._credits.edge(edge)
        if not self._credits.try_take(credit, nbytes):
            return None
        extent = self._alloc(credit, nbytes)
        try:
            packed.write_into(extent.view(nbytes))
        except BaseException:
            self._abandon(extent, credit, nbytes)
            raise
        return self._handle(credit, extent, request_id, nbytes)

    async def put(self, packed: Packed, request_id: str, edge: str) -> PulledHandle:
        self._check_open()
        quick = self.put_nowait(packed, request_id, edge)
        if quick is not None:
            return quick
        nbytes = packed.nbytes
        credit = self._credits.edge(edge)
        await self._credits.take(credit, nbytes, self._start_polling)
        extent = self._alloc(credit, nbytes)

        def abandon() -> None:
            self._abandon(extent, credit, nbytes)

        await self._copier.write(packed, extent.view(nbytes), abandon)
        if self.closed:  # closed while copying
            abandon()
            self._check_open()
        return self._handle(credit, extent, request_id, nbytes)

    def _alloc(self, credit: EdgeCredit, nbytes: int) -> HostExtent:
        try:
            pool = self.pool
            if len(pool.segments) >= MAX_SEGMENTS:
                raise RelayError(f"{self.name} relay: pool has {MAX_SEGMENTS} segments")
            return pool.alloc(nbytes)
        except BaseException:
            self._credits.give_back(credit, nbytes)
            raise

    def _abandon(self, extent: HostExtent, credit: EdgeCredit, nbytes: int) -> None:
        if self._pool is not None:
            self._pool.free(extent)
        self._credits.give_back(credit, nbytes)

    def _handle(
        self,
        credit: EdgeCredit | None,
        extent: HostExtent | None,
        request_id: str,
        nbytes: int,
    ) -> PulledHandle:
        try:
            tid = self._new_tid(credit is not None)
        except BaseException:
            if extent is not None and credit is not None:
                self._abandon(extent, credit, nbytes)
            raise
        offset = (extent.segment.index << OFFSET_BITS) | extent.offset if extent else 0
        desc = common_pb2.RelayDescriptor(
            backend=self.name, region=self.peer_id, offset=offset, nbytes=nbytes, transfer_id=tid
        )
        handle = PulledHandle(self, desc, request_id, credit, extent, nbytes, tid)
        if credit is not None:
            self._live[tid] = handle
            self._by_request.setdefault(request_id, {})[tid] = handle
            self._on_live(handle)
            self._start_polling()
        return handle

    def _random_id(self) -> int:
        """63 random bits (gloo sends ids as int64), never 0 and never a live id."""
        while True:
            if not self._random_ids:
                self._random_ids = list(_RANDOM_IDS.unpack(secrets.token_bytes(_RANDOM_IDS.size)))
            tid = self._random_ids.pop() >> 1
            if tid and tid not in self._live:
                return tid

    def _new_tid(self, live: bool) -> int:
        """The id of a new transfer (`live`: one the sender holds, not a 0-byte one)."""
        return self._random_id()

    def _on_live(self, handle: PulledHandle) -> None:
        """A transfer became live (nixl publishes its ticket)."""

    def _release(self, handle: PulledHandle) -> None:
        if self.closed:
            return
        self._live.pop(handle.tid, None)
        handles = self._by_request.get(handle.request_id)
        if handles is not None:
            handles.pop(handle.tid, None)
            if not handles:
                del self._by_request[handle.request_id]
        if handle.extent is not None and self._pool is not None:
            if handle.tid in self._sending:
                self._deferred[handle.tid] = handle.extent  # freed when the send ends
            else:
                self._pool.free(handle.extent)
        if handle._credit is not None:
            self._credits.give_back(handle._credit, handle.nbytes)

    def served(self, tid: int, peer: str | None = None) -> bool:
        """The receiver is done with transfer `tid`: release it (False: not live, or bound
        to a peer other than `peer`; None: whoever asks, for backends that cannot tell)."""
        handle = self._live.get(tid)
        if handle is None or (peer is not None and handle.peer != peer):
            return False
        handle.release()
        return True

    def bind(self, tid: int, offset: int, nbytes: int, peer: str | None) -> PulledHandle | None:
        """Live transfer `tid` if it has exactly that extent and is `peer`'s: bound to the
        first peer that asks for it, refused to any other (None)."""
        handle = self._live.get(tid)
        if handle is None or handle.extent is None:
            return None
        if handle.descriptor.offset != offset or handle.nbytes != nbytes:
            return None
        if peer is not None:
            if handle.peer is None:
                handle.peer = peer
            elif handle.peer != peer:
                return None
        return handle

    def source(self, tid: int, offset: int, nbytes: int, peer: str | None = None) -> Any:
        """The sender-side bytes of live transfer `tid` for a backend to send to `peer`,
        checked against what it asks for (`bind`); pair with `end_send`. None: refused."""
        handle = self.bind(tid, offset, nbytes, peer)
        if handle is None or handle.extent is None:
            return None
        self._sending[tid] = self._sending.get(tid, 0) + 1
        self.bytes_out += nbytes
        return handle.extent.view(nbytes)

    def end_send(self, tid: int) -> None:
        left = self._sending.get(tid, 0) - 1
        if left > 0:
            self._sending[tid] = left
            return
        self._sending.pop(tid, None)
        extent = self._deferred.pop(tid, None)
        if extent is not None and self._pool is not None:
            self._pool.free(extent)

    def cleanup(self, request_id: str) -> None:
        for handle in list(self._by_request.get(request_id, {}).values()):
            handle.release()

    def outstanding(self, edge: str) -> tuple[int, int]:
        return self._credits.outstanding(edge)

    def set_edge_credits(self, edge: str, slots: int, nbytes: int) -> None:
        self._credits.limit(edge, slots, nbytes)

    def _start_polling(self) -> None:
        if type(self)._progress is PullRelay._progress or self.closed:
            return
        if self._poller is None or self._poller.done():
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            self._poller = loop.create_task(self._poll())

    async def _poll(self) -> None:
        delay = _POLL_MIN_S
        while not self.closed and self._live:
            delay = _POLL_MIN_S if self._progress() else min(delay * 2, _POLL_MAX_S)
            await asyncio.sleep(delay)

    # ---------------------------------------------------------------- receiver side

    def check_descriptor(self, d: common_pb2.RelayDescriptor) -> None:
        check_descriptor(d, self.name)
        if not PEER_ID_RE.fullmatch(d.region):
            raise RelayError(f"{self.name} relay: malformed region {shown(d.region)}")
        segment, offset = d.offset >> OFFSET_BITS, d.offset & OFFSET_MASK
        if segment >= MAX_SEGMENTS or offset + d.nbytes > 1 << OFFSET_BITS:
            raise RelayError(
                f"{self.name} relay: extent [{d.offset}, +{d.nbytes}) is outside any pool"
            )
        if d.transfer_id == 0 and d.nbytes:
            raise RelayError(f"{self.name} relay: transfer id 0 names no transfer")

    @property
    def receive_pool(self) -> HostPool:
        if self._recv_pool is None:
            self._check_open()
            self._recv_pool = HostPool(
                self.settings.pool_bytes, lambda seg: self._on_segment(seg, receive=True)
            )
        return self._recv_pool

    def check_owner(
        self, descriptor: common_pb2.RelayDescriptor, owners: frozenset[str] | None
    ) -> None:
        """Refuses a descriptor that names a peer other than the stream's sender."""
        if owners is None:
            return
        # A lone string would match any substring of it.
        if not isinstance(owners, frozenset | set):
            raise RelayError(f"{self.name} relay: owners must be a set of peer ids")
        check_owner(owners, descriptor.region, self.name, "region")

    async def get(
        self, descriptor: common_pb2.RelayDescriptor, owners: frozenset[str] | None = None
    ) -> PulledReceived:
        self._check_open()
        self.check_descriptor(descriptor)
        self.check_owner(descriptor, owners)
        peer = await self._peer(descriptor.region)
        nbytes = descriptor.nbytes
        if nbytes == 0:
            return PulledReceived(EMPTY_VIEW, None, None)
        await self._check_extent(peer, descriptor)
        self._check_open()  # closed while it asked
        pool = self.receive_pool
        grown = len(pool.segments)
        try:
            extent = pool.alloc(nbytes)  # up to 1 TiB: the peer's word, not checked yet
        except (OSError, MemoryError, ValueError, OverflowError) as e:
            raise RelayError(
                f"{self.name} relay: cannot allocate {nbytes} bytes to receive into: {e}"
            ) from None
        try:
            await self._fetch(peer, descriptor, extent)
            self._check_open()
        except BaseException as e:
            pool.free(extent)
            segment = extent.segment
            if (
                len(pool.segments) > grown
                and pool.trimmable(segment)
                and self._off_segment(segment)
            ):
                # Grown for this transfer alone: a failed get keeps nothing mapped.
                pool.trim(segment)
            if isinstance(e, RelayError | asyncio.CancelledError):
                raise
            raise RelayError(
                f"{self.name} relay: fetch from {shown(descriptor.region)} failed: {e}"
            ) from e
        view = memoryview(extent.view(nbytes)).toreadonly()
        return PulledReceived(view, pool, extent)

    # ---------------------------------------------------------------- lifetime

    def _check_open(self) -> None:
        if self.closed:
            raise RelayError(f"{self.name} relay is closed")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._credits.fail_waiters(f"{self.name} relay closed")
        if self._poller is not None:
            self._poller.cancel()
        self._copier.close()
        for peer_id, state in list(self._peers.items()):
            self._drop_peer(peer_id, state)
        self._peers.clear()
        self._live.clear()
        self._by_request.clear()
        self._close_backend()
        # Views a caller still holds keep their mapping alive (see HostSegment.close).
        for pool in (self._pool, self._recv_pool):
            if pool is not None:
                pool.close()

    def _close_backend(self) -> None:
        """Frees the library's resources (agent, endpoints, process group)."""
