"""`torchdist` relay: receiver-pulled transfers over a private torch.distributed gloo group.

Settings: `rank`, `world_size` (`RelaySettings` fields, from `RelayConfig`). Options
(`omnirail.relay.options.TorchdistOptions`, defaults there): `init_method`
("tcp://host:port"; rank 0 hosts the TCPStore, port 0 picks a free one that
`relay.init_method` names), `timeout_s` (rendezvous), `fetch_timeout_s` (bound of every
transfer wait), `host`/`gloo_host` (the address gloo binds). The group is private (TCPStore plus
ProcessGroupGloo, never the default group), so a process may hold several relays. It
rendezvouses in a thread from construction; `connect` and transfers await it.

Pull protocol, matched by tag, never by arrival order: the receiver posts receives for a
status (tag T) and the bytes (tag T+1, straight into its pool extent), then sends the
sender's rank a FETCH message on MESSAGE_TAG. The sender keeps a receive posted per peer
rank on MESSAGE_TAG and answers with the bytes and an OK status, or 0 bytes and a GONE
status (the receiver raises RelayError). T is unique per receiver rank. Edge credit is held
until the receiver releases its view, as with shm: that sends a RELEASED message, on which
the sender frees the transfer. gloo waits block, so they run in daemon threads that report
back with `call_soon_threadsafe`. Peer bytes are never unpickled. `device` cuda still moves
the host pool's bytes over gloo: NCCL matches messages by order, not tag, and has no
receive-from-any.

Trust: ranks come from config, and a message's rank is the gloo pair it came in on (the
connections made at rendezvous), never a field of the message. A FETCH is served only for a
live transfer id (random, 63 bits) with its exact extent, and binds the transfer to that
rank: another rank, a guessed id or a released one gets GONE and no bytes; only the bound
rank's RELEASED frees it. What does not hold: the rendezvous store (rank 0's TCPStore) is
unauthenticated, so a process that reaches its port before every rank joined could take a
rank; bind it (`init_method`, `gloo_host`) to the mesh's own network.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import queue
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from omnirail.relay.base import Received, Relay, RelayError, RelaySettings
from omnirail.relay.host_pool import HostExtent
from omnirail.relay.options import TorchdistOptions
from omnirail.relay.pull import PulledHandle, PulledReceived, PullRelay
from omnirail.v1 import common_pb2
from omnirail.wire.payload import Packed

BACKEND = "torchdist"
# gloo tags are 32-bit; Python passes a C int. A receive on WAKE_TAG that times out on
# purpose makes gloo close every pair of the group, which wakes every wait (see `_break`).
WAKE_TAG, MESSAGE_TAG, FIRST_REPLY_TAG, MAX_TAG = 0, 1, 2, (1 << 31) - 1
_OK, _GONE = 1, 2  # reply status
_FETCH, _RELEASED = 1, 2  # message kinds: [kind, transfer id, offset, nbytes, tag, rank]
_EMPTY = memoryview(b"")
# A request listener waits for the next request indefinitely: a gloo wait that times out
# breaks the whole group, so its bound must never be reached.
_FOREVER = timedelta(days=3650)
_STORE_PREFIX = "omnirail-torchdist"
_TRY = 0.25  # seconds of one attempt to reach rank 0's store
_JOIN_S = 0.5  # how long close() lets woken threads finish


def _daemon(target: Callable[..., None], name: str, *args: Any) -> threading.Thread:
    # Daemon: gloo waits end only at their timeout; none of them may hold up process exit.
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    thread.start()
    return thread


def _parse(settings: RelaySettings, opts: TorchdistOptions) -> tuple[int, int, str, int]:
    """(rank, world_size, host, port); RelayError names what is wrong."""
    rank, world, init = settings.rank, settings.world_size, opts.init_method
    url = urlsplit(init or "")
    if (
        not isinstance(rank, int)
        or not isinstance(world, int)
        or not 0 <= rank < world
        or url.hostname is None
        or url.port is None
    ):
        given = {"rank": rank, "world_size": world, "init_method": init}
        raise RelayError(
            f"torchdist relay: bad settings {given}: want 0 <= rank < world_size, "
            "init_method 'tcp://host:port'"
        )
    return rank, world, url.hostname, url.port


def pair_settings(first: Relay, settings: RelaySettings, index: int) -> RelaySettings:
    """Settings of rank `index` in `first`'s group: its world and the address it listens on
    (so a rank 0 made with "tcp://host:0" can be joined)."""
    opts = settings.options_as(BACKEND, TorchdistOptions)
    init = getattr(first, "init_method", None) or opts.init_method
    world = getattr(first, "world_size", None) or settings.world_size or 2
    return dataclasses.replace(
        settings,
        rank=index,
        world_size=world,
        options=opts.model_copy(update={"init_method": init}),
    )


class _Waiters:
    """Daemon threads that block on gloo waits for the event loop. A thread is added
    whenever all are busy, so one slow wait (a hung peer) never delays another completion;
    daemon, because such a wait ends only at its gloo timeout and must not hold up exit."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads minus jobs not yet done
        self._name = name
        self.threads: list[threading.Thread] = []

    def run(
        self, loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any
    ) -> asyncio.Future[Any]:
        fut = loop.create_future()
        fut.add_done_callback(_retrieve)
        with self._lock:  # each job gets a free thread, or a new one
            spawn, self._idle = self._idle == 0, max(self._idle - 1, 0)
        if spawn:
            self.threads.append(_daemon(self._work, self._name))
        self._jobs.put((loop, fut, fn, args))
        return fut

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            loop, fut, fn, args = job
            try:
                result, error = fn(*args), None
            except BaseException as e:
                result, error = None, e
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(_settle, fut, result, error)
            del job, fut, fn, args, result, error  # tensors must not outlive their wait here
            with self._lock:
                self._idle += 1

    def close(self) -> None:
        for _ in self.threads:  # busy ones take theirs when their wait ends
            self._jobs.put(None)


