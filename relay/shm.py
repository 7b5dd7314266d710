"""`shm` relay: one shared-memory pool per sender process, mapped once by each receiver.

Sender: `put` waits for edge credits, copies the packed tensors into a pool extent once and
returns a handle. Receiver: `get` maps the sender's segment read-only once (`shm_maps`:
cached by name, re-mapped when the file's inode changes, e.g. the sender restarted) and
returns a zero-copy read-only view. Releasing it writes the transfer id into the sender's
release-mark slot; the sender reclaims marked extents on its next `put` (or by polling while
an edge waits for credit), so no ack message crosses the stream.

Forwarding: a stage that passes on bytes it received through this relay (its output
payload's tensors lie in a view it still holds, as they would in a buffer of their own: a
received tensor, an aligned slice of one, or the received payload whole) may hand that view
on instead of copying it (`forward_nowait`). The descriptor then names the original
sender's segment and transfer, and the final receiver's release mark returns the bytes to
that sender; the forwarding stage's own release of its view no longer marks anything.

Trust: a receiver maps only data segments of name prefixes it trusts (exact match of
f"{prefix}-{pid}.{pool}-{n}", checked before anything is opened): its own, and those of
the shm relays the mesh announced (`local_info` publishes the prefix; compose gives each
service its own) that `trust_peers` does not exclude. A descriptor that names another
prefix waits briefly for its announcement, which may come after the descriptor.

Beyond that, a descriptor is bound to its sender and to a live transfer:
- Transfer ids are unguessable: 48 random bits (from `secrets`) above the 16 slot bits.
- Grant table: for each live transfer the sender writes, in its marks segment (which
  receivers map already), the transfer id, the data segment's number and the extent's
  start and end; releasing the transfer clears the id. A receiver reads nothing unless the
  descriptor's slot holds exactly its transfer id, for that segment, and its bytes lie in
  that extent: a guessed, stale or released id, or another edge's extent, fails with
  RelayError before any byte is read (or any release mark written).
- Owner: the shm peer id is the sending process, f"{prefix}-{pid}" (the "id" of
  `local_info`). `get(descriptor, owners)` takes the peer ids the authenticated sender of
  the Deliver stream announced; a descriptor naming a segment of one of them is the
  sender's own transfer.
- Forwarding: a descriptor naming a segment of a process *not* in `owners` is accepted only
  as a forward: the forwarding stage, when it hands a view on (`forward_nowait`), writes a
  tag of its own peer id (`forward_tag`) into the transfer's grant, and the receiver
  accepts the descriptor only if that tag is one of `owners`'. So a stage can hand on only
  transfers it was given (it knows their unguessable ids) and that it marked as handed on,
  and only their granted bytes; everyone else's, or a guessed id, is refused.
- Segments are created owner-only (0600) and a receiver maps none that group or others
  may access. The boundary is the user id: a process of the same user can open /dev/shm
  files by itself; these checks stop an honest receiver from being made to read (and to
  release, or pass on) bytes a sender has no right to name.

Options (`omnirail.relay.options.ShmOptions`): `copy_thread_bytes` (default 8 MiB): payloads
at least this large are copied in a worker thread so the event loop keeps serving other
streams meanwhile, split across `copy_threads` threads (default 2; see `omnirail.relay.copy`).
`forward_views` (default true): false makes every put copy (e.g. when a downstream stage
cannot see an upstream stage's /dev/shm). Edge credits: `RelaySettings` gives the default
bound, `set_edge_credits` one edge's own.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
import secrets
from collections import deque
from collections.abc import Iterable, Iterator

import msgpack

from omnirail.relay.base import (
    Relay,
    RelayError,
    RelaySettings,
    check_descriptor,
    shown,
)
from omnirail.relay.copy import Copier
from omnirail.relay.credits import Credits, EdgeCredit
from omnirail.relay.options import DEFAULT_PEER_WAIT_S, ShmOptions
from omnirail.relay.shm_handles import SLOT_MASK, ShmForward, ShmHandle, ShmReceived
from omnirail.relay.shm_maps import Mapping, SegmentMaps, outside
from omnirail.relay.shm_pool import (
    ALIGN,
    GRANT_END,
    GRANT_FORWARDER,
    GRANT_SEGMENT,
    GRANT_START,
    GRANT_WORDS,
    MARK_SLOTS,
    NAME_RE,
    Extent,
    ShmPool,
    data_segment_parts,
    grant_index,
    marks_name,
    segment_prefix,
    sweep_segments,
)
from omnirail.tuning.aio import Changes
from omnirail.v1 import common_pb2
from omnirail.wire.payload import Packed

__all__ = [
    "ShmForward",
    "ShmHandle",
    "ShmReceived",
    "ShmRelay",
    "forward_tag",
    "sweep_segments",
]

BACKEND = "shm"
# Credit waiters poll the marks with a backoff between these bounds (seconds).
_POLL_MIN_S = 50e-6
_POLL_MAX_S = 2e-3
# The random bits of a transfer id: all but the slot's.
_RANDOM_MASK = ((1 << 64) - 1) ^ SLOT_MASK


def _random_words() -> Iterator[int]:
    """Random uint64s, drawn 512 at a time (one getrandom call per 512 transfers keeps
    the put path free of a syscall)."""
    while True:
        yield from memoryview(secrets.token_bytes(8 * 512)).cast("Q")


@functools.lru_cache(maxsize=1024)
def forward_tag(peer_id: str) -> int:
    """What a forwarding process writes into a grant: 64 bits of sha256 of its shm peer
    id, never 0 (0: not handed on)."""
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:8], "little") or 1


class _Unannounced(RelayError):
    """A data segment of a prefix no shm relay of the mesh announced (yet)."""

    def __init__(self, prefix: str, name: str) -> None:
        super().__init__(
            f"shm segment {shown(name)}: prefix {prefix!r} is neither this relay's nor "
            "announced by the mesh"
        )
        self.prefix = prefix


class ShmRelay(Relay):
    name = BACKEND
    acks_in_band = False

    def __init__(self, settings: RelaySettings | None = None) -> None:
        self.settings = settings or RelaySettings()
        self.options = self.settings.options_as(BACKEND, ShmOptions)
        prefix = self.settings.name_prefix
        if not isinstance(prefix, str) or not NAME_RE.fullmatch(prefix):
            raise RelayError(f"shm relay: bad name prefix {prefix!r} (letters, digits, _.-)")
        # Whose data segments this receiver maps (`_map_data`): its own prefix, and the
        # announced ones (`set_peers`) that `trust_peers` allows.
        self._prefix = prefix
        # This process's shm peer id: the owner part of its segments' names.
        self._owner = f"{prefix}-{os.getpid()}"
        self._tag = forward_tag(self._owner)
        self._announced: frozenset[str] = frozenset()
        self._announced_owners: dict[str, str] = {}  # peer id -> its prefix
        self._trusted: frozenset[str] | None = None  # None: every announced prefix
        self._accepted: frozenset[str] = frozenset((prefix,))
        self._peers_changed = Changes()
        # How long `get` waits for a prefix to be announced (the pulled relays' default).
        self._peer_wait_s = DEFAULT_PEER_WAIT_S
        self._pool: ShmPool | None = None  # created on the first put: receivers need none
        self._credits = Credits(self.settings.credit_slots, self.settings.credit_bytes)
        self._random = _random_words()
        self._free_slots: deque[int] = deque(range(1, MARK_SLOTS))  # 0: never a live slot
        self._live: dict[int, ShmHandle] = {}
        self._marks: memoryview | None = None
        self._poller: asyncio.Task[None] | None = None
        self._maps = SegmentMaps()
        self._copier = Copier(self.options)
        # Views handed out by `get` and not yet released, when forwarding is on.
        self._held: set[ShmReceived] | None = set() if self.options.forward_views else None
        self._forwards: set[ShmForward] = set()  # forwarded views this stage answers for
        self.closed = False

    # ------------------------------------------------------------------ sender side

    @property
    def pool(self) -> ShmPool:
        if self._pool is None:
            self._check_open()
            self._pool = ShmPool(self.settings.name_prefix, self.settings.pool_bytes)
            self._marks = memoryview(self._pool.marks).cast("B").cast("Q")
        return self._pool

    def reclaim(self) -> int:
        """Releases every transfer whose receiver has marked it done; returns how many."""
        marks = self._marks
        if marks is None or not self._live:
            return 0
        done = [h for tid, h in self._live.items() if marks[h.slot] == tid]
        for handle in done:
            handle.release()
        return len(done)

    async def _poll_marks(self) -> None:
        """Runs while some edge waits for credit: its credit returns only via marks."""
        delay = _POLL_MIN_S
        while not self.closed and self._credits.waiting():
            delay = _POLL_MIN_S if self.reclaim() else min(delay * 2, _POLL_MAX_S)
            await asyncio.sleep(delay)

    def _start_polling(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll_marks())

    def put_nowait(self, packed: Packed, request_id: str, edge: str) -> ShmHandle | None:
        """`put` without a coroutine when the edge has credit and the copy runs inline."""
        nbytes = packed.nbytes
        if self.closed:
            return None
        if self._live:
            # Before the size check: `put` comes through here for threaded copies too, and
            # must reuse what receivers released rather than grow the pool.
            self.reclaim()
        if nbytes >= self._copier.thread_bytes:
            return None
        credits = self._credits.edge(edge)
        if not self._credits.try_take(credits, nbytes):
            return None
        pool, extent = self._alloc(credits, nbytes)
        try:
            target = extent.segment.array[extent.offset : extent.offset + nbytes]
            packed.write_into(target)
            del target
        except BaseException:
            self._abandon(pool, extent, credits, nbytes)
            raise
        return self._handle(pool, extent, credits, request_id, nbytes)

    def forward_nowait(self, packed: Packed, request_id: str, edge: str) -> ShmForward | None:
        """Hands on, without a copy, a view this relay received, when `packed`'s buffer
        lies in it as is: every tensor at its own offset from one 64-byte aligned start (a
        received tensor or aligned slice of one, or a received payload passed on whole).
        None otherwise, or if that view was forwarded before.

        The caller promises what `Relay.forward_nowait` asks: this payload goes to one
        receiver, and the caller reads none of its tensors again.
        """
        if not self._held or self.closed or not packed.chunks:
            return None
        first_offset, first = packed.chunks[0]
        start = first.ctypes.data - first_offset
        if start % ALIGN:
            return None
        end = start + packed.nbytes
        for received in self._held:
            # Skipping views handed on already: within one process, a stage may hold a
            # view of the very bytes an earlier stage of the process forwarded to it.
            if (
                received.forward is None
                and received.addr <= start
                and end <= received.addr + len(received.buffer)
            ):
                break
        else:
            return None
        if any(src.ctypes.data - offset != start for offset, src in packed.chunks[1:]):
            return None
        desc = common_pb2.RelayDescriptor(
            backend=BACKEND,
            region=received.region,
            offset=received.offset + start - received.addr,
            nbytes=packed.nbytes,
            transfer_id=received.transfer_id,
        )
        received.forward = ShmForward(desc, request_id, received, self._forwards)
        received.tag_forward(self._tag)  # the next receiver takes it from this process
        return received.forward

    async def put(self, packed: Packed, request_id: str, edge: str) -> ShmHandle:
        """Copies `packed` into the pool once `edge` has credit; never rejects for size."""
        if self.closed:
            raise RelayError("shm relay is closed")
        quick = self.put_nowait(packed, request_id, edge)
        if quick is not None:
            return quick
        nbytes = packed.nbytes
        credits = self._credits.edge(edge)
        await self._credits.take(credits, nbytes, self._start_polling)
        pool, extent = self._alloc(credits, nbytes)

        def abandon() -> None:
            self._abandon(pool, extent, credits, nbytes)

        # The slice goes straight to the copy (no local keeps it while the copy runs).
        await self._copier.write(
            packed, extent.segment.array[extent.offset : extent.offset + nbytes], abandon
        )
        if self.closed:  # closed while copying: the pool is gone
            abandon()
            self._check_open()
        return self._handle(pool, extent, credits, request_id, nbytes)

    def _alloc(self, credits: EdgeCredit, nbytes: int) -> tuple[ShmPool, Extent]:
        """An extent for a transfer that holds credit; the credit goes back on failure."""
        try:
            pool = self._pool or self.pool
            return pool, pool.alloc(nbytes)
        except BaseException:
            self._credits.give_back(credits, nbytes)
            raise

    def _handle(
        self, pool: ShmPool, extent: Extent, credits: EdgeCredit, request_id: str, nbytes: int
    ) -> ShmHandle:
        """Gives a copied-in extent its release slot, descriptor and handle."""
        if not self._free_slots and not self.reclaim():
            self._abandon(pool, extent, credits, nbytes)
            raise RelayError(f"more than {MARK_SLOTS - 1} transfers outstanding")
        slot = self._free_slots.popleft()
        tid = (next(self._random) & _RANDOM_MASK) | slot
        marks = self._marks
        assert marks is not None
        marks[slot] = 0
        # The grant receivers check before they read; its id last, so a grant is whole
        # once the id is there.
        g = MARK_SLOTS + GRANT_WORDS * slot  # grant_index(slot), without the call
        marks[g + GRANT_SEGMENT] = extent.segment.number
        marks[g + GRANT_START] = extent.offset
        marks[g + GRANT_END] = extent.offset + nbytes
        marks[g + GRANT_FORWARDER] = 0
        marks[g] = tid
        desc = common_pb2.RelayDescriptor(
            backend=BACKEND,
            region=extent.segment.name,
            offset=extent.offset,
            nbytes=nbytes,
            transfer_id=tid,
        )
        handle = ShmHandle(self, desc, request_id, credits, extent, nbytes, tid)
        self._live[tid] = handle
        return handle

    def _abandon(self, pool: ShmPool, extent: Extent, credits: EdgeCredit, nbytes: int) -> None:
        pool.free(extent)
        self._credits.give_back(credits, nbytes)

    def _release(self, handle: ShmHandle) -> None:
        if self.closed:
            return
        if self._live.pop(handle.transfer_id, None) is not None:
            if self._marks is not None:
                self._marks[grant_index(handle.slot)] = 0  # no receiver may read it now
            self._free_slots.append(handle.slot)
        if self._pool is not None:
            self._pool.free(handle._extent)
        self._credits.give_back(handle._edge, handle.nbytes)

    def held(self) -> int:
        return len(self._live) + len(self._forwards)

    def cleanup(self, request_id: str) -> None:
        """Releases every unacked handle of `request_id` (abort path)."""
        # A scan of what is live (at most the edges' credit slots) on the rare abort path
        # keeps every put and release free of a per-request index.
        for handle in [h for h in self._live.values() if h.request_id == request_id]:
            handle.release()
        if self._forwards:
            for forward in [f for f in self._forwards if f.request_id == request_id]:
                forward.release()

    def outstanding(self, edge: str) -> tuple[int, int]:
        """(transfers, bytes) unacked on `edge`."""
        return self._credits.outstanding(edge)

    def set_edge_credits(self, edge: str, slots: int, nbytes: int) -> None:
        self._credits.limit(edge, slots, nbytes)

    # ------------------------------------------------------------------ receiver side

    async def get(
        self, descriptor: common_pb2.RelayDescriptor, owners: frozenset[str] | None = None
    ) -> ShmReceived:
        """Maps the bytes a descriptor names; raises RelayError for a bad descriptor, one
        whose transfer is not live (grant), or one `owners` may not name (see "Trust").
        A segment of a prefix not announced (yet) waits for its announcement."""
        try:
            return self.get_nowait(descriptor, owners)
        except _Unannounced as e:
            await self._announcement(e.prefix, e)
        return self.get_nowait(descriptor, owners)

    def get_nowait(
        self, descriptor: common_pb2.RelayDescriptor, owners: frozenset[str] | None = None
    ) -> ShmReceived:
        """`get` without the coroutine (it never waits)."""
        self._check_open()
        check_descriptor(descriptor, BACKEND)
        name = descriptor.region
        offset = descriptor.offset
        end = offset + descriptor.nbytes  # uint64 fields: never negative, may exceed 2**64
        tid = descriptor.transfer_id
        # Checked before anything is looked up or mapped: a refused descriptor costs nothing.
        if not tid & SLOT_MASK:
            raise RelayError(f"descriptor has no release slot (transfer_id {tid})")
        mapping = self._maps.mapped.get(name)
        # A cached data segment was validated when mapped; anything else takes the checks
        # (a cached marks segment is refused there), and a new data segment's pool marks
        # are mapped with it (they live and die together with the sender).
        if mapping is None or mapping.writable or not self._maps.still_current(name, mapping):
            mapping = self._map_data(name, offset, end, tid, owners)
        else:
            # The grant, inline on the hot path (a call costs as much as the reads); on any
            # doubt `_check_grant` decides, and says why.
            marks = mapping.marks
            assert marks is not None
            g = MARK_SLOTS + GRANT_WORDS * (tid & SLOT_MASK)
            if (
                marks[g] != tid
                or marks[g + GRANT_SEGMENT] != mapping.number
                or offset < marks[g + GRANT_START]
                or end > marks[g + GRANT_END]
                or (owners is not None and mapping.owner not in owners)
            ):
                _check_grant(marks, mapping, name, offset, end, tid, owners)
        if end > mapping.size:
            raise outside(name, end, mapping.size)
        return ShmReceived(
            mapping.view[offset:end],
            mapping.marks,
            tid,
            self._held,
            name,
            offset,
            mapping.addr + offset,
        )

    def _map_data(
        self, name: str, offset: int, end: int, tid: int, owners: frozenset[str] | None
    ) -> Mapping:
        """Data segment `name` mapped with the release marks of its pool, for transfer
        `tid` of bytes [offset, end). The marks come first: the transfer's grant is checked
        before the data segment is opened. Both enter the cache only once both are mapped
        and `end` is inside the segment: a refused get leaves nothing mapped or cached (a
        data segment cached without its marks would let the next get return bytes it can
        never mark)."""
        # Only names this relay's own prefix gives data segments, before any syscall: a
        # descriptor must not make it open (or write the marks of) anyone else's files.
        # The pattern refuses marks segments too: mapped read-only as data, a marks segment
        # would be cached where later releases cannot write their marks.
        parts = data_segment_parts(name) if len(name) <= 255 else None
        if parts is None:
            if marks_name(name) == name:
                raise RelayError(f"shm segment {shown(name)} is a release-marks segment, not data")
            raise RelayError(f"bad shm segment name {shown(name)}: not a pool's data segment")
        prefix, owner, number = parts
        if prefix not in self._accepted:
            if self._trusted is not None and prefix not in self._trusted:
                raise RelayError(f"shm segment {shown(name)}: prefix {prefix!r} is not trusted")
            raise _Unannounced(prefix, name)
        marks, marks_fresh = self._maps.open(marks_name(name), writable=True)
        try:
            assert marks.marks is not None
            _check_grant(marks.marks, _Named(owner, number), name, offset, end, tid, owners)
            data, data_fresh = self._maps.open(name, end=end)
        except BaseException:
            if marks_fresh:
                marks.unmap()
            raise
        if marks_fresh:
            self._maps.cache(marks_name(name), marks)
        if data_fresh:
            data.owner, data.number = owner, number
            self._maps.cache(name, data)
        data.marks = marks.marks
        return data

    # ------------------------------------------------------------------ peers

    def local_info(self) -> bytes:
        # The prefix, so receivers of another prefix (compose: one per service) map this
        # relay's segments because the coordinator announced it, and nobody else's; the
        # id (this process: the owner part of its segments' names), so a receiver reads
        # only this process's transfers from this process's streams.
        return msgpack.packb({"backend": BACKEND, "id": self._owner, "prefix": self._prefix})

    def set_peers(self, infos: list[bytes]) -> None:
        announced = set()
        owners: dict[str, str] = {}
        for raw in infos:
            try:
                info = msgpack.unpackb(raw, raw=False, strict_map_key=True)
            except Exception:
                continue  # another backend's shape, or garbage: never this relay's concern
            if not isinstance(info, dict) or info.get("backend") != BACKEND:
                continue
            peer = info.get("id")
            prefix = info.get("prefix", peer)  # a peer of an older version: id = prefix
            if isinstance(prefix, str) and len(prefix) <= 200 and NAME_RE.fullmatch(prefix):
                announced.add(prefix)
                if isinstance(peer, str):
                    owners[peer] = prefix
        self._announced = frozenset(announced)
        self._announced_owners = owners
        self._accept()

    def trust_peers(self, peer_ids: Iterable[str] | None) -> None:
        """Maps segments only of the announced prefixes in `peer_ids` (an shm peer id, or
        a name prefix itself: trust is per prefix), besides its own; None: of every
        announced one."""
        trusted: frozenset[str] | None = None
        if peer_ids is not None:
            # A lone string would iterate as its characters: a set of one-letter ids.
            if isinstance(peer_ids, str | bytes):
                raise RelayError("shm relay: trust_peers takes prefixes, not one string")
            try:
                ids = list(peer_ids)
            except TypeError:
                raise RelayError("shm relay: trust_peers takes an iterable") from None
            if not all(isinstance(p, str) for p in ids):
                raise RelayError("shm relay: peer ids (name prefixes) are strings")
            trusted = frozenset(ids)
        self._trusted = trusted
        self._accept()

    def _accept(self) -> None:
        """Recomputes the prefixes mapped, and forgets mappings of those no longer in it
        (views still held stay valid: see `SegmentMaps.drop`)."""
        trusted = self._trusted
        if trusted is not None:
            trusted = frozenset(self._announced_owners.get(p, p) for p in trusted)
        accepted = self._announced if trusted is None else self._announced & trusted
        self._accepted = accepted | {self._prefix}
        for name in list(self._maps.mapped):
            if segment_prefix(name) not in self._accepted:
                self._maps.drop(name)
        self._peers_changed.changed()

    async def _announcement(self, prefix: str, refusal: RelayError) -> None:
        """Returns once `prefix` is accepted; raises `refusal` after the peer wait."""
        if self._peer_wait_s <= 0:
            raise refusal from None  # without a single await: nothing to wait for

        def untrusted() -> bool:
            return self._trusted is not None and prefix not in self._trusted

        await self._peers_changed.until(
            lambda: prefix in self._accepted or self.closed or untrusted(), self._peer_wait_s
        )
        if prefix in self._accepted:
            return
        if not self.closed and untrusted():
            raise RelayError(f"shm relay: prefix {prefix!r} is not trusted") from None
        raise refusal from None

    # ------------------------------------------------------------------ lifetime

    def _check_open(self) -> None:
        if self.closed:
            raise RelayError("shm relay is closed")

    def close(self) -> None:
        """Unlinks own segments and unmaps everything; idempotent."""
        if self.closed:
            return
        self.closed = True
        self._credits.fail_waiters("shm relay closed")
        self._live.clear()
        if self._poller is not None:
            self._poller.cancel()
        self._copier.close()
        if self._marks is not None:
            self._marks.release()
            self._marks = None
        if self._pool is not None:
            self._pool.close()
        self._maps.close()


class _Named:
    """The owner and number of a data segment not mapped yet (a `Mapping`'s fields)."""

    __slots__ = ("number", "owner")

    def __init__(self, owner: str, number: int) -> None:
        self.owner = owner
        self.number = number


def _check_grant(
    marks: memoryview,
    segment: Mapping | _Named,
    name: str,
    offset: int,
    end: int,
    tid: int,
    owners: frozenset[str] | None,
) -> None:
    """RelayError unless transfer `tid` is live in its sender's grant table, for bytes
    [offset, end) of this segment, and `owners` may name it: they include the segment's
    owner, or the process that handed the transfer on (see "Trust")."""
    g = grant_index(tid & SLOT_MASK)
    # The id is not shown: a live one is a capability, and errors reach logs and clients.
    if marks[g] != tid:
        raise RelayError(
            f"shm descriptor: its transfer_id is not a live transfer of segment {shown(name)}'s "
            "pool (guessed, stale or released)"
        )
    if marks[g + GRANT_SEGMENT] != segment.number or not (
        marks[g + GRANT_START] <= offset and end <= marks[g + GRANT_END]
    ):
        raise RelayError(
            f"shm descriptor: bytes [{offset}, {end}) of segment {shown(name)} are not the "
            "extent its transfer_id was granted"
        )
    if owners is not None and segment.owner not in owners:
        forwarder = marks[g + GRANT_FORWARDER]
        if not forwarder or all(forward_tag(o) != forwarder for o in owners):
            raise RelayError(
                f"shm descriptor: region {shown(name)} is a segment of {segment.owner!r}, "
                "which the sender of this stream did not announce, and the sender did not "
                "hand that transfer on"
            )
