"""`nixl` relay: the receiver READs the sender's pool extent through a NIXL agent (UCX).

One NIXL agent per relay, named by its peer id: UCX backend, no listener, by default no
progress thread; every call is made from the event loop, which polls. The peer info carries
the agent's connection metadata only (stable: it does not change as pools grow).

Sender: `put` copies into the `HostPool` (each segment registered once); the descriptor
names this agent (`region`) and the extent (`offset` = segment << 40 | offset within). The
handle is released by the receiver's release notification ("R" tid offset: credit is held
until the receiver lets go of its view, as with shm) or by `cleanup`. A receiver asks for
a segment it does not know ("?" index, naming the transfer it was sent); the sender answers
with its bounds, its ticket table and partial metadata ("M"), or "N". Notifications are
parsed with `struct`, never unpickled.

Receiver: `get` checks the extent against the bounds the sender itself answered, READs the
transfer's ticket (see Trust), then the extent into its own registered receive pool
(chunked, so one large fetch does not stall the loop for long; transfer handles cached per
extent pair) and notifies the sender on release.

Options (`omnirail.relay.options.NixlOptions`, defaults there): `ucx_error_handling_mode`
("none", "peer" for multi-host), `progress_thread`, `num_threads`, `fetch_timeout_s`,
`chunk_bytes` (at least 64 KiB are read at a time), `spin_us` (busy polling before
yielding), `handle_cache` (per peer), plus those of every pulled backend (`PulledOptions`).
GPU memory is not moved yet: pools are host memory, as `omnirail.wire.payload.pack` refuses
CUDA tensors.

Trust. NIXL READs are one-sided: whoever holds a segment's metadata (its remote keys) and
an endpoint to the agent can read the whole segment without the sender seeing it. So:

- Notifications are heard only from announced (and trusted) peers, and answers go to the
  agent announced under the asker's name, over the endpoint made from its announced
  metadata: a process that is not a registered member never gets a segment's metadata
  (a forged name gets the answer sent to the real agent).
- A segment's metadata is handed out only to a peer that names a live transfer of that
  segment (tid, offset, nbytes: the descriptor it was sent); that transfer is then bound
  to the peer (another peer asking with it is refused). Its metadata covers that segment
  and the ticket table, nothing else.
- Every fetch first READs the transfer's ticket (a row of the sender's registered ticket
  table holding tid, offset, nbytes while the transfer is live, zeroed on release; the
  tid's low 16 bits pick the row, the other 47 are random): a guessed, released or
  mismatched id fails with RelayError before any payload byte is read. Release
  notifications of a bound transfer count only from its peer.

What does not hold: a registered peer that was sent one transfer of a segment can READ the
rest of that segment (other transfers, to other peers) by calling NIXL itself, bypassing
the ticket check; per-peer registration would need the sender to know the receiver at put
time. A transfer released by its sender's cleanup while a receiver reads it may hand that
receiver bytes of a later transfer in the same extent. Same-host reads go through cma,
which any process of the same user may do anyway (ptrace rules).
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from omnirail.relay.base import RelayError, RelaySettings
from omnirail.relay.host_pool import HostExtent, HostSegment
from omnirail.relay.netif import listen_device
from omnirail.relay.options import NixlOptions
from omnirail.relay.pull import OFFSET_BITS, OFFSET_MASK, PulledHandle, PulledReceived, PullRelay
from omnirail.v1 import common_pb2
from omnirail.wire.payload import Packed

# Importing nixl configures logging process-wide; keep the process's own choices.
_raise_exceptions = logging.raiseExceptions
try:
    from nixl import _api as nixl_api
except ImportError:
    from nixl_cu12 import _api as nixl_api  # the CUDA 12 wheel's name
finally:
    logging.raiseExceptions = _raise_exceptions
if not os.environ.get("NIXL_LOG_LEVEL"):
    # Its INFO lines go to stdout for every agent and backend made: not ours to print.
    logging.getLogger("nixl").setLevel(logging.WARNING)

__all__ = ["NixlReceived", "NixlRelay"]

BACKEND = "nixl"
# After the spin, polls yield to the loop without sleeping for this long, then back off
# (a sleep rounds up to the selector's 1 ms anyway).
_YIELD_S = 200e-6
_POLL_MIN_S = 50e-6
_MIN_CHUNK = 64 << 10  # smaller `chunk_bytes` read this much at a time
_POLL_MAX_S = 2e-3
# Notification messages: release (kind, tid, offset); ask (kind, segment index, and the
# transfer the asker was sent: tid, offset, nbytes); refused (kind, index); segment (kind,
# index, base, size, ticket table base, its slots) followed by the partial metadata of the
# segment and the ticket table.
_RELEASE = struct.Struct("<cQQ")
_ASK = struct.Struct("<cHQQQ")
_NO = struct.Struct("<cH")
_SEGMENT = struct.Struct("<cHQQQQ")
# Tickets: one row (tid, offset, nbytes, 0) per live transfer, in a registered table the
# receiver READs before the payload; a transfer id's low bits are its row.
_TICKET = struct.Struct("<4Q")
_ID = struct.Struct("<Q")
_SLOT_BITS = 16
_SLOTS = 1 << _SLOT_BITS
_SLOT_MASK = _SLOTS - 1


class _Peer:
    """What a receiver knows of one sender agent."""

    __slots__ = ("asked", "dropped", "handles", "name", "segments", "tickets")

    def __init__(self, name: str) -> None:
        self.name = name
        self.segments: dict[int, tuple[int, int]] = {}  # index -> (base address, size)
        self.tickets = (0, 0)  # its ticket table: base address, slots (0: not known yet)
        self.asked: dict[int, asyncio.Future[tuple[int, int]]] = {}
        # (local, remote, nbytes) -> idle transfer handle; a handle in use is out of it.
        self.handles: OrderedDict[tuple[int, int, int], Any] = OrderedDict()
        self.dropped = False


class NixlReceived(PulledReceived):
    """A received view whose release also tells the sender it may reuse the extent."""

    __slots__ = ("_ack", "_peer_id", "_relay")

    def __init__(self, received: PulledReceived, relay: NixlRelay, peer_id: str, ack: bytes):
        super().__init__(received.buffer, received._pool, received._extent)
        received._pool = received._extent = None  # owned here now
        self._relay = relay
        self._peer_id = peer_id
        self._ack = ack

    def release(self) -> None:
        ack, self._ack = self._ack, None
        super().release()
        if ack is not None:
            self._relay._notify(self._peer_id, ack)


class NixlRelay(PullRelay):
    name = BACKEND
    options_model = NixlOptions
    options: NixlOptions

    def __init__(self, settings: RelaySettings | None = None) -> None:
        super().__init__(settings)
        opts = self.options
        self._fetch_timeout = opts.fetch_timeout_s
        self._chunk = max(opts.chunk_bytes, _MIN_CHUNK)
        self._spin_s = opts.spin_us * 1e-6
        self._cache_size = opts.handle_cache
        self._regs: list[Any] = []  # registered descriptor lists, deregistered on close
        self._recv_regs: dict[HostSegment, Any] = {}  # receive segment -> its registration
        self._segments: dict[int, tuple[int, int, bytes]] = {}  # sender: base, size, meta
        self._stuck: list[Any] = []  # transfer handles NIXL would not release yet
        self._agent: Any = self._make_agent(opts)
        # Connection info without memory: registrations travel on request ("?").
        empty = nixl_api.nixlBind.nixlRegDList(nixl_api.nixlBind.DRAM_SEG)
        self._meta: bytes = self._agent.get_partial_agent_metadata(empty, True)
        # The ticket table (sender side), registered once: 2 MiB, one huge page.
        self._tickets = HostSegment(-1, _SLOTS * _TICKET.size)
        try:
            self._regs.append(
                self._agent.register_memory(
                    [(self._tickets.address, self._tickets.size, 0, "")], "DRAM"
                )
            )
        except Exception as e:
            self._tickets.close()
            raise RelayError(f"nixl relay: cannot register its ticket table: {e}") from e
        self._ticket_view = memoryview(self._tickets.array)  # type: ignore[arg-type]
        self._free_slots = list(range(_SLOTS - 1, -1, -1))

    def _make_agent(self, opts: NixlOptions) -> Any:
        # "peer": UCX detects dead peers (multi-host); "none" lets same-host transports
        # run without the wireup handshake that needs the other side's progress.
        mode = opts.ucx_error_handling_mode
        threads = opts.num_threads
        config = nixl_api.nixl_agent_config(
            enable_prog_thread=opts.progress_thread,
            enable_listen_thread=False,  # metadata travels in peer infos, not sockets
            num_threads=threads,
            backends=[],  # made below, with our init parameters
        )
        init = {"ucx_error_handling_mode": mode}
        # UCX listens on every network device it uses: only the mesh's interface (its
        # `ucx_devices` parameter leaves the listeners as they are; `engine_config` is UCX
        # settings, without the UCX_ prefix).
        # Without a published host (a mesh over unix sockets: one machine), loopback, as the
        # ucx backend's default host is.
        device = listen_device(BACKEND, opts.listen, opts.host or "127.0.0.1")
        if device is not None and "UCX_NET_DEVICES" not in os.environ:
            init["engine_config"] = f"NET_DEVICES={device}"
        if threads > 0:
            init["num_threads"] = str(threads)
        try:
            agent = nixl_api.nixl_agent(self.peer_id, config)
            agent.create_backend("UCX", init)
        except Exception as e:
            raise RelayError(f"nixl relay: cannot start a NIXL agent with UCX: {e}") from e
        return agent

    @property
    def agent(self) -> Any:
        if self._agent is None:
            raise RelayError("nixl relay is closed")
        return self._agent

    async def connect(self, timeout: float) -> None:
        # The agent and its UCX backend exist since __init__ (which raised otherwise);
        # endpoints to peers are made by the first transfer or notification.
        if "UCX" not in self.agent.backends:
            raise RelayError("nixl relay: the UCX backend is not up")

    # ---------------------------------------------------------------- PullRelay hooks

    def _info(self) -> dict[str, Any]:
        return {"meta": self._meta}

    def _add_peer(self, peer_id: str, info: dict[str, Any]) -> _Peer:
        meta = info.get("meta")
        if not isinstance(meta, bytes):
            raise ValueError("no nixl metadata")
        name = self.agent.add_remote_agent(meta)
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name != peer_id:
            if name not in self._peers:
                self.agent.remove_remote_agent(name)
            raise ValueError(f"metadata of agent {name!r} announced as {peer_id!r}")
        return _Peer(peer_id)

    def _drop_peer(self, peer_id: str, state: Any) -> None:
        if not isinstance(state, _Peer):
            return
        state.dropped = True
        for handle in state.handles.values():
            self._discard(handle)
        state.handles.clear()
        for fut in state.asked.values():
            if not fut.done():
                fut.set_exception(RelayError(f"nixl relay: peer {peer_id!r} left"))
        state.asked.clear()
        try:
            self.agent.remove_remote_agent(peer_id)
        except Exception:
            pass  # already gone (closed agent, failed endpoint): nothing to undo

    def _on_segment(self, segment: HostSegment, receive: bool) -> None:
        agent = self.agent
        try:
            reg = agent.register_memory([(segment.address, segment.size, 0, "")], "DRAM")
        except Exception as e:
            raise RelayError(f"nixl relay: cannot register {segment.size} bytes: {e}") from e
        self._regs.append(reg)
        if receive:
            self._recv_regs[segment] = reg
        else:
            # What a receiver needs to READ this segment and the ticket table, handed out
            # when it asks for a live transfer of it.
            tickets = self._tickets
            descs = agent.get_reg_descs(
                [(segment.address, segment.size, 0, ""), (tickets.address, tickets.size, 0, "")],
                "DRAM",
            )
            meta = agent.get_partial_agent_metadata(descs, False)
            self._segments[segment.index] = (segment.address, segment.size, meta)

    def _off_segment(self, segment: HostSegment) -> bool:
        # A READ NIXL would not release may still land in receive memory: keep it mapped.
        if self._stuck or self._agent is None:
            return False
        # Cached READ handles into it were prepared against its registration: they go
        # first (a new segment at the same address must not reuse them).
        start, end = segment.address, segment.address + segment.size
        for peer in self._peers.values():
            if isinstance(peer, _Peer):
                for key in [k for k in peer.handles if start <= k[0] < end]:
                    self._discard(peer.handles.pop(key))
        if self._stuck:
            return False
        reg = self._recv_regs.pop(segment, None)
        if reg is not None:
            try:
                self._agent.deregister_memory(reg)
            except Exception:
                self._recv_regs[segment] = reg
                return False
            self._regs.remove(reg)
        return True

    async def _check_extent(self, peer: Any, descriptor: common_pb2.RelayDescriptor) -> None:
        # The sender's own bounds of the segment (asked once), before the receiver
        # allocates what the descriptor claims: up to 1 TiB of receive pool otherwise.
        await self._bounds(peer, descriptor)

    async def _bounds(self, peer: _Peer, descriptor: common_pb2.RelayDescriptor) -> int:
        """The remote address of the descriptor's extent, checked against its segment."""
        index, offset = descriptor.offset >> OFFSET_BITS, descriptor.offset & OFFSET_MASK
        nbytes = descriptor.nbytes
        seg = peer.segments.get(index)
        if seg is None:
            loop = asyncio.get_running_loop()
            wait = min(self._fetch_timeout, self._peer_wait_s)
            seg = await self._segment(peer, descriptor, loop.time() + wait)
        base, size = seg
        if offset + nbytes > size:
            raise RelayError(
                f"nixl relay: extent [{offset}, +{nbytes}) is outside segment {index} "
                f"({size} bytes) of {peer.name!r}"
            )
        return base + offset

    def _progress(self) -> int:
        return self._drain()

    def _close_backend(self) -> None:
        agent, self._agent = self._agent, None
        if agent is None:
            return
        for release, items in (
            (lambda h: h.release(), self._stuck),
            (agent.deregister_memory, self._regs),
        ):
            for item in items:
                try:
                    release(item)
                except Exception:
                    pass  # a stuck handle keeps the agent alive until NIXL lets it go
            items.clear()
        self._ticket_view.release()
        self._tickets.close()
        # The agent (UCX workers, endpoints) goes with its last reference.

    # ---------------------------------------------------------------- notifications

    def _drain(self) -> int:
        """Handles every notification that arrived; returns how many."""
        agent = self._agent
        if agent is None:
            return 0
        try:
            notifs = agent.get_new_notifs()
        except Exception:
            return 0
        count = 0
        for name, messages in notifs.items():
            if not isinstance(self._peers.get(name), _Peer):
                count += len(messages)
                continue  # not an announced (trusted) peer: nothing it says is heard
            for msg in messages:
                count += 1
                kind = msg[:1]
                if kind == b"R" and len(msg) == _RELEASE.size:
                    _, tid, offset = _RELEASE.unpack(msg)
                    handle = self._live.get(tid)
                    # The offset must match too, and a transfer bound to a peer is that
                    # peer's to release.
                    if (
                        handle is not None
                        and handle.descriptor.offset == offset
                        and handle.peer in (None, name)
                    ):
                        handle.release()
                elif kind == b"?" and len(msg) == _ASK.size:
                    self._answer(name, msg)
                elif kind in (b"M", b"N"):
                    self._learn(name, msg)
        return count

    def _notify(self, peer_id: str, msg: bytes) -> None:
        if self._agent is None:
            return
        try:
            self._agent.send_notif(peer_id, msg)
        except Exception:
            pass  # the sender is gone: nothing waits for this release any more

    def _answer(self, name: str, msg: bytes) -> None:
        """A segment's bounds and metadata, only to a peer that names a live transfer of
        it that is not bound to another peer (it is bound to this one now). The answer goes
        to the agent announced under `name`, whoever sent the ask."""
        _, index, tid, offset, nbytes = _ASK.unpack(msg)
        seg = self._segments.get(index)
        handle = self.bind(tid, offset, nbytes, name)
        if seg is None or handle is None or handle.extent is None:
            self._notify(name, _NO.pack(b"N", index))
        elif handle.extent.segment.index != index:
            self._notify(name, _NO.pack(b"N", index))
        else:
            head = _SEGMENT.pack(b"M", index, seg[0], seg[1], self._tickets.address, _SLOTS)
            self._notify(name, head + seg[2])

    def _learn(self, name: str, msg: bytes) -> None:
        peer = self._peers.get(name)
        if not isinstance(peer, _Peer):
            return
        found = msg[:1] == b"M"
        if len(msg) != _NO.size and (not found or len(msg) <= _SEGMENT.size):
            return
        index = _NO.unpack_from(msg)[1]
        fut = peer.asked.pop(index, None)
        if fut is None or fut.done():
            return  # unasked: never load metadata nobody requested
        try:
            if not found:
                raise RelayError(
                    f"nixl relay: {name!r} refused segment {index}: no live transfer of it "
                    "for this peer (released, guessed, another peer's, or no such segment)"
                )
            _, _, base, size, tbase, slots = _SEGMENT.unpack_from(msg)
            if size <= 0 or base <= 0 or base + size >= 1 << 64:
                raise ValueError(f"bounds [{base:#x}, +{size})")
            if tbase <= 0 or not 0 < slots <= _SLOTS or tbase + slots * _TICKET.size >= 1 << 64:
                raise ValueError(f"ticket table [{tbase:#x}, {slots} slots)")
            loaded = self.agent.add_remote_agent(msg[_SEGMENT.size :])
            if (loaded.decode() if isinstance(loaded, bytes) else loaded) != name:
                raise ValueError(f"metadata of agent {loaded!r}")
        except Exception as e:
            if not isinstance(e, RelayError):
                e = RelayError(f"nixl relay: bad segment {index} from {name!r}: {e}")
            fut.set_exception(e)
            return
        peer.segments[index] = (base, size)
        peer.tickets = (tbase, slots)
        fut.set_result((base, size))

    # ---------------------------------------------------------------- sender side

    def put_nowait(self, packed: Packed, request_id: str, edge: str) -> PulledHandle | None:
        if self._live:
            self._drain()  # take releases in first, so credit and extents are reused
        return super().put_nowait(packed, request_id, edge)

    def _new_tid(self, live: bool) -> int:
        if not live:
            return self._random_id()  # a 0-byte transfer: nothing to fetch, no ticket
        if not self._free_slots:
            raise RelayError(f"nixl relay: {_SLOTS} transfers are live at once (the most)")
        slot = self._free_slots.pop()
        while True:
            tid = (self._random_id() & ~_SLOT_MASK) | slot
            if tid >> _SLOT_BITS and tid not in self._live:
                return tid

    def _on_live(self, handle: PulledHandle) -> None:
        # One 32-byte write; no receiver reads the row before the descriptor is sent.
        at = (handle.tid & _SLOT_MASK) * _TICKET.size
        _TICKET.pack_into(
            self._ticket_view, at, handle.tid, handle.descriptor.offset, handle.nbytes, 0
        )

    def _release(self, handle: PulledHandle) -> None:
        if not self.closed and self._live.get(handle.tid) is handle:
            slot = handle.tid & _SLOT_MASK
            _ID.pack_into(self._ticket_view, slot * _TICKET.size, 0)  # first: it reads as gone
            self._free_slots.append(slot)
        super()._release(handle)

    # ---------------------------------------------------------------- receiver side

    async def get(
        self, descriptor: common_pb2.RelayDescriptor, owners: frozenset[str] | None = None
    ) -> PulledReceived:
        received = await super().get(descriptor, owners)
        if not descriptor.nbytes:
            return received  # the sender holds nothing for an empty transfer
        ack = _RELEASE.pack(b"R", descriptor.transfer_id, descriptor.offset)
        return NixlReceived(received, self, descriptor.region, ack)

    async def _fetch(
        self, peer: Any, descriptor: common_pb2.RelayDescriptor, target: HostExtent
    ) -> None:
        nbytes = descriptor.nbytes
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._fetch_timeout
        remote = await self._bounds(peer, descriptor)  # known since `_check_extent`
        local = target.segment.address + target.offset
        await self._check_ticket(peer, descriptor, target, local, deadline)
        self.bytes_in += nbytes
        done = 0
        while True:
            n = min(self._chunk, nbytes - done)
            key, handle, state = self._post(peer, local + done, remote + done, n)
            # Same-host READs (CMA) finish inside the post: no coroutine, no wait.
            if state != "DONE":
                await self._complete(peer, handle, state, deadline)
            self._keep(peer, key, handle)
            done += n
            if done >= nbytes:
                return
            await asyncio.sleep(0)  # that chunk was copied by this thread: let others run

    async def _check_ticket(
        self,
        peer: _Peer,
        descriptor: common_pb2.RelayDescriptor,
        target: HostExtent,
        local: int,
        deadline: float,
    ) -> None:
        """READs the transfer's ticket row into the start of `target` (extents are at least
        64 bytes) and refuses a transfer the sender does not hold live with that extent,
        before any payload byte is read."""
        tid = descriptor.transfer_id
        base, slots = peer.tickets
        slot = tid & _SLOT_MASK
        if not base or slot >= slots:
            raise RelayError(f"nixl relay: transfer {tid} names no ticket of {peer.name!r}")
        key, handle, state = self._post(peer, local, base + slot * _TICKET.size, _TICKET.size)
        if state != "DONE":
            await self._complete(peer, handle, state, deadline)
        self._keep(peer, key, handle)
        row = _TICKET.unpack(target.view(_TICKET.size).tobytes())
        if row != (tid, descriptor.offset, descriptor.nbytes, 0):
            raise RelayError(
                f"nixl relay: transfer {tid} is not live at {peer.name!r} (released, "
                "aborted, guessed, or a wrong descriptor)"
            )

    async def _segment(
        self, peer: _Peer, descriptor: common_pb2.RelayDescriptor, deadline: float
    ) -> tuple[int, int]:
        """Asks the sender for a segment's bounds and metadata (once per segment), naming
        the live transfer of it that this peer was sent."""
        index = descriptor.offset >> OFFSET_BITS
        fut = peer.asked.get(index)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            peer.asked[index] = fut
            ask = _ASK.pack(
                b"?", index, descriptor.transfer_id, descriptor.offset, descriptor.nbytes
            )
            try:
                self.agent.send_notif(peer.name, ask)
            except Exception as e:
                del peer.asked[index]
                fut.cancel()
                raise RelayError(f"nixl relay: {peer.name!r} is unreachable: {e}") from e

        def answered() -> bool:
            self._drain()
            return fut.done()

        try:
            await self._until(answered, deadline, f"segment {index} of {peer.name!r}")
        except RelayError as e:
            if not fut.done():
                fut.set_exception(e)  # the other waiters on it fail alike
            if peer.asked.get(index) is fut:
                del peer.asked[index]
        return fut.result()

    def _post(self, peer: _Peer, local: int, remote: int, n: int) -> tuple[Any, Any, str]:
        """Posts a READ of `n` bytes, reusing the idle handle of the same extents."""
        key = (local, remote, n)
        handle = peer.handles.pop(key, None)
        agent = self.agent
        try:
            if handle is None:
                handle = agent.initialize_xfer(
                    "READ",
                    agent.get_xfer_descs([(local, n, 0)], "DRAM"),
                    agent.get_xfer_descs([(remote, n, 0)], "DRAM"),
                    peer.name,
                )
            return key, handle, agent.transfer(handle)
        except Exception as e:
            if handle is not None:
                self._discard(handle)
            raise RelayError(f"nixl relay: READ from {peer.name!r} failed: {e}") from e

    async def _complete(self, peer: _Peer, handle: Any, state: str, deadline: float) -> None:
        """Waits for a posted READ; on failure (or cancellation) lets its handle go."""
        agent, box = self.agent, [state]

        def finished() -> bool:
            if box[0] == "PROC":
                box[0] = agent.check_xfer_state(handle)
            if box[0] not in ("PROC", "DONE"):
                raise RelayError(f"nixl relay: READ from {peer.name!r} failed (peer gone?)")
            return box[0] == "DONE"

        try:
            await self._until(finished, deadline, f"READ from {peer.name!r}")
        except BaseException:
            self._discard(handle)
            raise

    def _keep(self, peer: _Peer, key: tuple[int, int, int], handle: Any) -> None:
        """Caches an idle handle: a steady stream reuses the same extents, skipping setup."""
        if peer.dropped or self._agent is None or not self._cache_size:
            self._discard(handle)
            return
        peer.handles[key] = handle
        if len(peer.handles) > self._cache_size:
            self._discard(peer.handles.popitem(last=False)[1])

    async def _until(self, check: Callable[[], bool], deadline: float, what: str) -> None:
        """Returns once `check()`: spins briefly (small READs finish in microseconds),
        then yields to the loop between checks, then backs off up to 2 ms."""
        if check():
            return
        now = time.perf_counter()
        spin_end, yield_end = now + self._spin_s, now + self._spin_s + _YIELD_S
        while time.perf_counter() < spin_end:
            if check():
                return
        loop = asyncio.get_running_loop()
        delay = 0.0
        while True:
            await asyncio.sleep(delay)
            if self._agent is None:
                raise RelayError("nixl relay is closed")
            if check():
                return
            if loop.time() > deadline:
                raise RelayError(f"nixl relay: timed out waiting for the {what}")
            if time.perf_counter() > yield_end:
                delay = min(max(delay * 2, _POLL_MIN_S), _POLL_MAX_S)

    def _discard(self, handle: Any) -> None:
        # NIXL cancels a READ still in flight; one it cannot cancel is kept (retried at
        # close). Its target extent is freed by PullRelay.get all the same: a READ stuck
        # past `fetch_timeout_s` and then landing late is the one case left unguarded.
        try:
            handle.release()
        except Exception:
            self._stuck.append(handle)
