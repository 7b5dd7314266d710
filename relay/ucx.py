"""`ucx` relay: the receiver pulls each payload from the sender's pool over UCX (ucxx).

Each relay owns a UCX worker and publishes its worker address (and `host`, for messages);
there is no connection listener. A receiver keeps one endpoint per sender, opened from the
sender's announced worker address (on first use, again after an error); its first message
(HELLO, on a fixed tag) names a tag of its own, and its requests are tagged messages on
that tag. The sender answers on a reply endpoint of its own per peer, opened from that
peer's announced worker address. For GET(transfer id, offset, nbytes, tag) the receiver
first posts two tagged receives: the payload, straight into its receive extent, on
`tag + 1` and an error status on `tag`. The sender answers a live transfer with its pool
bytes only (on one host by cma: the receiver reads the sender's memory, one copy),
anything else with the status only; the receive left unmatched is then cancelled, cleanly
since nothing can match it any more. Concurrent GETs share the endpoints: their tags tell
the replies apart. The receiver reports a transfer when it releases the view (riding on its
next GET to that sender, else in a DONE), and only then does the sender release it
(`served`): as with shm's release marks, edge credit bounds what receivers hold, not only
what is in flight.

ucxx's asyncio layer waits for a request by spinning the loop unless a notifier thread runs;
this module drives its worker from the owning loop instead (relay/ucx_engine.py). Option `progress`:
"blocking" (default) progresses when the worker's epoll fd fires, then re-arms it;
"polling" spins the loop unarmed while transfers are in flight (faster on idle cores only).
A cma read runs inside progress, on the loop thread. Endpoints use peer error handling and
UCX keepalive (every second unless UCX_KEEPALIVE_INTERVAL is set), so a dead peer fails its
requests within about a second (over shared memory UCX checks that the process exists: one
that died but was not yet reaped, a zombie, still counts); `fetch_timeout_s` (default 30)
bounds any fetch.
`host`: the published address (default 127.0.0.1); `listen`: an address of the interface
UCX's transports listen on (default `host`; "0.0.0.0": all); `ucx_config`: UCX settings of
this relay's context (e.g. {"TLS": "tcp"}). Host memory only. Options are
`omnirail.relay.options.UcxOptions` (defaults there).

Trust. Each relay makes a random key and publishes only its sha256 in `local_info()`. A
receiver's HELLO carries its peer id and key; the sender takes up its request tag only if
the id is an announced (and trusted) peer whose digest the key matches
(`hmac.compare_digest`), and ignores it otherwise: an unregistered process's fetch fails
with RelayError after its `fetch_timeout_s` (nothing answers it) and nothing is read from or
sent to it. (A HELLO from an id not announced yet is kept for `peer_wait_s` and taken up if
the announcement comes meanwhile and the key proves it: announcements race.) Replies go
only to the proven peer's announced worker address, never to one a message carries, so a
HELLO cannot redirect bytes elsewhere. A GET is served only for a live transfer id (random)
with its exact extent, and binds the transfer to the first peer served; another peer, a
guessed or a released id gets the status, no bytes; only that peer's release frees it. No
socket listens on every address: without a connection listener, the only listening
sockets are those of UCX's transports, limited to the interface of `listen` (UCX
NET_DEVICES, unless set in `ucx_config` or UCX_NET_DEVICES). What does not hold: the key
and the request tag travel in clear like the payloads (use a private network or
TLS-capable transports for confidentiality on the wire), and the receiver does not
authenticate the sender beyond its announced worker address.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import itertools
import logging
import os
import secrets
import struct
import time
from dataclasses import dataclass, field
from typing import Any

# ucxx sets UCX_MEMTYPE_CACHE, which this UCX no longer knows: it would warn in every process.
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import ucxx  # ImportError here: the backend is unavailable
import ucxx._lib.libucxx as ucx_api
from ucxx._lib.arr import Array
from ucxx.types import Tag

from omnirail.relay.base import Received, RelayError, RelaySettings, shown
from omnirail.relay.host_pool import HostExtent
from omnirail.relay.netif import listen_device
from omnirail.relay.options import UcxOptions
from omnirail.relay.pull import PEER_ID_RE, PulledHandle, PullRelay
from omnirail.relay.ucx_engine import CLOSE_S, Engine
from omnirail.v1 import common_pb2
from omnirail.wire.payload import Packed

__all__ = ["UcxReceived", "UcxRelay"]

BACKEND = "ucx"
log = logging.getLogger(__name__)

# Requests: op and five numbers. GET: transfer id, offset, nbytes, reply tag, and a released
# transfer id riding along (0: none); DONE: up to five released ids (HELLO: _HELLO_MSG).
_REQ = struct.Struct("<B7x5Q")
_GET, _DONE, _HELLO = 1, 2, 3
# HELLO, on tag _HELLO_TAG: op, request tag, the relay key proving the peer id that follows
# (ascii, NUL-padded: a tagged receive does not tell how much arrived).
_ID_BYTES = 200
_HELLO_MSG = struct.Struct(f"<B7xQ32s{_ID_BYTES}s")
_KEY_BYTES = 32
_MAX_ADDRESS = 1 << 16  # a UCX worker address is a few hundred bytes
_EARLY = 64  # HELLOs kept from ids not announced yet (the newest)
_NOT_LIVE = struct.pack("<Q", 1)  # the only status: a live transfer gets its bytes instead
_CTL = 1 << 63  # set in request tags, clear in reply tags
_HELLO_TAG = _CTL  # request tags are _CTL and 63 random bits, never all zero
# cma rendezvous (one copy) under peer error handling: UCX allows it only where the memory
# domain claims invalidation (the sender keeps the extent until its send completes anyway);
# without the mm error handling even endpoints on one host would use tcp. Keepalive every
# second: endpoints opened by worker address have no connection socket whose end would tell
# that the peer died (over shared memory nothing else does). Each applies only where its
# UCX_* variable is unset.
_UCX_DEFAULTS = dict(
    CMA_MEMORY_INVALIDATE="y",
    POSIX_ERROR_HANDLING="y",
    SYSV_ERROR_HANDLING="y",
    KEEPALIVE_INTERVAL="1s",
)


@dataclass(eq=False, slots=True)
class _Peer:
    id: str
    host: str  # published address: for messages only
    address: bytes  # its UCX worker address: the only way to reach it
    digest: bytes  # sha256 of its key: what its HELLO must prove
    # Receiver side: our endpoint to it, and the tag of our requests on it.
    ep: Any = None
    ctl: int = 0
    gen: int = 0  # which endpoint a close callback is about
    done: list[int] = field(default_factory=list)  # released transfers not yet reported
    # Sender side: our reply endpoint to it, and its requests as we receive them.
    reply: Any = None
    reply_gen: int = 0
    conn: _Conn | None = None

    @property
    def where(self) -> str:
        return f"{shown(self.id)} at {self.host}"


@dataclass(eq=False, slots=True)
class _Conn:
    """A proven peer's requests as the sender receives them: tag, buffer, posted receive."""

    peer: _Peer
    ctl: int
    req: Any = None
    buf: bytearray = field(default_factory=lambda: bytearray(_REQ.size))


