"""The coordinator: client API, request lifecycle, and the stages' Attach streams."""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health

from omnirail.config import PipelineConfig, dotted
from omnirail.coordinator.registry import Replica, StageRegistry
from omnirail.coordinator.requests import (
    EarlyAborts,
    Overloaded,
    RequestRecord,
    RequestTable,
    State,
)
from omnirail.telemetry.logs import ids
from omnirail.telemetry.metrics import CoordinatorMetrics
from omnirail.telemetry.tracer import KIND_SERVER, Tracer, parse_traceparent
from omnirail.transport.deliver import DeliverChannel
from omnirail.transport.grpc_server import NOT_SERVING, SERVING, write_until_read_ends
from omnirail.v1 import client_pb2, client_pb2_grpc, mesh_pb2, mesh_pb2_grpc
from omnirail.wire.errors import (
    STAGE_METADATA_KEY,
    Code,
    OmniError,
    internal,
    invalid,
    unavailable,
)
from omnirail.wire.payload import PayloadError, decode_inline
from omnirail.wire.services import PIPELINE_SERVICE

log = logging.getLogger(__name__)

# Relay infos ride in every topology broadcast: bounded so one bad stage cannot bloat them.
MAX_RELAY_INFOS = 8
MAX_RELAY_INFO_BYTES = 1 << 20
# Trailing metadata carrying an overloaded coordinator's retry hint (`Overloaded`).
RETRY_AFTER_KEY = "retry-after-ms"
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:@-]{1,128}$")


