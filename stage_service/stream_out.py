"""Sender side of stream edges: chunk ids, per-edge credit, fair queueing, end signals.

A chunk holds credit on its edge (this stage -> one target stage) from the moment it is
sent until the receiving scheduler takes it; the receiver acks then. Credit is counted in
chunks and bytes per edge, and one request may hold at most `request_credits` of an edge.
Chunks that find no credit wait in per-request queues served round-robin, so one long or
stalled stream cannot starve the other requests on the edge. Order per (request, edge)
holds: a request's chunks, then its done signal, leave in sequence.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from omnirail.config import StreamConfig
from omnirail.relay.base import RelayHandle
from omnirail.relay.io import inline_if_small, relayed_payload
from omnirail.stage_service.edges import EdgeRelays
from omnirail.v1 import common_pb2, mesh_pb2
from omnirail.wire.errors import OmniError
from omnirail.wire.payload import Packed

log = logging.getLogger(__name__)

# Delivers one item to a replica of `item.to_stage`; the handle is released on its ack.
DeliverFn = Callable[[mesh_pb2.DeliverItem, "ChunkCredit | None"], None]


class SentToken:
    """One scheduler stream message, fanned out to several edges: `on_sent` fires once all
    of its copies have left (or were dropped), which unblocks the scheduler's outbox."""

    __slots__ = ("_left", "_on_sent", "request_id")

    def __init__(self, request_id: str, copies: int, on_sent: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._left = copies
        self._on_sent = on_sent

    def one_done(self) -> None:
        self._left -= 1
        if self._left == 0:
            self._on_sent(self.request_id)


@dataclass(slots=True)
class _Out:
    """A chunk (packed) or a done signal (packed is None) waiting for its turn."""

    request_id: str
    packed: Packed | None
    signal: mesh_pb2.StreamSignal
    meta: mesh_pb2.RequestMeta
    traceparent: str
    token: SentToken | None


class _Result(Enum):
    SENT = 0
    WAIT = 1  # no credit yet
    ASYNC = 2  # credit taken; a relay put is in progress


class ChunkCredit:
    """Rides with a sent chunk; the receiver's ack (or a broken stream) releases it."""

    __slots__ = ("_edge", "_handle", "_released", "nbytes", "request_id")
    acked_in_band = True

    def __init__(self, edge: _Edge, request_id: str, nbytes: int) -> None:
        self._edge = edge
        self.request_id = request_id
        self.nbytes = nbytes
        self._handle: RelayHandle | None = None
        self._released = False

    def attach(self, handle: RelayHandle) -> None:
        self._handle = handle

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        handle, self._handle = self._handle, None
        # Backends that learn of releases out of band (shm marks) need nothing here.
        if handle is not None and handle.acked_in_band:
            handle.release()
        self._edge.give_back(self)


class _Edge:
    def __init__(self, target: str, cfg: StreamConfig, pump: Callable[[_Edge], None]) -> None:
        self.target = target
        self.slots = 0
        self.nbytes = 0
        self.by_request: dict[str, int] = {}
        self.waiting: OrderedDict[str, deque[_Out]] = OrderedDict()
        self.busy: set[str] = set()  # requests with a relay put in progress
        self._max_slots = cfg.credits
        self._max_bytes = cfg.credit_mb << 20
        self._max_per_request = cfg.request_credits
        self._pump = pump

    def take(self, request_id: str, nbytes: int) -> ChunkCredit | None:
        held = self.by_request.get(request_id, 0)
        if self.slots >= self._max_slots or held >= self._max_per_request:
            return None
        # A chunk larger than the byte budget still goes alone on an idle edge.
        if self.slots and self.nbytes + nbytes > self._max_bytes:
            return None
        self.slots += 1
        self.nbytes += nbytes
        self.by_request[request_id] = held + 1
        return ChunkCredit(self, request_id, nbytes)

    def give_back(self, credit: ChunkCredit) -> None:
        self.slots -= 1
        self.nbytes -= credit.nbytes
        held = self.by_request.get(credit.request_id, 0) - 1
        if held > 0:
            self.by_request[credit.request_id] = held
        else:
            self.by_request.pop(credit.request_id, None)
        if self.waiting:
            self._pump(self)


class StreamSender:
    """The stream edges out of one stage."""

    def __init__(
        self,
        stage: str,
        cfg: StreamConfig,
        relays: EdgeRelays,
        deliver: DeliverFn,
        on_failed: Callable[[str, BaseException], None],
        on_put: Callable[[str, str, int, float], None] | None = None,
    ) -> None:
        self._stage = stage
        # (target, backend, bytes, seconds) of each chunk put into a relay, for metrics.
        self._on_put = on_put
        self._cfg = cfg
        self._relays = relays
        self._deliver_fn = deliver
        self._on_failed = on_failed
        self._edges: dict[str, _Edge] = {}
        # request -> target -> next chunk id, while the stream is open (keyed by request
        # first: a request's end drops its streams without scanning everyone else's).
        self._next_id: dict[str, dict[str, int]] = {}
        self._forgotten: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    # ---- what the stage calls ----------------------------------------------------

    def chunk(
        self,
        request_id: str,
        target: str,
        packed: Packed,
        modality: str,
        meta: mesh_pb2.RequestMeta,
        traceparent: str,
        token: SentToken | None,
    ) -> None:
        streams = self._next_id.get(request_id)
        if streams is None:
            streams = self._next_id[request_id] = {}
        chunk_id = streams.get(target, 0)
        streams[target] = chunk_id + 1
        signal = mesh_pb2.StreamSignal(chunk_id=chunk_id, modality=modality)
        self._submit(self._edge(target), _Out(request_id, packed, signal, meta, traceparent, token))

    def done(
        self, request_id: str, target: str, meta: mesh_pb2.RequestMeta, traceparent: str
    ) -> None:
        """Ends the (request, target) stream after the chunks queued so far."""
        count = self._next_id.get(request_id, {}).pop(target, 0)
        signal = mesh_pb2.StreamSignal(chunk_id=count, done=True)
        self._submit(self._edge(target), _Out(request_id, None, signal, meta, traceparent, None))

    def error(
        self, request_id: str, error: OmniError, meta: mesh_pb2.RequestMeta, traceparent: str
    ) -> None:
        """Tells every target this request streamed to that the stream failed, at once."""
        targets = self.streamed_to(request_id)
        self.forget(request_id)
        for target in targets:
            signal = mesh_pb2.StreamSignal(error=error.to_proto())
            self._send(_Out(request_id, None, signal, meta, traceparent, None), target, None)

    def forget(self, request_id: str) -> None:
        """Drops what of `request_id` still waits (abort). Sent chunks come back by ack."""
        self._forgotten.add(request_id)
        if len(self._forgotten) > 65536:
            self._forgotten.clear()  # only guards puts in flight; old ids are long done
            self._forgotten.add(request_id)
        for edge in self._edges.values():
            queue = edge.waiting.pop(request_id, None)
            for out in queue or ():
                if out.token is not None:
                    out.token.one_done()
        self.close_request(request_id)

    def close_request(self, request_id: str) -> None:
        """Forgets the request's open stream counters (its done signals are queued)."""
        self._next_id.pop(request_id, None)

    def streamed_to(self, request_id: str) -> list[str]:
        """Targets with an open (not yet done) stream of `request_id`."""
        return list(self._next_id.get(request_id, ()))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for edge in self._edges.values():
            for queue in edge.waiting.values():
                for out in queue:
                    if out.token is not None:
                        out.token.one_done()
            edge.waiting.clear()

    def outstanding(self, target: str) -> tuple[int, int]:
        """(chunks, bytes) in flight on the edge to `target`."""
        edge = self._edges.get(target)
        return (0, 0) if edge is None else (edge.slots, edge.nbytes)

    def waiting(self, target: str) -> int:
        edge = self._edges.get(target)
        return 0 if edge is None else sum(len(q) for q in edge.waiting.values())

    # ---- queueing ----------------------------------------------------------------

    def _edge(self, target: str) -> _Edge:
        edge = self._edges.get(target)
        if edge is None:
            edge = self._edges[target] = _Edge(target, self._cfg, self._pump)
        return edge

    def _submit(self, edge: _Edge, out: _Out) -> None:
        rid = out.request_id
        queue = edge.waiting.get(rid)
        if queue is None and rid not in edge.busy:
            if self._try_send(edge, out) is not _Result.WAIT:
                return
        if queue is None:
            queue = edge.waiting[rid] = deque()
        queue.append(out)

    def _pump(self, edge: _Edge) -> None:
        """Sends waiting heads round-robin, one per request per pass, while credit lasts."""
        progressed = True
        while progressed and edge.waiting:
            progressed = False
            for rid in list(edge.waiting):
                queue = edge.waiting.get(rid)
                if queue is None or rid in edge.busy:
                    continue
                if self._try_send(edge, queue[0]) is _Result.WAIT:
                    continue
                queue.popleft()
                progressed = True
                if queue:
                    edge.waiting.move_to_end(rid)
                else:
                    del edge.waiting[rid]

    def _try_send(self, edge: _Edge, out: _Out) -> _Result:
        packed = out.packed
        if packed is None:  # signals take no credit
            self._send(out, edge.target, None)
            return _Result.SENT
        credit = edge.take(out.request_id, packed.nbytes)
        if credit is None:
            return _Result.WAIT
        try:
            via = self._relays[edge.target]
            inline = inline_if_small(packed, via.relay, via.inline_bytes)
            if inline is not None:
                self._send(out, edge.target, credit, inline)
                return _Result.SENT
            put_ns = time.time_ns()
            handle = via.relay.put_nowait(packed, out.request_id, via.name)
        except Exception as exc:
            credit.release()
            self._drop(out, exc)
            return _Result.SENT
        if handle is None:
            edge.busy.add(out.request_id)
            task = asyncio.get_running_loop().create_task(self._put_later(edge, out, credit))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return _Result.ASYNC
        self._send_put(edge, out, credit, handle, put_ns)
        return _Result.SENT

    async def _put_later(self, edge: _Edge, out: _Out, credit: ChunkCredit) -> None:
        rid = out.request_id
        assert out.packed is not None
        put_ns = time.time_ns()
        try:
            via = self._relays[edge.target]
            handle = await via.relay.put(out.packed, rid, via.name)
        except Exception as exc:
            edge.busy.discard(rid)
            credit.release()
            self._drop(out, exc)
            return
        edge.busy.discard(rid)
        if rid in self._forgotten:
            handle.release()
            credit.release()
            if out.token is not None:
                out.token.one_done()
            return
        self._send_put(edge, out, credit, handle, put_ns)
        self._pump(edge)

    def _send_put(
        self, edge: _Edge, out: _Out, credit: ChunkCredit, handle: RelayHandle, put_ns: int
    ) -> None:
        """Sends a chunk whose bytes a relay put (started at `put_ns`) has placed."""
        packed = out.packed
        assert packed is not None
        credit.attach(handle)
        if self._on_put is not None:
            backend = self._relays[edge.target].relay.name
            self._on_put(edge.target, backend, packed.nbytes, (time.time_ns() - put_ns) / 1e9)
        self._send(out, edge.target, credit, relayed_payload(packed, handle))

    def _drop(self, out: _Out, exc: BaseException) -> None:
        if out.token is not None:
            out.token.one_done()
        self._on_failed(out.request_id, exc)

    def _send(
        self,
        out: _Out,
        target: str,
        credit: ChunkCredit | None,
        payload: common_pb2.Payload | None = None,
    ) -> None:
        item = mesh_pb2.DeliverItem(
            request_id=out.request_id,
            from_stage=self._stage,
            to_stage=target,
            traceparent=out.traceparent,
            meta=out.meta,
            stream=out.signal,
        )
        if payload is not None:
            item.payload.CopyFrom(payload)
        self._deliver_fn(item, credit)
        if out.token is not None:
            out.token.one_done()