class UcxReceived(Received):
    """A pulled view; releasing it reports the transfer to its sender."""

    __slots__ = ("_inner", "_peer", "_relay", "_tid", "buffer")

    def __init__(self, relay: UcxRelay, inner: Received, peer: _Peer, tid: int) -> None:
        self.buffer = inner.buffer
        self._inner: Received | None = inner
        self._relay, self._peer, self._tid = relay, peer, tid

    def release(self) -> None:
        inner, self._inner = self._inner, None
        if inner is not None:
            self.buffer = inner.buffer = memoryview(b"")
            inner.release()
            self._relay._done(self._peer, self._tid)


class UcxRelay(PullRelay):
    name = BACKEND
    options_model = UcxOptions
    options: UcxOptions

    def __init__(self, settings: RelaySettings | None = None) -> None:
        super().__init__(settings)
        opts = self.options
        self._host = opts.host or "127.0.0.1"
        self._fetch_timeout_s = opts.fetch_timeout_s
        # Proves this relay's peer id to senders (in every HELLO); peers see only its
        # digest, in `local_info()`.
        self._key = secrets.token_bytes(_KEY_BYTES)
        mode = opts.progress
        config = {k: v for k, v in _UCX_DEFAULTS.items() if f"UCX_{k}" not in os.environ}
        if "NET_DEVICES" not in opts.ucx_config and "UCX_NET_DEVICES" not in os.environ:
            # UCX's transports listen on every network device it uses: only the one that
            # has the mesh's address (shared memory and cma are not net devices).
            device = listen_device(BACKEND, opts.listen, self._host)
            if device is not None:
                config["NET_DEVICES"] = device
        config.update(opts.ucx_config)
        self._tags = itertools.count(1)
        self._ctls: dict[int, _Conn] = {}  # request tags taken up, by tag
        self._closing: list[_Peer] = []  # dropped on close: served until `_close_backend`
        self._refused = 0  # HELLOs that proved no registered peer
        # HELLOs from ids not announced (yet): id -> (request tag, key, until). A receiver
        # may be announced to us after it was to the stage that sends it our descriptors.
        self._early: dict[str, tuple[int, bytes, float]] = {}
        self._hello_req: Any = None
        try:
            self._eng = Engine(config, polling=mode == "polling")
            # Peers connect to this worker by its address: no connection listener.
            self._address = bytes(self._eng.worker.address.tobytes())
            self._await_hello()  # completes once the worker progresses on a loop
        except ucxx.exceptions.UCXError as e:
            raise RelayError(f"ucx relay: cannot start UCX: {e}") from e
        self._eng.attach()

    # ---------------------------------------------------------------- peers

    def _info(self) -> dict[str, Any]:
        key = hashlib.sha256(self._key).digest()
        return {"host": self._host, "address": self._address, "key": key}

    def _add_peer(self, peer_id: str, info: dict[str, Any]) -> _Peer:
        host, address, digest = info.get("host"), info.get("address"), info.get("key")
        if not isinstance(host, str) or not 0 < len(host) <= 255:
            raise ValueError("bad host")
        if not isinstance(address, bytes) or not 0 < len(address) <= _MAX_ADDRESS:
            raise ValueError("bad worker address")
        if not isinstance(digest, bytes) or len(digest) != hashlib.sha256().digest_size:
            raise ValueError("bad key digest")
        return _Peer(peer_id, host, address, digest)

    def set_peers(self, infos: list[bytes]) -> None:
        super().set_peers(infos)
        # HELLOs that came before their peer's announcement: taken up if they prove it now.
        now = time.monotonic()
        for peer_id, (ctl, key, until) in list(self._early.items()):
            if until < now:
                del self._early[peer_id]
            elif peer_id in self._peers:
                del self._early[peer_id]
                self._check_hello(peer_id, ctl, key, early=False)

    def _drop_peer(self, peer_id: str, state: Any) -> None:
        if not isinstance(state, _Peer):
            return
        if state.ep is not None:
            self._reset(state, state.ep)
        # It left (or is no longer trusted): its requests are served no more. (On close,
        # `_close_backend` ends them, after letting sends drain.)
        if self.closed:
            self._closing.append(state)
            return
        if state.conn is not None:
            self._drop_conn(state.conn)
        if state.reply is not None:
            ep, state.reply = state.reply, None
            self._close_ep(ep)

    async def connect(self, timeout: float) -> None:
        # Nothing to wait for: HELLOs are awaited since __init__, and endpoints open on
        # first use (a mesh announces every process; a receiver fetches from few of them).
        self._check_open()
        self._eng.attach()

    def _open(self, peer: _Peer) -> Any:
        """A new endpoint to `peer`'s announced worker address (never another one)."""
        try:
            address = ucx_api.UCXAddress.create_from_buffer(peer.address)
            return ucx_api.UCXEndpoint.create_from_worker_address(self._eng.worker, address, True)
        except Exception as e:
            raise RelayError(f"ucx relay: cannot reach {peer.where}: {e}") from e

    def _endpoint(self, peer: _Peer) -> Any:
        if peer.ep is not None and peer.ep.alive:
            return peer.ep
        if peer.ep is not None:
            self._reset(peer, peer.ep)
        ep = self._open(peer)
        peer.gen += 1
        ep.set_close_callback(self._lost, (peer, peer.gen))
        # Requests are tagged messages on a tag of this endpoint's own that the HELLO names:
        # the sender takes it up once the HELLO proves who we are.
        peer.ep, peer.ctl = ep, _CTL | (secrets.randbits(63) or 1)
        ident = self.peer_id.encode().ljust(_ID_BYTES, b"\0")
        self._eng.send(ep, _HELLO_MSG.pack(_HELLO, peer.ctl, self._key, ident), _HELLO_TAG)
        return ep

    def _lost(self, peer: _Peer, gen: int) -> None:
        # Runs inside worker progress: the endpoint is closed from the loop, later.
        if peer.gen == gen and peer.ep is not None:
            ep, peer.ep = peer.ep, None  # the next fetch opens a new endpoint
            if not self.closed and self._eng.loop is not None:
                self._eng.loop.call_soon(self._close_ep, ep)

    def _reset(self, peer: _Peer, ep: Any) -> None:
        if peer.ep is ep:
            peer.ep = None
        self._close_ep(ep)

    @staticmethod
    def _close_ep(ep: Any) -> None:
        # Synchronous: ucxx's non-blocking close may return no request at all (a segfault
        # on use). With error handling the close is forced, so it returns at once; it also
        # ends every request on the endpoint, so none writes into a freed extent later.
        ep.remove_close_callback()
        ep.close_blocking(period=int(CLOSE_S * 1e9), max_attempts=1)

    # ---------------------------------------------------------------- sender side

    def put_nowait(self, packed: Packed, request_id: str, edge: str) -> PulledHandle | None:
        self._eng.attach()  # `put` starts here too; receivers' requests come via this loop
        return super().put_nowait(packed, request_id, edge)

    def _await_hello(self) -> None:
        # One worker-wide receive on the HELLO tag, posted again after each HELLO. Dropping
        # the last reference to it (`Engine.close`) cancels it.
        buf = bytearray(_HELLO_MSG.size)
        req = self._eng.worker.tag_recv(Array(buf), Tag(_HELLO_TAG))
        self._hello_req = req
        self._eng.track(req, functools.partial(self._hello, buf), buf, False)

    def _hello(self, buf: bytearray, err: BaseException | None) -> None:
        # Runs after worker progress, on the loop. Whoever sent it gets no answer here:
        # replies go only to a proven peer's announced address, on its own requests.
        self._hello_req = None
        if self.closed or self._eng.worker is None:
            return
        self._await_hello()
        if err is not None:  # longer than any HELLO (truncated)
            self._refuse("?")
            return
        op, ctl, key, ident = _HELLO_MSG.unpack(buf)
        peer_id = ident.rstrip(b"\0").decode("ascii", "replace")
        if op != _HELLO or not ctl & _CTL or ctl == _HELLO_TAG or not PEER_ID_RE.fullmatch(peer_id):
            self._refuse(peer_id)
        else:
            self._check_hello(peer_id, ctl, key, early=True)

    def _check_hello(self, peer_id: str, ctl: int, key: bytes, early: bool) -> None:
        peer = self._peers.get(peer_id)
        if peer is None and early:
            # Not announced (yet): kept for `peer_wait_s`, taken up if its announcement
            # comes meanwhile and the key proves it (`set_peers`). Nothing is answered.
            self._early.pop(peer_id, None)
            while len(self._early) >= _EARLY:
                del self._early[next(iter(self._early))]
            self._early[peer_id] = (ctl, key, time.monotonic() + self._peer_wait_s)
            self._refuse(peer_id)
            return
        taken = self._ctls.get(ctl)
        digest = hashlib.sha256(key).digest()
        if (
            isinstance(peer, _Peer)
            and hmac.compare_digest(digest, peer.digest)
            and (taken is None or taken.peer is peer)
        ):
            self._take_up(peer, ctl)
        else:
            self._refuse(peer_id)

    def _refuse(self, peer_id: str) -> None:
        self._refused += 1
        if self._refused & (self._refused - 1) == 0:  # 1st, 2nd, 4th...: no log flood
            log.warning(
                "ucx relay: refused a HELLO announcing %s: not a registered peer (yet), or "
                "its key does not match (%d refused so far)",
                shown(peer_id),
                self._refused,
            )

    def _take_up(self, peer: _Peer, ctl: int) -> None:
        # A peer's new endpoint replaces its old one (the receiver keeps one per sender).
        if peer.conn is not None:
            if peer.conn.ctl == ctl:
                return
            self._drop_conn(peer.conn)
        conn = peer.conn = _Conn(peer, ctl)
        self._ctls[ctl] = conn
        self._listen(conn)

    def _drop_conn(self, conn: _Conn) -> None:
        if conn.peer.conn is conn:
            conn.peer.conn = None
        if self._ctls.get(conn.ctl) is conn:
            del self._ctls[conn.ctl]
        req, conn.req = conn.req, None
        if req is not None:
            self._eng.forget(req)  # its last reference: ucxx cancels it

    def _listen(self, conn: _Conn) -> None:
        if self.closed or self._ctls.get(conn.ctl) is not conn:
            return
        try:
            conn.req = self._eng.worker.tag_recv(Array(conn.buf), Tag(conn.ctl))
        except Exception:
            self._drop_conn(conn)
            return
        self._eng.track(conn.req, functools.partial(self._on_request, conn), conn.buf, False)

    def _on_request(self, conn: _Conn, err: BaseException | None) -> None:
        conn.req = None
        if self.closed or self._ctls.get(conn.ctl) is not conn:
            return
        if err is not None:
            # Longer than any request (truncated): not ours to answer; the next one may be.
            self._listen(conn)
            return
        op, *nums = _REQ.unpack(conn.buf)
        self._listen(conn)
        if op == _GET:
            self._serve(conn.peer, *nums[:4])
            nums = nums[4:]
        if op in (_GET, _DONE):
            for tid in filter(None, nums):
                self.served(tid, conn.peer.id)  # only the peer it was served to releases it

    def _reply_ep(self, peer: _Peer) -> Any:
        """Our endpoint to `peer`'s announced worker address (opened on first use, again
        after an error): every answer to its requests goes there."""
        if peer.reply is not None and peer.reply.alive:
            return peer.reply
        if peer.reply is not None:
            ep, peer.reply = peer.reply, None
            self._close_ep(ep)
        ep = self._open(peer)
        peer.reply_gen += 1
        ep.set_close_callback(self._reply_lost, (peer, peer.reply_gen))
        peer.reply = ep
        return ep

    def _reply_lost(self, peer: _Peer, gen: int) -> None:
        # Runs inside worker progress: closed from the loop; the next answer opens another.
        if peer.reply_gen == gen and peer.reply is not None:
            ep, peer.reply = peer.reply, None
            if not self.closed and self._eng.loop is not None:
                self._eng.loop.call_soon(self._close_ep, ep)

    def _serve(self, peer: _Peer, tid: int, offset: int, nbytes: int, tag: int) -> None:
        # Bound to the first peer that fetches it: any other gets the status, no bytes.
        src = self.source(tid, offset, nbytes, peer.id)
        try:
            ep = self._reply_ep(peer)
            if src is None:
                self._eng.send(ep, _NOT_LIVE, tag)
                return
            req = ep.tag_send(Array(src), Tag((tag + 1) & 0xFFFF_FFFF_FFFF_FFFF))
        except Exception as e:  # the peer is unreachable: its fetch fails on its side
            log.debug("ucx relay: cannot answer %s: %s", peer.where, e)
            if src is not None:
                self.end_send(tid)
            return
        self._eng.track(req, lambda err: self.end_send(tid), src)

    # ---------------------------------------------------------------- receiver side

    async def get(
        self, descriptor: common_pb2.RelayDescriptor, owners: frozenset[str] | None = None
    ) -> Received:
        received = await super().get(descriptor, owners)
        peer = self._peers.get(descriptor.region)
        if not descriptor.nbytes or not isinstance(peer, _Peer):
            return received  # nothing to report
        return UcxReceived(self, received, peer, descriptor.transfer_id)

    async def _fetch(
        self, peer: _Peer, descriptor: common_pb2.RelayDescriptor, target: HostExtent
    ) -> None:
        eng = self._eng
        eng.attach()
        ep = self._endpoint(peer)
        tid, nbytes, where = descriptor.transfer_id, descriptor.nbytes, peer.where
        tag = (next(self._tags) << 1) & (_CTL - 2)
        status, body = bytearray(len(_NOT_LIVE)), target.view(nbytes)
        done = peer.done.pop() if peer.done else 0  # rides along: saves the sender a wakeup
        first: asyncio.Future[int] | None = None
        try:
            # Posted on our endpoint (the replies come on the sender's own): closing it
            # ends them.
            head_req = ep.tag_recv(Array(status), Tag(tag))
            body_req = ep.tag_recv(Array(body), Tag(tag + 1))
            first = eng.first((head_req, status), (body_req, body))
            eng.send(ep, _REQ.pack(_GET, tid, descriptor.offset, nbytes, tag, done), peer.ctl)
        except Exception as e:
            peer.done += [done] if done else []
            if first is not None:
                first.cancel()  # its requests end with the endpoint
            self._reset(peer, ep)
            raise RelayError(f"ucx relay: request to {where} failed: {e}") from e
        which = -1
        try:
            async with asyncio.timeout(self._fetch_timeout_s):
                which = await first
        except TimeoutError:
            raise RelayError(
                f"ucx relay: no answer from {where} within {self._fetch_timeout_s:g} s "
                f"for transfer {tid} (not a registered peer there?)"
            ) from None
        except Exception as e:
            raise RelayError(f"ucx relay: fetch from {where} failed (peer gone?): {e}") from e
        finally:
            if which < 0 and not body_req.completed:
                # Maybe matched and still being written into `target`, which the caller
                # frees now: closing the endpoint ends every request on it first.
                self._reset(peer, ep)
            eng.forget(head_req)  # the sender sends one of the two: the other is cancelled
            eng.forget(body_req)
            if first.done() and not first.cancelled():
                first.exception()  # retrieved: no "never retrieved" warning
            first.cancel()
        if which == 0:
            raise RelayError(
                f"ucx relay: transfer {tid} is not live at {descriptor.region!r} for this "
                "peer (released, aborted, guessed, another peer's, or a wrong descriptor)"
            )
        self.bytes_in += nbytes

    def _done(self, peer: _Peer, tid: int) -> None:
        """Reports released transfer `tid` with the next GET to its sender, or in a DONE
        when the loop comes round without one."""
        loop = self._eng.loop
        if self.closed or loop is None or loop.is_closed() or self._peers.get(peer.id) is not peer:
            return  # a dropped peer: the sender's cleanup frees its transfers
        peer.done.append(tid)
        if len(peer.done) == 1:
            loop.call_soon(self._flush_done, peer)

    def _flush_done(self, peer: _Peer) -> None:
        while peer.done and not self.closed:
            tids, peer.done = peer.done[:5], peer.done[5:]
            try:
                ep = self._endpoint(peer)
                self._eng.send(ep, _REQ.pack(_DONE, *tids, *[0] * (5 - len(tids))), peer.ctl)
            except Exception as e:  # sender gone: its cleanup frees the transfers
                log.debug("ucx relay: releases %s not delivered: %s", tids, e)

    # ---------------------------------------------------------------- lifetime

    def _close_backend(self) -> None:
        self._eng.drain()
        for conn in list(self._ctls.values()):
            self._drop_conn(conn)
        closing, self._closing = self._closing, []
        for peer in closing:
            if peer.reply is not None:
                ep, peer.reply = peer.reply, None
                self._close_ep(ep)
        self._hello_req = None
        self._early.clear()
        self._eng.close(f"{self.name} relay closed")
