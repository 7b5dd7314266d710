"""One edge out of a stage (stage -> target): the one way payloads and stream items leave.

Every item a stage sends to another stage goes through the `EdgeSender` of its edge:
`Stage` hands it result payloads, the `StreamSender` stream chunks and signals.

- Inline when small: a payload within the edge's inline bound (or one without tensors)
  rides in the message (`relay.io.inline_if_small`); a larger one goes through the edge's
  relay and the message carries its descriptor.
- A relayed payload is placed without waiting where it can, on the caller's stack with no
  task switch: `forward_nowait` (a result handing on bytes this process received) or
  `put_nowait` (free credit, an inline copy). Only a payload that must wait (a full edge,
  a threaded copy) gets a task, which awaits `relay.put` and then sends it. The control
  message goes out as soon as the bytes are placed: credit-based backends need the
  receiver to start before the sender can go on.
- Order per (request, edge): a request's stream items leave in the order given; while one
  waits for its relay put (`busy`) or for stream credit, the request's later ones queue
  behind it. Other requests are not held up. A result is the last thing its request
  sends on an edge, so it needs no queue: a part that must wait goes on in its own task
  while the request's other parts, and other requests' results, go on.
- Stream credit (`relay.credits.Credits`, with a per-request share): a chunk holds credit
  on its edge from the moment it is sent until the receiving scheduler takes it; the
  receiver acks then, which releases the `ChunkCredit` riding with the item. Credit is
  counted in chunks and bytes per edge, and one request may hold at most `request_credits`
  of an edge. Chunks that find no credit wait in per-request queues served round-robin, so
  one long or stalled stream cannot starve the other requests on the edge. Results and
  stream signals take no stream credit: a result never waits behind chunks (its receiver
  may hold early chunks, unacked, until the result arrives).
- Local edges (the target is hosted in this process): values go by reference in a
  `LocalValue`, never packed or relayed, and the item is handed to the target in the
  process (`DeliverFn` with the value). Order, stream credit (counted in chunks; a local
  chunk has no bytes) and abort handling are the same as on any other edge.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import Any, Protocol

from omnirail.config import StreamConfig
from omnirail.relay.base import RelayHandle, Releasable
from omnirail.relay.credits import Credits
from omnirail.relay.io import inline_if_small, relayed_payload
from omnirail.stage_service.edges import EdgeRelay, EdgeRelays
from omnirail.v1 import common_pb2, mesh_pb2
from omnirail.wire.payload import Packed, pack


class LocalValue:
    """A value for a stage in this process, handed over by reference (read-only contract:
    neither side changes it after sending). It holds no relay or stream bytes."""

    __slots__ = ("value",)
    nbytes = 0

    def __init__(self, value: Any) -> None:
        self.value = value


class DeliverFn(Protocol):
    """Delivers one item to a replica of `item.to_stage`; the handle is released on its
    ack. `local`: the value of an item on a local edge (None for its signals)."""

    def __call__(
        self,
        item: mesh_pb2.DeliverItem,
        handle: Releasable | None,
        local: LocalValue | None = None,
    ) -> None: ...


# A send failed (a relay error, an oversize payload on the inline relay): fail the request.
FailFn = Callable[[str, BaseException], None]
# A payload was placed in the relay: (ctx, target, backend, packed, put_ns, forwarded), with
# the `ctx` the item was given (the request's state for results, None for stream chunks).
PutHook = Callable[[Any, str, str, Packed, int, bool], None]


class SentToken:
    """One outgoing message fanned out to several edges: `on_sent` fires once all of its
    copies have left. A stream chunk's copy also counts when it is dropped (that unblocks
    the scheduler's outbox); a result's only when it was sent (a dropped one failed or
    aborted its request, which then ends otherwise)."""

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
class Outgoing:
    """An item for one edge: a result payload (signal None), a stream chunk (packed and
    signal) or a stream signal (packed None)."""

    request_id: str
    packed: Packed | LocalValue | None
    signal: mesh_pb2.StreamSignal | None
    meta: mesh_pb2.RequestMeta
    traceparent: str
    token: SentToken | None = None
    ctx: Any = None  # handed to the put hook (the request's state for results)
    # The payload goes to this target only and its tensors are never read again, so the
    # relay may forward bytes it received instead of copying them (`Relay.forward_nowait`).
    forward: bool = False


class ChunkCredit:
    """Rides with a sent chunk; the receiver's ack (or a broken stream) releases it: the
    chunk's stream credit and, for backends acked in band, its relay handle."""

    __slots__ = ("_released", "_sender", "handle", "nbytes", "request_id")
    acked_in_band = True

    def __init__(self, sender: EdgeSender, request_id: str, nbytes: int) -> None:
        self._sender = sender
        self.request_id = request_id
        self.nbytes = nbytes
        self.handle: RelayHandle | None = None
        self._released = False

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        handle, self.handle = self.handle, None
        # Backends that learn of releases out of band (shm marks) need nothing here.
        if handle is not None and handle.acked_in_band:
            handle.release()
        sender = self._sender
        sender.credits.give_back(sender.credit, self.nbytes, self.request_id)
        if sender.waiting:
            sender.pump()