def _settle(fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if not fut.done():
        fut.set_result(result) if error is None else fut.set_exception(error)


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # failures nobody awaits (error replies) must not warn


def _break(pg: Any, rank: int, world: int) -> None:
    """Closes every pair of `pg` so every pending wait on it raises now. gloo has no
    per-wait abort in Python, but a wait that times out signals every pair of its context."""
    for src in (r for r in range(world) if r != rank):
        try:
            work = pg.recv([torch.zeros(1, dtype=torch.uint8)], src, WAKE_TAG)
        except Exception:
            continue  # this pair is closed already (peer gone): try the next one
        with contextlib.suppress(Exception):
            work.wait(timedelta(milliseconds=1))
        break
    with contextlib.suppress(Exception):
        pg.abort()


class _Received(Received):
    """A fetched view; releasing it also tells the sender, which then frees the transfer."""

    __slots__ = ("_inner", "_notify", "buffer")

    def __init__(self, inner: PulledReceived, notify: Callable[[], None]) -> None:
        self.buffer = inner.buffer
        self._inner: PulledReceived | None = inner
        self._notify = notify

    def release(self) -> None:
        inner, self._inner, self.buffer = self._inner, None, _EMPTY
        if inner is not None:
            inner.release()
            self._notify()


class TorchDistRelay(PullRelay):
    name = BACKEND
    options_model = TorchdistOptions
    options: TorchdistOptions

    def __init__(self, settings: RelaySettings | None = None) -> None:
        super().__init__(settings)
        opts = self.options
        self.rank, self.world_size, host, port = _parse(self.settings, opts)
        self._timeout_s = opts.timeout_s
        self._fetch_timeout_s = opts.fetch_timeout_s
        # gloo binds where peers reach us; for a loopback group, loopback (torch's default
        # device picks the hostname's address, which a loopback-only peer may not reach).
        loopback = host in ("localhost", "::1") or host.startswith("127.")
        self._gloo_host = opts.gloo_host or opts.host or (host if loopback else "")
        self._lock = threading.Lock()  # rendezvous thread vs loop: _pg, _done, _waiting
        self._pg: Any = None
        self._error: BaseException | None = None
        self._done = False
        self._waiting: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._bind_loop()
        self._waiters = _Waiters(f"torchdist-wait-r{self.rank}")
        self._tags = itertools.count()
        self._fetched_from: dict[int, int] = {}  # id(descriptor) -> rank, while `get` runs
        # Reply tags: T = FIRST_REPLY_TAG + 2 * (n * world + rank), T + 1 below MAX_TAG.
        self._tag_span = (MAX_TAG - FIRST_REPLY_TAG) // (2 * self.world_size) - 1
        timeout = timedelta(seconds=self._timeout_s)
        self._store: Any = None
        if self.rank == 0:
            # Created here, not in the thread: it does not block (wait_for_workers=False),
            # and port 0 must be resolved before peers are told where to rendezvous.
            try:
                self._store = dist.TCPStore(
                    host, port, self.world_size, True, timeout, wait_for_workers=False
                )
            except Exception as e:
                raise RelayError(
                    f"torchdist relay: cannot host a store at {host}:{port}: {e}"
                ) from e
            port = self._store.port
        self.init_method = f"tcp://{f'[{host}]' if ':' in host else host}:{port}"
        self._label = f"torchdist relay rank {self.rank}/{self.world_size} ({self.init_method})"
        self._threads: list[threading.Thread] = []  # joined (briefly) by close()
        name = f"torchdist-rendezvous-r{self.rank}"
        self._threads.append(_daemon(self._rendezvous, name, self._store, host, port, timeout))

    # ---------------------------------------------------------------- rendezvous

    def _rendezvous(self, store: Any, host: str, port: int, timeout: timedelta) -> None:
        # No long blocking call here: close() must end this thread soon, and a thread that
        # comes back from C++ while the interpreter exits aborts the process. So the store
        # is joined in short tries and every rank checks in (polled) before gloo connects.
        pg = error = None
        deadline, pause = time.monotonic() + self._timeout_s, 0.001
        try:
            while store is None:  # not rank 0: join the store once rank 0 hosts it
                try:  # a plain probe: c10d logs every failed try of its own, with a trace
                    socket.create_connection((host, port), _TRY).close()
                    store = dist.TCPStore(host, port, self.world_size, False, timeout)
                except OSError:
                    pause = self._pause(pause, deadline, "rank 0's store is not up")
            store = dist.PrefixStore(_STORE_PREFIX, store)
            store.add("joined", 1)
            while store.add("joined", 0) < self.world_size:
                pause = self._pause(pause, deadline, "not all ranks joined")
            gloo = dist.ProcessGroupGloo
            opts = gloo._Options()
            opts._timeout = timeout
            dev = self._gloo_host
            opts._devices = [
                gloo.create_device(hostname=dev) if dev else gloo.create_default_device()
            ]
            pg = gloo(store, self.rank, self.world_size, opts)
        except Exception as e:
            error = e
        with self._lock:
            closed = self.closed
            if not closed:
                self._pg = pg
            self._error, self._done = error, True
            waiting, self._waiting = self._waiting, []
        if pg is not None and closed:
            _break(pg, self.rank, self.world_size)  # closed while it rendezvoused
        elif pg is not None:
            for src in (r for r in range(self.world_size) if r != self.rank):
                name = f"torchdist-listen-r{self.rank}-from{src}"
                self._threads.append(_daemon(self._listen, name, pg, src))
        for loop, fut in waiting:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, fut, None, None)

    def _pause(self, pause: float, deadline: float, why: str) -> float:
        if self.closed:
            raise RelayError("closed")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{why} after {self._timeout_s:g}s")
        time.sleep(pause)
        return min(pause * 2, 0.05)

    async def _group(self, timeout: float) -> Any:
        """The process group once the rendezvous is done; RelayError if it failed."""
        if self._pg is not None:
            return self._pg
        self._check_open()
        self._bind_loop()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        with self._lock:
            self._waiting.append((loop, fut)) if not self._done else fut.set_result(None)
        try:
            await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise RelayError(
                f"{self._label}: rendezvous not done after {timeout:g}s "
                "(are all ranks started with this init_method?)"
            ) from None
        self._check_open()
        if self._pg is None:
            raise RelayError(f"{self._label}: rendezvous failed: {self._error}")
        return self._pg

    async def connect(self, timeout: float) -> None:
        await self._group(timeout)

    def _bind_loop(self) -> None:
        # Listener threads hand requests to the loop that owns this relay.
        if self._loop is None or self._loop.is_closed():
            with contextlib.suppress(RuntimeError):
                self._loop = asyncio.get_running_loop()

    def put_nowait(self, packed: Packed, request_id: str, edge: str) -> PulledHandle | None:
        self._bind_loop()  # `put` comes through here too
        return super().put_nowait(packed, request_id, edge)

    # ---------------------------------------------------------------- peers

    def _info(self) -> dict[str, Any]:
        return {"rank": self.rank, "world": self.world_size}

    def _add_peer(self, peer_id: str, info: dict[str, Any]) -> int:
        rank = info.get("rank")
        if info.get("world") != self.world_size or type(rank) is not int:
            raise ValueError("not of this group")
        if not 0 <= rank < self.world_size or rank == self.rank:
            raise ValueError(f"bad rank {rank}")
        return rank

    # ---------------------------------------------------------------- sender side

    def _listen(self, pg: Any, src: int) -> None:
        while True:
            message = torch.zeros(6, dtype=torch.int64)
            try:
                if not pg.recv([message], src, MESSAGE_TAG).wait(_FOREVER):
                    return
            except Exception:
                return  # the pair is closed: `src` died, or close() broke the group
            loop = self._loop
            if self.closed:
                return
            try:
                if loop is not None:
                    loop.call_soon_threadsafe(self._on_message, pg, src, message.tolist())
            except RuntimeError:
                pass  # no live loop owns the relay (yet): nobody could serve this one

    def _on_message(self, pg: Any, src: int, message: list[int]) -> None:
        kind, tid, offset, nbytes, tag, rank = message
        if rank != src or self.closed or pg is not self._pg:
            return  # not from a peer of ours
        if kind == _RELEASED:
            # Only the rank it was served to may release it (the pair is that rank's own
            # connection from the rendezvous); its credit and extent come back.
            self.served(tid, str(src))
        elif kind == _FETCH and FIRST_REPLY_TAG <= tag < MAX_TAG:
            self._serve(pg, src, tid, offset, nbytes, tag)

    def _serve(self, pg: Any, src: int, tid: int, offset: int, nbytes: int, tag: int) -> None:
        # Bound to the first rank that fetches it: any other rank gets GONE, and nothing.
        view = self.source(tid, offset, nbytes, str(src))
        data = torch.from_numpy(view) if view is not None else torch.empty(0, dtype=torch.uint8)
        status = torch.tensor([_GONE if view is None else _OK, nbytes], dtype=torch.int64)
        try:
            # The receiver posted both receives before asking, so these go out at once.
            works = [pg.send([data], src, tag + 1), pg.send([status], src, tag)]
        except Exception:
            if view is not None:
                self.end_send(tid)
            return  # the pair is closed: the receiver's wait fails too
        done = self._waiters.run(asyncio.get_running_loop(), self._wait, works)
        if view is not None:
            done.add_done_callback(lambda _: self.end_send(tid))

    def _wait(self, works: list[Any]) -> None:
        """Runs in a waiter thread. A gloo timeout closes the group's pairs (the group is
        broken then), so the bound is the one for a whole transfer, never a poll."""
        deadline = time.monotonic() + self._fetch_timeout_s
        for work in works:
            left = max(deadline - time.monotonic(), 0.001)
            if not work.wait(timedelta(seconds=left)):
                raise RuntimeError("gloo wait aborted")

    # ---------------------------------------------------------------- receiver side

    def _reply_tag(self) -> int:
        n = next(self._tags) % self._tag_span
        return FIRST_REPLY_TAG + 2 * (n * self.world_size + self.rank)

    async def _fetch(
        self, peer: Any, descriptor: common_pb2.RelayDescriptor, target: HostExtent
    ) -> None:
        pg = await self._group(self._timeout_s)
        src, tid, nbytes = int(peer), descriptor.transfer_id, descriptor.nbytes
        what = f"{self._label}: transfer {tid} ({nbytes} bytes) from rank {src}"
        if tid >= 1 << 63:
            raise RelayError(f"{what}: no such transfer")
        tag = self._reply_tag()
        status = torch.zeros(2, dtype=torch.int64)
        message = [_FETCH, tid, descriptor.offset, nbytes, tag, self.rank]
        request = torch.tensor(message, dtype=torch.int64)
        try:
            works = [
                pg.recv([torch.from_numpy(target.view(nbytes))], src, tag + 1),
                pg.recv([status], src, tag),
                pg.send([request], src, MESSAGE_TAG),
            ]
        except Exception as e:
            raise RelayError(f"{what} failed (group broken, peer gone?): {e}") from e
        done = self._waiters.run(asyncio.get_running_loop(), self._wait, works)
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            # gloo may still write into `target`, whose extent `get` frees on the way out:
            # let the waits end first (bounded by fetch_timeout_s; close() ends them now).
            while not done.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([done])
            raise
        except Exception as e:
            raise RelayError(f"{what} failed (peer gone or timed out): {e}") from e
        if status.tolist() != [_OK, nbytes]:
            raise RelayError(
                f"{what}: the sender has no such live transfer for this rank (released, "
                "guessed, or another rank's)"
            )
        self.bytes_in += nbytes
        self._fetched_from[id(descriptor)] = src

    async def get(
        self, descriptor: common_pb2.RelayDescriptor, owners: frozenset[str] | None = None
    ) -> Received:
        key = id(descriptor)  # `_fetch` says which rank it fetched from (peers may change)
        try:
            received = await super().get(descriptor, owners)
        finally:
            src = self._fetched_from.pop(key, None)
        if src is None:
            return received  # 0 bytes: nothing held on the sender
        notice = [_RELEASED, descriptor.transfer_id, descriptor.offset, descriptor.nbytes, 0]
        return _Received(received, lambda: self._notify(src, [*notice, self.rank]))

    def _notify(self, dst: int, message: list[int]) -> None:
        pg, loop = self._pg, self._loop
        if pg is None or loop is None or self.closed:
            return  # the sender learns nothing more from a closed relay; cleanup frees it
        try:
            work = pg.send([torch.tensor(message, dtype=torch.int64)], dst, MESSAGE_TAG)
        except Exception:
            return  # the pair is closed: the sender is gone (or cleans up after us)
        # The Work must live until it completes: gloo stalls a pair whose send vanished.
        self._waiters.run(loop, self._wait, [work])

    # ---------------------------------------------------------------- lifetime

    def _close_backend(self) -> None:
        with self._lock:  # `closed` is set: a rendezvous finishing now breaks its own group
            pg, self._pg = self._pg, None
            waiting, self._waiting = self._waiting, []
        for loop, fut in waiting:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, fut, None, None)
        if pg is not None:
            _break(pg, self.rank, self.world_size)  # wakes listeners and pending waits
        self._waiters.close()
        self._store = None
        # Let the threads woken above leave gloo now: one coming back from C++ while the
        # interpreter exits (a relay closed just before exit) aborts the process. A send to
        # a dead peer (gloo never fails it) ends only at fetch_timeout_s: not waited for.
        deadline = time.monotonic() + _JOIN_S
        for thread in [*self._threads, *self._waiters.threads]:
            if thread is not threading.current_thread():
                thread.join(max(deadline - time.monotonic(), 0))
