"""The Stage IO shell: deliveries in, fan-in, scheduler, routing, results out.

A `Stage` reads relay payloads, waits for every active upstream (fan-in), hands complete
inputs to `scheduler.inbox`, and turns `scheduler.outbox` messages into deliveries to
downstream stages or completions for the coordinator. It never branches on the
scheduler's type. Everything here runs on the process's event loop thread; compute runs
on the scheduler's thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

from omnirail.config import PipelineConfig
from omnirail.relay.base import Relay, RelayError
from omnirail.relay.io import ReceivedPayload, inline_payload, receive_payload
from omnirail.stage.scheduler import (
    CLIENT,
    STOP_WAIT_S,
    AbortSet,
    IncomingMessage,
    OutgoingMessage,
    Scheduler,
)
from omnirail.stage_service.edge_sender import (
    EdgeSenders,
    LocalValue,
    SentToken,
)
from omnirail.stage_service.edges import EdgeRelays
from omnirail.stage_service.fanin import FanIn
from omnirail.stage_service.observe import StageObserver
from omnirail.stage_service.request_state import (
    PENDING,
    AckFn,
    Reporter,
    RequestState,
    as_error,
    queue_full,
)
from omnirail.stage_service.result_out import ResultSender
from omnirail.stage_service.routing import Router, Routes
from omnirail.stage_service.stream_in import drain
from omnirail.stage_service.stream_out import StreamSender
from omnirail.telemetry.logs import ids
from omnirail.telemetry.metrics import ABORTED, COMPLETED, FAILED, StageMetrics
from omnirail.telemetry.tracer import Tracer
from omnirail.v1 import mesh_pb2
from omnirail.wire.errors import Code, OmniError, invalid
from omnirail.wire.payload import Packed, PayloadError, encode_inline, pack

log = logging.getLogger(__name__)


class Stage:
    def __init__(
        self,
        name: str,
        pipeline: PipelineConfig,
        scheduler: Scheduler,
        edges: EdgeRelays,
        relays: Mapping[str, Relay],
        router: Router,
        reporter: Reporter,
        tracer: Tracer | None = None,
        metrics: StageMetrics | None = None,
        device: str = "cpu",
    ) -> None:
        self.name = name
        # Where tensors a sender had on a GPU arrive: this stage's GPU (None: the CPU).
        self._device = None if device == "cpu" else device
        self.cfg = pipeline.stage(name)
        self.scheduler = scheduler
        self._max_queue = self.cfg.max_queue
        self._edges = edges
        self._relays = relays
        self._router = router
        self._reporter = reporter
        base = pipeline.source_dir
        self._fan_in = FanIn(name, self.cfg, base)
        self._routes = Routes(name, self.cfg, base, router)
        self._stream_to = self._routes.stream_to
        self._observe = StageObserver(
            name,
            tracer,
            metrics,
            queue_depth=lambda: scheduler.queue_depth,
            inflight=lambda: self.inflight,
            fan_in=bool(self._fan_in.wait_for),
            held=lambda: scheduler.held_requests,
            engine=scheduler.figures if scheduler.figures() is not None else None,
            conversations=(
                scheduler.conversations if scheduler.conversations() is not None else None
            ),
        )
        self._stream_sources = frozenset(pipeline.stream_sources_of(name))
        # The entry stage of a pipeline with `input_stream` takes every request's input
        # stream from its client (through the coordinator) as source "@client".
        self._client_source = (
            frozenset({CLIENT})
            if pipeline.input_stream is not None and name == pipeline.resolved_entry_stage
            else frozenset()
        )
        self._stream_sources |= self._client_source
        self._takes_payload = pipeline.takes_payload(name)
        self._hold_early = self.cfg.stream.hold_early_chunks
        # Client-bound chunks ride the Attach stream, inline: keep them under its limit.
        self._max_client_chunk = (pipeline.endpoints.max_message_mb << 20) - (64 << 10)
        self._requests: dict[str, RequestState] = {}
        self._aborted = AbortSet()
        # Requests that ended here; late stream items for them are drained, not errors.
        self._ended = AbortSet()
        # Every item to another stage, results and stream items, leaves through its edge's
        # sender (inline or relayed, order per (request, edge), stream credit).
        self._senders = EdgeSenders(
            name,
            edges,
            router.deliver,
            aborted=self._aborted,
            on_failed=lambda rid, exc: self._fail(rid, as_error(exc, self.name)),
            on_put=self._observe.relay_put,
            stream=self.cfg.stream,
        )
        self._streams = StreamSender(self._senders)
        self._results = ResultSender(self._senders, self._routes.project)
        scheduler.outbox.set_stream_limit(self.cfg.stream.outbox_chunks)

    # ---- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.scheduler.outbox.bind(lambda: loop.call_soon_threadsafe(self._on_outbox))
        self.scheduler.inbox.bind(lambda: loop.call_soon_threadsafe(self._on_taken))
        self.scheduler.start()

    async def stop(self, compute_wait_s: float = STOP_WAIT_S) -> None:
        """Stops the stage; its compute thread may finish what it runs for up to
        `compute_wait_s` (less for a process about to exit, whose compute can only be for
        requests it no longer holds)."""
        await self._senders.close()
        self.scheduler.outbox.close()
        await asyncio.to_thread(self.scheduler.stop_within, compute_wait_s)
        for rid in list(self._requests):
            self._requests.pop(rid).release()

    @property
    def inflight(self) -> int:
        return len(self._requests)

    # ---- input path ----------------------------------------------------------

    async def on_item(
        self,
        item: mesh_pb2.DeliverItem,
        ack: AckFn,
        local: LocalValue | None = None,
        owners: frozenset[str] | None = None,
    ) -> None:
        """One delivered item, a payload or a stream item, through one path: dropped when
        its request was aborted, read (relay or message), then taken as a payload (fan-in,
        scheduler) or as a stream chunk. `local`: the value of an item from a stage in
        this process (handed over by reference: nothing to read, nothing malformed).
        `owners`: the relay peer ids the stream's authenticated sender announced; a relay
        descriptor naming anything else is refused (`Relay.get`; None: no binding, for
        items from this process).

        What the sender gets back (`ack`): every stream item is acked (a chunk once the
        scheduler has taken it: that returns the producer's credit); a payload item only
        when relayed, with its error, or once released where the backend returns credit
        through acks (shm learns of releases through its marks)."""
        rid = item.request_id
        if not rid:
            ack(invalid("delivery without request_id", self.name))  # harmless if not awaited
            return
        stream = item.HasField("stream")
        relayed = item.payload.HasField("relay")
        acks = stream or relayed  # whether this item is acked at all
        if rid in self._aborted or (stream and rid in self._ended):
            if stream:
                await drain(item, self._relays, owners)
            if acks:
                ack(None)
            return
        req: RequestState | None = None
        if stream:
            req = self._request_for(item)
            if not await self._stream_signal(item, req, ack, owners):
                return  # an end, an error or a bad stream item: nothing to read
        source = item.from_stage or "coordinator"
        get_ns = time.time_ns()
        try:
            # Relayed chunk bytes are copied out and the slot released on arrival, so a
            # window the scheduler keeps never pins relay credit.
            received = await self._receive(item, local, owners, copy=stream and relayed)
        except (PayloadError, RelayError) as exc:
            what = "stream chunk" if stream else "payload"
            err = invalid(f"bad {what} from {source}: {exc}", self.name)
            if acks:
                ack(err)
            self._fail(rid, err)
            return
        # The read ends here: the request's span (opened below for its first item) is not
        # part of it.
        got_ns = self._observe.relay_get(item.payload.relay, source, get_ns) if relayed else 0
        in_band = relayed and self._relays[item.payload.relay.backend].acks_in_band
        held_ack = ack if stream or in_band else None
        if rid in self._aborted:  # aborted while the relay read was in flight
            received.release()
            if held_ack:
                held_ack(None)
            return
        if req is not None:
            self._take_chunk(item, req, received, ack)
        else:
            self._take_payload(item, received, held_ack, get_ns, got_ns)

    def _take_payload(
        self,
        item: mesh_pb2.DeliverItem,
        received: ReceivedPayload,
        ack: AckFn | None,
        get_ns: int,
        got_ns: int,
    ) -> None:
        """A payload read: held by its request (released, and acked, as it ends), then
        through fan-in to the scheduler once every active upstream's is in."""
        rid = item.request_id
        req = self._request_for(item, get_ns)
        self._observe.received(req, item, item.from_stage or "coordinator", get_ns, got_ns)
        req.holds.append((received, ack))
        if item.meta.deadline and time.time() > item.meta.deadline:
            self._fail(rid, OmniError(Code.DEADLINE_EXCEEDED, "deadline passed", self.name))
            return
        try:
            ready = self._fan_in.add(rid, req, item.from_stage, received.value)
        except OmniError as exc:
            self._fail(rid, exc)
            return
        except Exception as exc:  # user hook (wait_for_fn / merge_fn) raised
            self._fail(rid, as_error(exc, self.name))
            return
        if ready is not PENDING and not req.submitted:
            self._submit(rid, req, ready)

    async def _receive(
        self,
        item: mesh_pb2.DeliverItem,
        local: LocalValue | None,
        owners: frozenset[str] | None,
        *,
        copy: bool,
    ) -> ReceivedPayload:
        """An item's value: the object itself from a stage in this process, else read
        from the message or relay (GPU tensors onto this stage's device)."""
        if local is not None:
            return ReceivedPayload(local.value)
        return await receive_payload(
            item.payload, self._relays, copy=copy, device=self._device, owners=owners
        )

    def _request_for(self, item: mesh_pb2.DeliverItem, start_ns: int | None = None) -> RequestState:
        """The request's state here, made (with its span) by its first item."""
        req = self._requests.get(item.request_id)
        if req is not None:
            return req
        req = self._requests[item.request_id] = RequestState(item.meta, item.traceparent)
        if self._observe.tracing:
            self._observe.open_span(req, item, start_ns)
        return req

    def _submit(self, rid: str, req: RequestState, data: Any) -> None:
        """Hands the request to the scheduler, then whatever stream input waited for it;
        refuses it at once (RESOURCE_EXHAUSTED) when `max_queue` requests already wait
        there: queueing it would only make it miss its deadline."""
        depth = self.scheduler.queue_depth
        if depth >= self._max_queue:
            self._fail(rid, queue_full(self.name, depth, self._max_queue))
            return
        req.submitted = True
        inbox = self.scheduler.inbox
        msg = IncomingMessage(
            rid,
            "new_request",
            data,
            traceparent=req.traceparent,
            conversation=req.meta.conversation_id,
        )
        req.submitted_ns = time.time_ns()
        req.new_msg = msg
        inbox.put(msg)
        for msg in req.streams.early:
            inbox.put(msg)
        req.streams.early.clear()

    # ---- stream input ----------------------------------------------------------

    async def _stream_signal(
        self,
        item: mesh_pb2.DeliverItem,
        req: RequestState,
        ack: AckFn,
        owners: frozenset[str] | None,
    ) -> bool:
        """Checks a stream item and takes what carries no data (its producer's error, the
        end of its stream); True when it is a chunk to read."""
        rid, source, signal = item.request_id, item.from_stage, item.stream
        problem = None
        if source not in self._stream_sources:
            problem = (
                f"input stream from the client, but {self.name!r} is not the entry stage of "
                "a pipeline with input_stream"
                if source == CLIENT
                else f"stream from {source or 'coordinator'!r}, which does not list "
                f"{self.name!r} in stream_to"
            )
        elif signal.HasField("error"):
            # The producer already reported the failure; just stop work on it here.
            ack(None)
            self.abort(rid)
            return False
        else:
            problem = req.streams.problem(source, signal)
        if problem is not None:
            err = invalid(problem, self.name)
            await drain(item, self._relays, owners)
            ack(err)
            self._fail(rid, err)
            return False
        if signal.done:
            ack(None)
            req.streams.accept(source, signal)
            self._maybe_stream_done(rid, req)
            return False
        return True

    def _take_chunk(
        self, item: mesh_pb2.DeliverItem, req: RequestState, received: ReceivedPayload, ack: AckFn
    ) -> None:
        """A stream chunk read: to the scheduler (acked once it takes it), held until the
        request's payload comes when the stage holds early chunks, else refused."""
        rid, source, signal = item.request_id, item.from_stage, item.stream
        req.streams.accept(source, signal)
        self._observe.chunk_in(req, source)
        msg = IncomingMessage(
            rid,
            "stream_chunk",
            received.value,
            source,
            signal.chunk_id,
            lambda: ack(None),
            traceparent=req.traceparent,
        )
        if req.submitted:
            self.scheduler.inbox.put(msg)
        elif not self._takes_payload:
            self._submit(rid, req, None)  # a stage fed only by streams starts on its first
            self.scheduler.inbox.put(msg)
        elif self._hold_early:
            req.streams.early.append(msg)
        else:
            err = invalid(
                f"stream chunk from {source!r} arrived before the request's payload; "
                f"set stream.hold_early_chunks on stage {self.name!r} to hold such chunks",
                self.name,
            )
            ack(err)
            self._fail(rid, err)

    def _maybe_stream_done(self, rid: str, req: RequestState) -> None:
        sources = self._stream_sources
        if req.meta.terminal_stages:
            possible = self._router.possible_stages(tuple(req.meta.terminal_stages))
            sources = (sources & possible) | self._client_source
        if req.streams.ended or not sources <= req.streams.done_from:
            return
        req.streams.ended = True
        msg = IncomingMessage(rid, "stream_done", None, traceparent=req.traceparent)
        if req.submitted:
            self.scheduler.inbox.put(msg)
        elif not self._takes_payload:
            self._submit(rid, req, None)
            self.scheduler.inbox.put(msg)
        else:
            req.streams.early.append(msg)  # an end signal holds nothing: keep it

    def _on_taken(self) -> None:
        for on_taken in self.scheduler.inbox.drain_taken():
            on_taken()

    # ---- output path ---------------------------------------------------------
    #
    # Results are handled right in the loop callback that the outbox schedules, with no
    # extra task hop (stage_service/result_out.py); the request ends here once every part
    # of its result has left.

    def _on_outbox(self) -> None:
        for msg in self.scheduler.outbox.drain():
            if msg.type == "stream":
                # Stream edges keep their own order and credit; results never wait on them.
                self._send_stream(msg)
            else:
                self._handle(msg)

    def _handle(self, msg: OutgoingMessage) -> None:
        rid = msg.request_id
        req = self._requests.get(rid)
        if req is None or rid in self._aborted:
            return
        if msg.type == "error":
            self._fail(rid, as_error(msg.data, self.name))
            return
        self._observe.computed(req, msg)
        send_ns = time.time_ns()
        try:
            self._end_streams(rid, req, msg.data)
            if self.cfg.terminal:
                self._reporter.complete(rid, encode_inline(msg.data), req.traceparent)
                self._observe.sent(req, send_ns)
                self._finish(rid)
                return
            targets = self._routes.targets(rid, msg.data, req.meta)
            sent = self._results.send(
                rid,
                msg.data,
                targets,
                req.meta,
                req.traceparent,
                req,
                lambda: self._sent_later(rid, req, send_ns),
            )
        except Exception as exc:
            self._fail(rid, as_error(exc, self.name))
            return
        if sent:
            self._observe.sent(req, send_ns)
            self._finish(rid)

    def _sent_later(self, rid: str, req: RequestState, send_ns: int) -> None:
        """The last part of a result that waited for relay credit has left."""
        if self._requests.get(rid) is req:
            self._observe.sent(req, send_ns)
            self._finish(rid)

    # ---- stream output -----------------------------------------------------------

    def _send_stream(self, msg: OutgoingMessage) -> None:
        rid = msg.request_id
        outbox = self.scheduler.outbox
        req = self._requests.get(rid)
        if req is None or rid in self._aborted:
            outbox.sent(rid)
            return
        try:
            to_client, targets = self._routes.chunk_destinations(msg.target, req.meta)
            modality = str((msg.metadata or {}).get("modality", ""))
            # Packed once for the client and every edge out of the process; local edges
            # take the value itself.
            senders = [self._senders[t] for t in targets]
            packed = None
            if to_client or not all(sender.local for sender in senders):
                packed = pack(msg.data)
            if to_client:
                assert packed is not None
                self._client_chunk(rid, req, packed, modality)
        except Exception as exc:
            outbox.sent(rid)
            self._fail(rid, as_error(exc, self.name))
            return
        self._observe.chunk_out(req)
        if not targets:
            outbox.sent(rid)
            return
        token = SentToken(rid, len(targets), outbox.sent)
        for target, sender in zip(targets, senders, strict=True):
            part = LocalValue(msg.data) if sender.local else packed
            assert part is not None
            self._streams.chunk(rid, target, part, modality, req.meta, req.traceparent, token)

    def _client_chunk(self, rid: str, req: RequestState, packed: Packed, modality: str) -> None:
        if packed.nbytes > self._max_client_chunk:
            raise OmniError(
                Code.RESOURCE_EXHAUSTED,
                f"stream chunk of {packed.nbytes} bytes exceeds the client message limit "
                f"({self._max_client_chunk} bytes; endpoints.max_message_mb)",
                self.name,
            )
        self._reporter.chunk(rid, req.client_chunks, modality, inline_payload(packed))
        req.client_chunks += 1

    def _end_streams(self, rid: str, req: RequestState, output: Any) -> None:
        """Sends done on this request's stream edges, after the chunks already queued."""
        if not self._stream_to:
            return
        for target in self._routes.stream_done_targets(rid, output, req.meta):
            self._streams.done(rid, target, req.meta, req.traceparent)
        self._streams.close_request(rid)  # targets left out get no done

    # ---- endings -------------------------------------------------------------

    def _finish(self, rid: str, outcome: str = COMPLETED) -> None:
        req = self._requests.pop(rid, None)
        if req is not None:
            self._ended.add(rid)
            req.release()
            self._observe.ended(req, outcome)

    def _fail(self, rid: str, error: OmniError) -> None:
        if rid in self._aborted:
            return  # already failed or aborted here: report once
        self._reporter.fail(rid, error)
        req = self._requests.get(rid)
        log.warning(
            "stage %s: request failed: %s: %s",
            self.name,
            error.code_name,
            error.message,
            extra=ids(rid, req.traceparent if req is not None else None),
        )
        if req is not None:
            self._observe.failed(req, error)
            # Consumers stop at once instead of waiting for the coordinator's abort.
            self._streams.error(rid, error, req.meta, req.traceparent)
        # The coordinator broadcasts an abort next; stop work on it here already.
        self.abort(rid, outcome=FAILED)

    def abort(self, rid: str, reason: str = "", *, outcome: str = ABORTED) -> None:
        req = self._requests.get(rid)
        if req is not None:
            self._observe.aborted(req, reason)
        self._aborted.add(rid)
        self.scheduler.abort(rid)
        # Drops its waiting stream items and stops its relay puts on every edge.
        self._senders.forget(rid)
        self._streams.close_request(rid)
        self._finish(rid, outcome)