class Coordinator(client_pb2_grpc.OmnirailServicer, mesh_pb2_grpc.CoordinatorServicer):
    def __init__(
        self,
        pipeline: PipelineConfig,
        health_servicer: health.aio.HealthServicer,
        tracer: Tracer | None = None,
        metrics: CoordinatorMetrics | None = None,
    ) -> None:
        self.pipeline = pipeline
        self._tracer = tracer or Tracer()
        self._health = health_servicer
        self.registry = StageRegistry(pipeline.stage_names, pipeline.balance)
        self.metrics = metrics or CoordinatorMetrics()
        # host:port of this process's /metrics endpoint, for DescribePipeline ("" when off).
        self.metrics_address = ""
        self.requests = RequestTable(metrics=self.metrics)
        self._early_aborts = EarlyAborts()
        self.draining = False
        self.metrics.watch_running(lambda: len(self.requests.live))
        self._entry = pipeline.resolved_entry_stage
        self._terminals = tuple(pipeline.terminal_stages)
        self._terminals_fn = (
            dotted.resolve(pipeline.terminal_stages_fn, pipeline.source_dir)
            if pipeline.terminal_stages_fn
            else None
        )
        self._possible: dict[tuple[str, ...], frozenset[str]] = {}
        self._max_input = pipeline.max_input_mb << 20
        self._max_live = pipeline.max_live_requests
        self._client_buffer = pipeline.client_stream_buffer
        self._max_message = pipeline.endpoints.max_message_mb << 20
        self._channels: dict[str, DeliverChannel] = {}
        # request id -> replicas that still owe an abort ack, and who acked.
        self._abort_waits: dict[str, tuple[set[tuple[str, str]], list[str], asyncio.Event]] = {}

    # ---- client API ------------------------------------------------------------

    async def Generate(
        self, request: client_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        rec = await self._start_or_abort(request, context)
        try:
            if request.stream:
                await self._stream_chunks(rec, context)
            else:
                await rec.done.wait()
        except asyncio.CancelledError:
            # The client went away: nothing downstream should keep working on it.
            self._end(rec, State.ABORTED, OmniError(Code.CANCELLED, "client cancelled the call"))
            raise
        if rec.state == State.COMPLETED:
            await context.write(client_pb2.GenerateEvent(result=rec.result()))
            return
        await _abort_call(context, rec.error or internal("request ended without a result"))

    async def _stream_chunks(self, rec: RequestRecord, context: grpc.aio.ServicerContext) -> None:
        """Writes the request's chunks as they come, until it ends."""
        chunks: deque[client_pb2.Chunk] = deque()
        wake = asyncio.Event()

        def on_chunk(chunk: client_pb2.Chunk) -> None:
            chunks.append(chunk)
            wake.set()
            if len(chunks) > self._client_buffer:
                self._client_too_slow(rec, len(chunks))

        rec.on_chunk.append(on_chunk)
        rec.on_done.append(lambda _: wake.set())
        while True:
            # A failed request's chunks are moot: its error goes out next.
            while chunks and (not rec.finished or rec.state == State.COMPLETED):
                await context.write(client_pb2.GenerateEvent(chunk=chunks.popleft()))
            if rec.finished:
                return
            wake.clear()
            await wake.wait()

    async def Session(
        self,
        request_iterator: AsyncIterator[client_pb2.SessionRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        events = client_pb2.SessionEvents()
        wake = asyncio.Event()
        mine: set[str] = set()
        # Chunks per request waiting for the client to read the stream (since the last write).
        unread: dict[str, int] = {}

        def emit_chunk(rec: RequestRecord, chunk: client_pb2.Chunk) -> None:
            rid = rec.request_id
            emit(client_pb2.SessionEvent(request_id=rid, chunk=chunk))
            unread[rid] = n = unread.get(rid, 0) + 1
            if n > self._client_buffer:
                self._client_too_slow(rec, n)

        # The call's traceparent parents requests that carry none of their own.
        caller_traceparent = _traceparent_of(context)

        def emit(event: client_pb2.SessionEvent) -> None:
            events.events.append(event)
            wake.set()

        def on_done(rec: RequestRecord) -> None:
            mine.discard(rec.request_id)
            if rec.state == State.COMPLETED:
                emit(client_pb2.SessionEvent(request_id=rec.request_id, result=rec.result()))
            else:
                err = rec.error or internal("request ended without a result")
                emit(client_pb2.SessionEvent(request_id=rec.request_id, error=err.to_proto()))

        async def read() -> None:
            while (msg := await context.read()) is not grpc.aio.EOF:
                for request in msg.generate:
                    if not request.request_id:
                        emit(
                            client_pb2.SessionEvent(
                                error=invalid("request_id: required in a Session").to_proto()
                            )
                        )
                        continue
                    try:
                        rec = self.start(request, None, caller_traceparent)
                    except OmniError as exc:
                        emit(
                            client_pb2.SessionEvent(
                                request_id=request.request_id, error=exc.to_proto()
                            )
                        )
                        continue
                    mine.add(rec.request_id)
                    rec.on_done.append(on_done)
                    if request.stream:
                        rec.on_chunk.append(lambda chunk, r=rec: emit_chunk(r, chunk))
                for abort in msg.abort:
                    rec = self.requests.live.get(abort.request_id)
                    reason = abort.reason or "aborted by client"
                    if rec is not None:
                        self._end(rec, State.ABORTED, OmniError(Code.CANCELLED, reason))
                    elif self.requests.get(abort.request_id) is None:
                        self._early_aborts.add(abort.request_id, reason)

        def take() -> client_pb2.SessionEvents | None:
            nonlocal events
            if not events.events:
                return None
            batch, events = events, client_pb2.SessionEvents()
            unread.clear()
            return batch

        try:
            await write_until_read_ends(context, read(), wake, take)
        finally:
            for rid in list(mine):
                rec = self.requests.live.get(rid)
                if rec is not None:
                    self._end(
                        rec, State.ABORTED, OmniError(Code.CANCELLED, "client session closed")
                    )

    async def Submit(
        self, request: client_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> client_pb2.SubmitResponse:
        rec = await self._start_or_abort(request, context)
        return client_pb2.SubmitResponse(request_id=rec.request_id)

    async def Wait(
        self, request: client_pb2.RequestRef, context: grpc.aio.ServicerContext
    ) -> client_pb2.RequestStatus:
        rec = await self._lookup(request.request_id, context)
        await rec.done.wait()
        return rec.status()

    async def GetRequest(
        self, request: client_pb2.RequestRef, context: grpc.aio.ServicerContext
    ) -> client_pb2.RequestStatus:
        return (await self._lookup(request.request_id, context)).status()

    async def Abort(
        self, request: client_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> client_pb2.AbortResponse:
        reason = request.reason or "aborted by client"
        if self.requests.get(request.request_id) is None and _REQUEST_ID.match(request.request_id):
            # Perhaps it overtook its request's start: that start is cancelled if it comes.
            self._early_aborts.add(request.request_id, reason)
            await _abort_call(
                context,
                OmniError(
                    Code.NOT_FOUND,
                    f"unknown request_id {request.request_id!r} (if it starts within 30 s, "
                    "it is cancelled)",
                ),
            )
        rec = await self._lookup(request.request_id, context)
        response = client_pb2.AbortResponse(request_id=rec.request_id)
        if rec.finished:
            return response
        acked = await self.abort(rec, OmniError(Code.CANCELLED, reason), wait=True)
        response.acknowledged_by.extend(acked)
        return response

    async def DescribePipeline(
        self, request: client_pb2.DescribePipelineRequest, context: grpc.aio.ServicerContext
    ) -> client_pb2.PipelineInfo:
        info = client_pb2.PipelineInfo(
            name=self.pipeline.name or "",
            entry_stage=self._entry,
            terminal_stages=list(self._terminals),
            ready=not self.registry.missing(),
            metrics_address=self.metrics_address,
        )
        for cfg in self.pipeline.stages:
            stage = info.stages.add(
                name=cfg.name,
                next=cfg.next_stages,
                terminal=cfg.terminal,
                wait_for=cfg.wait_for or [],
            )
            for rep in self.registry.replicas(cfg.name):
                stage.replicas.add(
                    replica_id=rep.replica_id,
                    address=rep.address,
                    live=True,
                    queue_depth=rep.queue_depth,
                    inflight=rep.inflight,
                    metrics_address=rep.metrics_address,
                )
        return info

    async def _lookup(self, request_id: str, context: grpc.aio.ServicerContext) -> RequestRecord:
        rec = self.requests.get(request_id)
        if rec is None:
            await _abort_call(
                context, OmniError(Code.NOT_FOUND, f"unknown request_id {request_id!r}")
            )
        assert rec is not None
        return rec

    async def _start_or_abort(
        self, request: client_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> RequestRecord:
        try:
            return self.start(request, context.time_remaining(), _traceparent_of(context))
        except OmniError as exc:
            await _abort_call(context, exc)
            raise  # unreachable: abort raises

    # ---- request lifecycle -------------------------------------------------------

    def start(
        self,
        request: client_pb2.GenerateRequest,
        time_remaining: float | None,
        caller_traceparent: str = "",
    ) -> RequestRecord:
        """Validates a request and delivers it to the entry stage; raises OmniError."""
        rid = request.request_id or uuid.uuid4().hex
        if not _REQUEST_ID.match(rid):
            raise invalid("request_id must be 1-128 characters of [A-Za-z0-9._:@-]")
        if self.draining:
            raise unavailable("the mesh is shutting down: it takes no new requests")
        if rid in self.requests.live:
            raise invalid(f"request_id {rid!r} is already in use by a live request")
        aborted = self._early_aborts.take(rid)
        if aborted is not None:
            raise OmniError(Code.CANCELLED, f"aborted before it started: {aborted}")
        if len(self.requests.live) >= self._max_live:
            self.metrics.refused()
            raise Overloaded(self._max_live)
        if not request.HasField("inputs"):
            raise invalid("inputs: required")
        size = request.inputs.ByteSize()
        if size > self._max_input:
            raise OmniError(
                Code.RESOURCE_EXHAUSTED,
                f"inputs: {size} bytes exceed the pipeline's limit of {self._max_input} bytes "
                "(max_input_mb)",
            )
        if request.inputs.HasField("relay"):
            raise invalid("inputs: relay descriptors are not accepted from clients; send inline")
        try:
            inputs = decode_inline(request.inputs, copy=False)
        except PayloadError as exc:
            raise invalid(f"inputs: {exc}") from None
        if not isinstance(inputs, dict) or not all(isinstance(k, str) for k in inputs):
            raise invalid(
                f"inputs: expected a mapping of names to values, got {type(inputs).__name__}"
            )
        timeout = request.timeout_s or self.pipeline.default_timeout_s
        if not math.isfinite(timeout) or timeout < 0:
            raise invalid(f"timeout_s: must be a finite number >= 0, got {request.timeout_s}")
        if time_remaining is not None:
            timeout = min(timeout, time_remaining)
        terminals = self._resolve_terminals(rid, inputs)
        possible = self._possible_for(terminals)
        for stage in sorted(possible):
            if not self.registry.live(stage):
                raise unavailable(f"stage {stage!r} has no live replica", stage)
        replica = self.registry.pick(self._entry, rid)
        assert replica is not None  # the entry is in `possible`

        rec = RequestRecord(rid, terminals, possible, deadline=time.time() + timeout)
        rec.state = State.RUNNING
        traceparent = request.traceparent or caller_traceparent
        if self._tracer.enabled:
            rec.span = self._tracer.start(
                "omnirail.request",
                parse_traceparent(traceparent),
                {"omnirail.request_id": rid, "omnirail.pipeline": self.pipeline.name or ""},
                kind=KIND_SERVER,
                root=True,
            )
            if rec.span is not None:
                traceparent = rec.span.traceparent
        rec.timer = asyncio.get_running_loop().call_later(timeout, self._expire, rec, timeout)
        self.requests.add(rec)
        item = mesh_pb2.DeliverItem(
            request_id=rid,
            to_stage=self._entry,
            payload=request.inputs,
            traceparent=traceparent,
            meta=mesh_pb2.RequestMeta(terminal_stages=terminals, deadline=rec.deadline),
        )
        self._channel(replica.address).send(item)
        replica.assigned += 1
        rec.on_done.append(lambda _: _unassign(replica))
        return rec

    def _resolve_terminals(self, rid: str, inputs: dict[str, Any]) -> tuple[str, ...]:
        if self._terminals_fn is None:
            return self._terminals
        try:
            chosen = self._terminals_fn(rid, inputs)
        except Exception as exc:
            raise internal(f"terminal_stages_fn raised {type(exc).__name__}: {exc}") from None
        if chosen is None:
            return self._terminals
        names = [chosen] if isinstance(chosen, str) else list(chosen)
        bad = [n for n in names if n not in self._terminals]
        if not names or bad:
            raise internal(
                f"terminal_stages_fn returned {names!r}; expected a non-empty subset of "
                f"the terminal stages {list(self._terminals)}"
            )
        return tuple(n for n in self._terminals if n in names)

    def _possible_for(self, terminals: tuple[str, ...]) -> frozenset[str]:
        found = self._possible.get(terminals)
        if found is None:
            found = self._possible[terminals] = frozenset(
                self.pipeline.possible_stages_for(list(terminals))
            )
        return found

    def _channel(self, address: str) -> DeliverChannel:
        channel = self._channels.get(address)
        if channel is None:
            channel = DeliverChannel(
                address, "coordinator", self._on_lost, max_message_bytes=self._max_message
            )
            self._channels[address] = channel
        return channel

    def _on_lost(self, request_ids: list[str], why: str) -> None:
        for rid in request_ids:
            rec = self.requests.live.get(rid)
            if rec is not None:
                self._fail(rec, unavailable(f"could not deliver to the entry stage: {why}"))

    def _client_too_slow(self, rec: RequestRecord, waiting: int) -> None:
        self._fail(
            rec,
            OmniError(
                Code.RESOURCE_EXHAUSTED,
                f"the client is not reading its stream: {waiting} chunks waiting "
                f"(client_stream_buffer is {self._client_buffer})",
            ),
        )

    def _expire(self, rec: RequestRecord, timeout: float) -> None:
        tp = rec.span.traceparent if rec.span is not None else None
        log.info("request exceeded its %gs deadline", timeout, extra=ids(rec.request_id, tp))
        # Naming the terminal stages without a result points at where the request stalled.
        missing = [t for t in rec.terminals if t not in rec.outputs]
        waiting = f" (no result yet from {', '.join(missing)})" if missing else ""
        self._fail(
            rec,
            OmniError(
                Code.DEADLINE_EXCEEDED, f"request exceeded its {timeout:g}s deadline{waiting}"
            ),
        )

    def _fail(self, rec: RequestRecord, error: OmniError) -> None:
        state = State.ABORTED if error.code == Code.CANCELLED else State.FAILED
        self._end(rec, state, error)

    def _end(self, rec: RequestRecord, state: int, error: OmniError | None) -> None:
        if self.requests.finish(rec, state, error) and state != State.COMPLETED:
            # Other branches may still hold slots for it: clean up everywhere.
            self._broadcast_abort(rec.request_id, error.message if error else "")

    async def abort(self, rec: RequestRecord, error: OmniError, *, wait: bool) -> list[str]:
        """Ends `rec` as aborted and waits for every replica to acknowledge cleanup."""
        if not self.requests.finish(rec, State.ABORTED, error):
            return []
        event = self._broadcast_abort(rec.request_id, error.message)
        if not wait:
            return []
        try:
            await asyncio.wait_for(event.wait(), self.pipeline.abort_ack_timeout_s)
        except TimeoutError:
            log.warning("abort of %s: not every stage acknowledged in time", rec.request_id)
        _, acked, _ = self._abort_waits.pop(rec.request_id, (set(), [], event))
        return acked

    def _broadcast_abort(self, rid: str, reason: str) -> asyncio.Event:
        cmd = mesh_pb2.CoordinatorCommand(aborts=[mesh_pb2.Abort(request_id=rid, reason=reason)])
        targets = self.registry.broadcast(cmd)
        for channel in self._channels.values():
            channel.forget_request(rid)
        event = asyncio.Event()
        owed = {(r.stage, r.replica_id) for r in targets}
        if not owed:
            event.set()
        self._abort_waits[rid] = (owed, [], event)
        # Unwaited entries must not accumulate.
        asyncio.get_running_loop().call_later(
            self.pipeline.abort_ack_timeout_s * 2, self._abort_waits.pop, rid, None
        )
        return event

    # ---- stage events ------------------------------------------------------------

    def _on_event(self, replica: Replica, event: mesh_pb2.StageEvent) -> None:
        for chunk in event.chunks:
            rec = self.requests.live.get(chunk.request_id)
            if rec is None or not rec.on_chunk or replica.stage not in rec.terminals:
                continue
            rec.chunks += 1
            if rec.chunks == 1:
                self.metrics.first_chunk(time.monotonic() - rec.started)
            if rec.chunks == 1 and rec.span is not None:
                rec.span.event("first_chunk", {"omnirail.stage": replica.stage})
            out = client_pb2.Chunk(
                stage=replica.stage,
                chunk_id=chunk.chunk_id,
                modality=chunk.modality,
                data=chunk.data,
            )
            for on_chunk in rec.on_chunk:
                on_chunk(out)
        for done in event.completions:
            rec = self.requests.live.get(done.request_id)
            if rec is None or replica.stage not in rec.terminals:
                continue
            rec.outputs[replica.stage] = done.output
            if len(rec.outputs) == len(rec.terminals):
                self._end(rec, State.COMPLETED, None)
        for failure in event.failures:
            rec = self.requests.live.get(failure.request_id)
            if rec is not None:
                err = OmniError.from_proto(failure.error)
                self._fail(rec, err)
        for ack in event.abort_acks:
            wait = self._abort_waits.get(ack.request_id)
            if wait is not None:
                owed, acked, done_event = wait
                owed.discard((replica.stage, replica.replica_id))
                acked.append(f"{replica.stage}/{replica.replica_id}")
                if not owed:
                    done_event.set()
        if event.HasField("load"):
            replica.queue_depth = event.load.queue_depth
            replica.inflight = event.load.inflight

    async def Attach(
        self,
        request_iterator: AsyncIterator[mesh_pb2.StageEvent],
        context: grpc.aio.ServicerContext,
    ) -> None:
        first = await anext(aiter(request_iterator), None)
        if first is None or not first.HasField("register"):
            await _abort_call(context, invalid("the first Attach message must be a Register"))
        assert first is not None
        reg = first.register
        if not self.registry.knows(reg.stage):
            await _abort_call(
                context,
                invalid(
                    f"unknown stage {reg.stage!r}; this pipeline has {self.pipeline.stage_names}"
                ),
            )
        if not reg.address or not reg.replica_id:
            await _abort_call(context, invalid("register: address and replica_id are required"))
        if len(reg.relay_infos) > MAX_RELAY_INFOS or any(
            len(info) > MAX_RELAY_INFO_BYTES for info in reg.relay_infos
        ):
            await _abort_call(
                context,
                invalid(
                    f"register: at most {MAX_RELAY_INFOS} relay infos of at most "
                    f"{MAX_RELAY_INFO_BYTES} bytes each"
                ),
            )
        replica = Replica(
            reg.stage,
            reg.replica_id,
            reg.address,
            reg.pid,
            metrics_address=reg.metrics_address,
            relay_infos=tuple(reg.relay_infos),
        )
        old = self.registry.add(replica)
        if old is not None:
            old.push(mesh_pb2.CoordinatorCommand(shutdown=mesh_pb2.Shutdown(reason="replaced")))
        log.info("stage %s replica %s registered at %s", reg.stage, reg.replica_id, reg.address)
        await self._topology_changed()

        async def read() -> None:
            async for event in request_iterator:
                self._on_event(replica, event)

        try:
            await write_until_read_ends(context, read(), replica.wake, replica.take)
        finally:
            if self.registry.remove(replica):
                log.warning("stage %s replica %s is gone", replica.stage, replica.replica_id)
                self._replica_gone(replica)
                await self._topology_changed()

    def _replica_gone(self, replica: Replica) -> None:
        error = unavailable(
            f"stage {replica.stage!r} replica {replica.replica_id} went away", replica.stage
        )
        for rec in list(self.requests.live.values()):
            if replica.stage in rec.possible:
                self._fail(rec, error)
        channel = self._channels.pop(replica.address, None)
        if channel is not None:
            asyncio.get_running_loop().create_task(channel.close())

    async def _topology_changed(self) -> None:
        self.registry.broadcast(mesh_pb2.CoordinatorCommand(topology=self.registry.topology()))
        ready = not self.registry.missing()
        await self._health.set(PIPELINE_SERVICE, SERVING if ready else NOT_SERVING)

    async def drain(self, grace_s: float) -> int:
        """Shutting down: new requests are refused (UNAVAILABLE) while the live ones run
        on, for at most `grace_s`; those still live then fail with UNAVAILABLE. Returns
        how many that was."""
        self.draining = True
        deadline = time.monotonic() + grace_s
        while self.requests.live and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = list(self.requests.live.values())
        for rec in left:
            self._end(
                rec,
                State.FAILED,
                unavailable(f"the mesh shut down before the request ended (drain_s {grace_s:g})"),
            )
        return len(left)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()


def _unassign(replica: Replica) -> None:
    replica.assigned -= 1


def _traceparent_of(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "traceparent":
            return value if isinstance(value, str) else value.decode()
    return ""


async def _abort_call(context: grpc.aio.ServicerContext, error: OmniError) -> None:
    metadata = []
    if error.stage:
        metadata.append((STAGE_METADATA_KEY, error.stage))
    if isinstance(error, Overloaded):
        metadata.append((RETRY_AFTER_KEY, str(error.retry_after_ms)))
    if metadata:
        context.set_trailing_metadata(tuple(metadata))
    await context.abort(error.grpc_status, error.message)