class EdgeSender:
    """Sends on one edge `stage->target` with the edge's relay and inline bound."""

    __slots__ = (
        "_aborted",
        "_deliver_fn",
        "_on_failed",
        "_on_put",
        "_puts",
        "busy",
        "credit",
        "credits",
        "inline_bytes",
        "local",
        "name",
        "relay",
        "stage",
        "target",
        "waiting",
    )

    def __init__(
        self,
        stage: str,
        target: str,
        edge: EdgeRelay,
        deliver: DeliverFn,
        credits: Credits,
        *,
        aborted: Container[str],
        on_failed: FailFn,
        on_put: PutHook | None = None,
    ) -> None:
        self.stage = stage
        self.target = target
        self.name = edge.name
        self.relay = edge.relay
        self.inline_bytes = edge.inline_bytes
        self.local = edge.local
        self._deliver_fn = deliver
        # Requests that ended here: a put that finishes after its request's abort is undone.
        self._aborted = aborted
        self._on_failed = on_failed
        self._on_put = on_put
        # Stream credit of this edge, in the stage's stream `Credits`.
        self.credits = credits
        self.credit = credits.edge(edge.name)
        # Stream items waiting for their turn, per request (round-robin order), and the
        # requests with a stream item's relay put in progress.
        self.waiting: OrderedDict[str, deque[Outgoing]] = OrderedDict()
        self.busy: set[str] = set()
        # Relay puts in progress that have not finished waiting: task -> (item, credit).
        self._puts: dict[asyncio.Task[None], tuple[Outgoing, ChunkCredit | None]] = {}

    # ---- sending without waiting ------------------------------------------------------

    def prepare(self, value: Any) -> Packed | LocalValue:
        """What `value` travels as on this edge: by reference on a local edge, else packed."""
        return LocalValue(value) if self.local else pack(value)

    def send_now(self, out: Outgoing, credit: ChunkCredit | None = None) -> bool:
        """Sends `out` if that needs no waiting; False when its relay put must wait (then
        `put_later` sends it). `credit`: the stream credit a chunk holds, which rides with
        it. Raises what sending raises (an oversize payload on the inline relay, a relay
        error)."""
        packed = out.packed
        if packed is None:  # a stream signal
            self._deliver(out, None, credit)
            return True
        if isinstance(packed, LocalValue):
            self._deliver(out, None, credit, packed)
            return True
        payload = inline_if_small(packed, self.relay, self.inline_bytes)
        if payload is not None:
            self._deliver(out, payload, credit)
            return True
        relay = self.relay
        put_ns = time.time_ns()
        handle = relay.forward_nowait(packed, out.request_id, self.name) if out.forward else None
        forwarded = handle is not None
        if handle is None:
            handle = relay.put_nowait(packed, out.request_id, self.name)
            if handle is None:
                return False
        self._send_placed(out, handle, put_ns, forwarded, credit)
        return True

    def _send_placed(
        self,
        out: Outgoing,
        handle: RelayHandle,
        put_ns: int,
        forwarded: bool,
        credit: ChunkCredit | None,
    ) -> None:
        """Sends an item whose bytes the relay holds (placed from `put_ns` until now)."""
        packed = out.packed
        assert isinstance(packed, Packed)
        if self._on_put is not None:
            self._on_put(out.ctx, self.target, self.relay.name, packed, put_ns, forwarded)
        payload = relayed_payload(packed, handle)
        if credit is not None:
            credit.handle = handle  # the ack releases both
            self._deliver(out, payload, credit)
        else:
            self._deliver(out, payload, handle)

    def _deliver(
        self,
        out: Outgoing,
        payload: common_pb2.Payload | None,
        handle: Releasable | None,
        local: LocalValue | None = None,
    ) -> None:
        signal = out.signal
        if signal is None:
            item = mesh_pb2.DeliverItem(
                request_id=out.request_id,
                from_stage=self.stage,
                to_stage=self.target,
                payload=payload,
                traceparent=out.traceparent,
                meta=out.meta,
            )
        else:
            # Built apart: passing `payload=None` or `stream=None` costs as much as a field.
            item = mesh_pb2.DeliverItem(
                request_id=out.request_id,
                from_stage=self.stage,
                to_stage=self.target,
                traceparent=out.traceparent,
                meta=out.meta,
                stream=signal,
            )
            if payload is not None:
                item.payload.CopyFrom(payload)
        if self.local:
            self._deliver_fn(item, handle, local)
        else:
            self._deliver_fn(item, handle)
        token = out.token
        if token is not None:
            token.one_done()

    # ---- waiting for the relay ---------------------------------------------------------

    def put_later(self, out: Outgoing, credit: ChunkCredit | None = None) -> None:
        """Puts `out`'s payload in a task, waiting for relay credit, then sends it.

        A failed put fails the request (`on_failed`); `forget` stops the put of an aborted
        request, and one that finishes after its abort is released unsent.
        """
        task = asyncio.get_running_loop().create_task(self._put(out, credit))
        self._puts[task] = (out, credit)
        task.add_done_callback(self._put_done)

    async def _put(self, out: Outgoing, credit: ChunkCredit | None) -> None:
        rid = out.request_id
        packed = out.packed
        assert isinstance(packed, Packed)
        put_ns = time.time_ns()
        try:
            handle = await self.relay.put(packed, rid, self.name)
        except Exception as exc:
            del self._puts[asyncio.current_task()]  # type: ignore[arg-type]
            if credit is not None:
                self.busy.discard(rid)
            self._on_failed(rid, exc)
            if credit is not None:
                credit.release()
            self._dropped(out)
            return
        # Past waiting: `forget` no longer cancels it (it is done before anything yields).
        del self._puts[asyncio.current_task()]  # type: ignore[arg-type]
        if credit is not None:
            self.busy.discard(rid)
        if rid in self._aborted:  # aborted while the put was finishing
            handle.release()
            if credit is not None:
                credit.release()
            self._dropped(out)
            return
        self._send_placed(out, handle, put_ns, False, credit)
        if credit is not None and self.waiting:
            self.pump()  # the request's next items, which queued behind this one

    def _put_done(self, task: asyncio.Task[None]) -> None:
        entry = self._puts.pop(task, None)
        if entry is None or not task.cancelled():
            return
        # Stopped while waiting (`forget` or `close`): the relay gave back what it had taken.
        out, credit = entry
        if credit is not None:
            self.busy.discard(out.request_id)
            credit.release()
        self._dropped(out)

    @staticmethod
    def _dropped(out: Outgoing) -> None:
        """`out` will not be sent. A stream item still counts as gone for its token (its
        scheduler's outbox must not fill up); a result's token waits for sends only."""
        if out.signal is not None and out.token is not None:
            out.token.one_done()

    # ---- stream items: order per request, credit, fairness -----------------------------

    def stream(self, out: Outgoing) -> None:
        """Sends a stream chunk or signal behind the request's items still waiting here."""
        rid = out.request_id
        queue = self.waiting.get(rid)
        if queue is None:
            if rid not in self.busy and self._try_stream(out):
                return
            queue = self.waiting[rid] = deque()
        queue.append(out)

    def pump(self) -> None:
        """Sends waiting heads round-robin, one per request per pass, while credit lasts."""
        waiting = self.waiting
        progressed = True
        while progressed and waiting:
            progressed = False
            for rid in list(waiting):
                queue = waiting.get(rid)
                if queue is None or rid in self.busy:
                    continue
                # Off the queue while it goes: a failure forgets the request's queue.
                out = queue.popleft()
                if not self._try_stream(out):
                    queue.appendleft(out)
                    continue
                progressed = True
                if waiting.get(rid) is not queue:
                    continue  # forgotten meanwhile
                if queue:
                    waiting.move_to_end(rid)
                else:
                    del waiting[rid]

    def _try_stream(self, out: Outgoing) -> bool:
        """Sends a stream item, or starts its relay put; False when no credit is free."""
        packed = out.packed
        if packed is None:  # signals take no credit
            self._deliver(out, None, None)
            return True
        rid = out.request_id
        nbytes = packed.nbytes
        if not self.credits.try_take(self.credit, nbytes, rid):
            return False
        credit = ChunkCredit(self, rid, nbytes)
        try:
            if self.send_now(out, credit):
                return True
        except Exception as exc:
            self._on_failed(rid, exc)
            credit.release()
            self._dropped(out)
            return True
        self.busy.add(rid)
        self.put_later(out, credit)
        return True

    # ---- ends ----------------------------------------------------------------------------

    def forget(self, request_id: str) -> None:
        """Drops what of `request_id` still waits here and stops its relay puts (abort).
        Sent chunks come back by ack."""
        queue = self.waiting.pop(request_id, None)
        if queue is not None:
            for out in queue:
                self._dropped(out)
        if self._puts:
            for task, (out, _) in list(self._puts.items()):
                if out.request_id == request_id:
                    task.cancel()

    async def close(self) -> None:
        """Drops what waits and stops the puts in progress (the stage stops)."""
        for queue in self.waiting.values():
            for out in queue:
                self._dropped(out)
        self.waiting.clear()
        tasks = list(self._puts)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def queued(self) -> int:
        """Stream items waiting for their turn on this edge."""
        return sum(len(q) for q in self.waiting.values())


