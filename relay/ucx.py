"""`ucx` relay: the receiver pulls each payload from the sender's pool over UCX (ucxx).

Each relay owns a UCX worker listening on option `port` (0: any) and publishes {"host",
"port"}. A receiver keeps one endpoint per sender (opened on first use, again after an
error); its one active message (HELLO) names a tag, and its requests are tagged messages on
it. For GET(transfer id, offset, nbytes, tag) the receiver first posts two tagged receives:
the payload, straight into its receive extent, on `tag + 1` and an error status on `tag`.
The sender answers a live transfer with its pool bytes only (on one host by cma: the
receiver reads the sender's memory, one copy), anything else with the status only; the
receive left unmatched is then cancelled, cleanly since nothing can match it any more.
Concurrent GETs share the endpoint: their tags tell the replies apart. The receiver reports a
transfer when it releases the view (riding on its next GET to that sender, else in a DONE),
and only then does the sender release it (`served`): as with shm's release marks, edge
credit bounds what receivers hold, not only what is in flight.

ucxx's asyncio layer waits for a request by spinning the loop unless a notifier thread runs;
this module drives its worker from the owning loop instead (relay/ucx_engine.py). Option `progress`:
"blocking" (default) progresses when the worker's epoll fd fires, then re-arms it;
"polling" spins the loop unarmed while transfers are in flight (faster on idle cores only).
A cma read runs inside progress, on the loop thread. Endpoints use peer error handling, so
a dead peer fails its requests at once; `fetch_timeout_s` (default 30) bounds any fetch.
`host`: the published address (default 127.0.0.1); `listen`: an address of the interface
UCX's transports listen on (default `host`; "0.0.0.0": all); `ucx_config`: UCX settings of
this relay's context (e.g. {"TLS": "tcp"}). Host memory only. Options are
`omnirail.relay.options.UcxOptions` (defaults there).

Trust. Each relay makes a random key and publishes only its sha256 in `local_info()`. The
first message on a receiver's endpoint (HELLO) carries its peer id and key; the sender
serves that endpoint only if the id is an announced (and trusted) peer whose digest the key
matches (`hmac.compare_digest`), and closes it otherwise: an unregistered process's fetch
fails with RelayError and nothing is read from or sent to it. A GET is served only for a
live transfer id (random) with its exact extent, and binds the transfer to the first peer
served; another peer, a guessed or a released id gets the status, no bytes; only that peer's
release frees it. The transports' listeners are limited to the interface of `listen` (UCX
NET_DEVICES, unless set in `ucx_config` or UCX_NET_DEVICES); what does not hold: the
connection listener on `port` still binds every address (ucxx 0.52 takes no address for
it), and the key travels in clear like the payloads (use a private network or TLS-capable
transports for confidentiality on the wire). The receiver does not authenticate the sender
beyond its announced address.
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
# HELLO: op, request tag, the relay key proving the peer id that follows (utf-8).
_HELLO_MSG = struct.Struct("<B7xQ32s")
_KEY_BYTES = 32
_NOT_LIVE = struct.pack("<Q", 1)  # the only status: a live transfer gets its bytes instead
_CTL = 1 << 63  # set in request tags, clear in reply tags
# cma rendezvous (one copy) under peer error handling: UCX allows it only where the memory
# domain claims invalidation (the sender keeps the extent until its send completes anyway);
# without the mm error handling even endpoints on one host would use tcp. Each applies only
# where its UCX_* variable is unset.
_UCX_DEFAULTS = dict(CMA_MEMORY_INVALIDATE="y", POSIX_ERROR_HANDLING="y", SYSV_ERROR_HANDLING="y")


@dataclass(eq=False, slots=True)
class _Peer:
    id: str
    host: str
    port: int
    digest: bytes  # sha256 of its key: what its HELLO must prove
    ep: Any = None
    ctl: int = 0  # tag of our requests on `ep`
    gen: int = 0  # which endpoint a close callback is about
    done: list[int] = field(default_factory=list)  # released transfers not yet reported


@dataclass(eq=False, slots=True)
class _Conn:
    """A receiver's endpoint as the sender sees it: request buffer and tag."""

    ep: Any
    ctl: int = 0  # 0: its HELLO has not come yet
    peer: str = ""  # the peer id its HELLO proved
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
        # Proves this relay's peer id to senders (first message on every endpoint); peers
        # see only its digest, in `local_info()`.
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
        self._conns: set[_Conn] = set()
        self._greeting: set[_Conn] = set()  # accepted, HELLO not read yet
        self._refused = 0  # connections whose HELLO proved no registered peer
        try:
            self._eng = Engine(config, polling=mode == "polling")
            # Needs no loop: connection requests wait until the worker progresses.
            self._listener: Any = ucx_api.UCXListener.create(
                self._eng.worker, opts.port, self._accept, deliver_endpoint=True
            )
        except ucxx.exceptions.UCXError as e:
            raise RelayError(f"ucx relay: cannot start UCX: {e}") from e
        self.port = int(self._listener.port)
        self._eng.attach()

    # ---------------------------------------------------------------- peers

    def _info(self) -> dict[str, Any]:
        key = hashlib.sha256(self._key).digest()
        return {"host": self._host, "port": self.port, "key": key}

    def _add_peer(self, peer_id: str, info: dict[str, Any]) -> _Peer:
        host, port, digest = info.get("host"), info.get("port"), info.get("key")
        if not isinstance(host, str) or not 0 < len(host) <= 255:
            raise ValueError("bad host")
        if not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError("bad port")
        if not isinstance(digest, bytes) or len(digest) != hashlib.sha256().digest_size:
            raise ValueError("bad key digest")
        return _Peer(peer_id, host, port, digest)

    def _drop_peer(self, peer_id: str, state: Any) -> None:
        if isinstance(state, _Peer) and state.ep is not None:
            self._reset(state, state.ep)
        # It left (or is no longer trusted): its endpoints to us are served no more. (On
        # close, `_close_backend` closes them all, after letting sends drain.)
        if not self.closed:
            for conn in [c for c in self._conns if c.peer == peer_id]:
                self._drop_conn(conn)

    async def connect(self, timeout: float) -> None:
        # Nothing to wait for: the listener is up since __init__, and endpoints open on
        # first use (a mesh announces every process; a receiver fetches from few of them).
        self._check_open()
        self._eng.attach()

    def _endpoint(self, peer: _Peer) -> Any:
        if peer.ep is not None and peer.ep.alive:
            return peer.ep
        if peer.ep is not None:
            self._reset(peer, peer.ep)
        try:
            ep = ucx_api.UCXEndpoint.create(self._eng.worker, peer.host, peer.port, True)
        except Exception as e:
            raise RelayError(f"ucx relay: cannot reach {peer.host}:{peer.port}: {e}") from e
        peer.gen += 1
        ep.set_close_callback(self._lost, (peer, peer.gen))
        # Requests are tagged messages on a tag of this endpoint's own that the HELLO names:
        # the sender learns which endpoint asks without a posted stream or AM receive (ucxx
        # never frees a worker that had one).
        peer.ep, peer.ctl = ep, _CTL | secrets.randbits(63)
        hello = _HELLO_MSG.pack(_HELLO, peer.ctl, self._key) + self.peer_id.encode()
        self._eng.send(ep, hello)
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

    def _accept(self, ep: Any) -> None:
        # Runs inside worker progress: the HELLO is looked for after it (`_greet`).
        if self.closed or self._eng.loop is None:
            ep.close_blocking(period=0, max_attempts=1)
            return
        conn = _Conn(ep)
        ep.set_close_callback(self._conn_lost, (conn,))
        self._conns.add(conn)
        self._greeting.add(conn)
        self._eng.poll = self._greet

    def _greet(self) -> bool:
        # Receives only a probed message, so no AM receive is ever left posted.
        ready = [c for c in self._greeting if c.ep.am_probe()]
        for conn in ready:
            self._greeting.discard(conn)
            req = conn.ep.am_recv()
            if req.completed:
                self._hello(conn, req, None)
            else:
                self._eng.track(req, functools.partial(self._hello, conn, req), None, False)
        if not self._greeting:
            self._eng.poll = None
        return bool(ready)

    def _hello(self, conn: _Conn, req: Any, err: BaseException | None) -> None:
        buf = None if err else req.recv_buffer
        size = _HELLO_MSG.size
        if buf is not None and size < len(buf) <= size + 200:
            raw = bytes(buf)
            op, ctl, key = _HELLO_MSG.unpack_from(raw)
            peer_id = raw[size:].decode("ascii", "replace")
            if op == _HELLO and ctl & _CTL and self._proves(peer_id, key):
                conn.ctl, conn.peer = ctl, peer_id
                self._listen(conn)
                return
            self._refused += 1
            if self._refused & (self._refused - 1) == 0:  # 1st, 2nd, 4th...: no log flood
                log.warning(
                    "ucx relay: refused a connection announcing %s: not a registered peer, "
                    "or its key does not match (%d refused so far)",
                    shown(peer_id),
                    self._refused,
                )
        self._drop_conn(conn)  # not a registered peer: nothing is read from it or sent to it

    def _proves(self, peer_id: str, key: bytes) -> bool:
        """Whether `key` is the key of announced (and trusted) peer `peer_id`."""
        peer = self._peers.get(peer_id) if PEER_ID_RE.fullmatch(peer_id) else None
        digest = hashlib.sha256(key).digest()
        return isinstance(peer, _Peer) and hmac.compare_digest(digest, peer.digest)

    def _conn_lost(self, conn: _Conn) -> None:
        # Runs inside worker progress (an error, or the receiver closed its endpoint).
        self._greeting.discard(conn)
        if conn in self._conns and not self.closed and self._eng.loop is not None:
            self._eng.loop.call_soon(self._drop_conn, conn)

    def _drop_conn(self, conn: _Conn) -> None:
        self._greeting.discard(conn)
        if conn in self._conns:
            self._conns.discard(conn)
            self._close_ep(conn.ep)

    def _listen(self, conn: _Conn) -> None:
        if self.closed or conn not in self._conns:
            return
        try:
            req = conn.ep.tag_recv(Array(conn.buf), Tag(conn.ctl))
        except Exception:
            self._drop_conn(conn)
            return
        self._eng.track(req, functools.partial(self._on_request, conn), conn.buf, False)

    def _on_request(self, conn: _Conn, err: BaseException | None) -> None:
        if err is not None or self.closed:
            self._drop_conn(conn)  # the receiver went away (or closed its endpoint)
            return
        op, *nums = _REQ.unpack(conn.buf)
        self._listen(conn)
        if op == _GET:
            self._serve(conn, *nums[:4])
            nums = nums[4:]
        if op in (_GET, _DONE):
            for tid in filter(None, nums):
                self.served(tid, conn.peer)  # only the peer it was served to releases it

    def _serve(self, conn: _Conn, tid: int, offset: int, nbytes: int, tag: int) -> None:
        ep = conn.ep
        # Bound to the first peer that fetches it: any other gets the status, no bytes.
        src = self.source(tid, offset, nbytes, conn.peer)
        try:
            if src is None:
                self._eng.send(ep, _NOT_LIVE, tag)
                return
            req = ep.tag_send(Array(src), Tag((tag + 1) & 0xFFFF_FFFF_FFFF_FFFF))
        except Exception:  # the endpoint broke: the receiver's fetch fails on its side
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
        tid, nbytes, where = descriptor.transfer_id, descriptor.nbytes, f"{peer.host}:{peer.port}"
        tag = (next(self._tags) << 1) & (_CTL - 2)
        status, body = bytearray(len(_NOT_LIVE)), target.view(nbytes)
        done = peer.done.pop() if peer.done else 0  # rides along: saves the sender a wakeup
        first: asyncio.Future[int] | None = None
        try:
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
                f"for transfer {tid}"
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
        self._greeting.clear()
        conns, self._conns = self._conns, set()
        for conn in conns:
            self._close_ep(conn.ep)
        self._listener = None
        self._eng.close(f"{self.name} relay closed")