class EdgeSenders(dict[str, EdgeSender]):
    """The `EdgeSender` of each edge out of one stage, made on first use: `senders[target]`
    (a plain dict lookup on the hot path)."""

    def __init__(
        self,
        stage: str,
        edges: EdgeRelays,
        deliver: DeliverFn,
        *,
        aborted: Container[str],
        on_failed: FailFn,
        on_put: PutHook | None = None,
        stream: StreamConfig | None = None,
    ) -> None:
        super().__init__()
        cfg = stream if stream is not None else StreamConfig()
        self._stage = stage
        self._edges = edges
        self._deliver = deliver
        self._aborted = aborted
        self._on_failed = on_failed
        self._on_put = on_put
        # Stream credit of every edge (the relays keep their own, per transfer).
        self.credits = Credits(cfg.credits, cfg.credit_mb << 20, cfg.request_credits)

    def __missing__(self, target: str) -> EdgeSender:
        sender = self[target] = EdgeSender(
            self._stage,
            target,
            self._edges[target],
            self._deliver,
            self.credits,
            aborted=self._aborted,
            on_failed=self._on_failed,
            on_put=self._on_put,
        )
        return sender

    def forget(self, request_id: str) -> None:
        for sender in self.values():
            sender.forget(request_id)

    async def close(self) -> None:
        for sender in list(self.values()):
            await sender.close()
