"""The coordinator's request lifecycle: one record per request, from admission to its end."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from grpc_health.v1 import health

from omnirail.config import PipelineConfig, dotted
from omnirail.config.security import ANONYMOUS
from omnirail.coordinator.admission import (
    check_conversation_id,
    check_request_id,
    parse_inputs,
    resolve_terminals,
    timeout_of,
)
from omnirail.coordinator.failover import (
    REDISPATCH_DELAY_S,
    REDISPATCH_WAIT_S,
    can_redispatch,
    touched,
)
from omnirail.coordinator.input_stream import ChunkCredit, InputStream, empty_stream
from omnirail.coordinator.outbox import ClientOutbox
from omnirail.coordinator.registry import Replica, StageRegistry
from omnirail.coordinator.requests import (
    EarlyAborts,
    RequestRecord,
    RequestTable,
    State,
)
from omnirail.coordinator.tenants import Admission
from omnirail.telemetry.logs import ids
from omnirail.telemetry.metrics import CoordinatorMetrics
from omnirail.telemetry.tracer import KIND_SERVER, Tracer, parse_traceparent
from omnirail.transport.deliver import DeliverChannel
from omnirail.transport.grpc_server import NOT_SERVING, SERVING
from omnirail.transport.security import MeshSecurity, mesh_security
from omnirail.v1 import client_pb2, mesh_pb2
from omnirail.wire.errors import Code, OmniError, invalid, unavailable
from omnirail.wire.services import PIPELINE_SERVICE

log = logging.getLogger(__name__)


class RequestLifecycle:
    """Requests from start to end: admission, dispatch to the entry stage, the end (a
    result, an error, a deadline, an abort), and what a lost replica means for each
    (re-dispatch or fail, coordinator/failover.py). The servicers build on it."""

    def __init__(
        self,
        pipeline: PipelineConfig,
        health_servicer: health.aio.HealthServicer,
        tracer: Tracer | None = None,
        metrics: CoordinatorMetrics | None = None,
        security: MeshSecurity | None = None,
    ) -> None:
        self.pipeline = pipeline
        # TLS and the mesh secret for the coordinator's own channels to entry stages.
        self.security = security or mesh_security(pipeline)
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
        self._max_input = pipeline.max_input_mb << 20
        self._max_live = pipeline.max_live_requests
        # Who may start a request now: the mesh's limit, and per principal its quota and
        # its share of a full mesh (security.quotas).
        self.admission = Admission(self._max_live, self.security.quotas, self.metrics)
        self.client_buffer = pipeline.client_stream_buffer
        self.client_buffer_bytes = pipeline.client_buffer_mb << 20
        self._max_message = pipeline.endpoints.max_message_mb << 20
        self._channels: dict[str, DeliverChannel] = {}
        # Stages whose work may run again (a lost replica's requests are re-dispatched).
        self._retry_safe = frozenset(s.name for s in pipeline.stages if s.retry_safe)
        self._liveness: asyncio.Task[None] | None = None
        # Some draining replica waits to be released (checked as requests end).
        self._unreleased = False
        # wire id -> replicas that still owe an abort ack, and who acked.
        self._abort_waits: dict[str, tuple[set[tuple[str, str]], list[str], asyncio.Event]] = {}

    def start(
        self,
        request: client_pb2.GenerateRequest,
        time_remaining: float | None,
        caller_traceparent: str = "",
        principal: str = ANONYMOUS,
    ) -> RequestRecord:
        """Validates a request of `principal`, admits it (coordinator/tenants.py) and
        delivers it to the entry stage; raises OmniError."""
        rid = request.request_id or uuid.uuid4().hex
        check_request_id(rid)
        if self.draining:
            raise unavailable("the mesh is shutting down: it takes no new requests")
        if rid in self.requests.live:
            raise invalid(f"request_id {rid!r} is already in use by a live request")
        aborted = self._early_aborts.take(rid)
        if aborted is not None:
            raise OmniError(Code.CANCELLED, f"aborted before it started: {aborted}")
        if request.input_stream and self.pipeline.input_stream is None:
            raise invalid(
                "input_stream: this pipeline takes no input streams (its config sets no "
                "input_stream)"
            )
        inputs = parse_inputs(request, self._max_input)
        timeout = timeout_of(request, self.pipeline.default_timeout_s, time_remaining)
        terminals = resolve_terminals(self._terminals_fn, self._terminals, rid, inputs)
        possible = self.pipeline.possible_stages(terminals)
        for stage in sorted(possible):
            if not self.registry.live(stage):
                raise unavailable(f"stage {stage!r} has no live replica", stage)
        conversation = request.conversation_id
        if conversation:
            check_conversation_id(conversation)
        # Last of the checks, and nothing after it fails: a refused request counts nowhere,
        # an admitted one is released as its record ends.
        tenant = self.admission.admit(principal)
        rec = RequestRecord(
            rid,
            terminals,
            possible,
            deadline=time.time() + timeout,
            conversation=conversation,
            tenant=tenant,
        )
        if self.requests.get(rid) is not None:
            # The id of a request that ended: the stages remember ended ids (to drop
            # their late items), so this one travels under a wire id of its own.
            rec.wire_id = f"{rid}#{uuid.uuid4().hex[:8]}"
        rec.state = State.RUNNING
        traceparent = request.traceparent or caller_traceparent
        if self._tracer.enabled:
            rec.span = self._tracer.start(
                "omnirail.request",
                parse_traceparent(traceparent),
                {
                    "omnirail.request_id": rid,
                    "omnirail.pipeline": self.pipeline.name or "",
                    "omnirail.principal": principal,
                },
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
            meta=mesh_pb2.RequestMeta(
                terminal_stages=terminals, deadline=rec.deadline, conversation_id=conversation
            ),
        )
        streams_in = self.pipeline.input_stream
        if streams_in is not None and request.input_stream:
            # Not re-dispatched: its chunks are consumed where it runs.
            rec.input = InputStream(
                streams_in.credits,
                streams_in.credit_mb << 20,
                self._max_input,
                traceparent,
                item.meta,
            )
        elif self.pipeline.redispatch_attempts and possible <= self._retry_safe:
            rec.retry_item = item
        rec.on_done.append(_unassign)
        self._dispatch(rec, item)
        return rec

    def send_input(self, rec: RequestRecord, chunk: client_pb2.InputChunk) -> None:
        """Forwards one input chunk (checked, with credit: the caller waited for
        `rec.input.has_room`) to the entry replica that holds the request."""
        stream: InputStream = rec.input
        item = stream.item(rec.wire_id, self._entry, chunk)
        nbytes = 0 if chunk.done else chunk.data.ByteSize()
        credit = ChunkCredit(stream, nbytes) if not chunk.done else None
        self._channel(rec.entry.address).send(item, credit)
        if not chunk.done:
            self.metrics.input_chunk(nbytes)

    def _dispatch(self, rec: RequestRecord, item: mesh_pb2.DeliverItem) -> None:
        """Sends the request's current attempt to a replica of the entry stage."""
        replica = self.registry.pick(self._entry, rec.wire_id, rec.conversation)
        assert replica is not None  # callers checked that every possible stage is live
        item.request_id = rec.wire_id
        channel = self._channel(replica.address)
        channel.send(item)
        if self.pipeline.input_stream is not None and rec.input is None:
            # A request that streams nothing in has an empty input stream.
            channel.send(empty_stream(rec.wire_id, self._entry, item.traceparent, item.meta))
        replica.assigned += 1
        rec.entry = replica

    def _lost(self, rec: RequestRecord, error: OmniError) -> None:
        """A replica `rec` depends on is gone: run it again elsewhere, or fail it."""
        if rec.retry_item is None or not can_redispatch(
            rec, self._retry_safe, self.pipeline.redispatch_attempts
        ):
            self._fail(rec, error)
            return
        old = rec.wire_id
        rec.attempt += 1
        rec.wire_id = f"{rec.request_id}#{uuid.uuid4().hex[:8]}"  # new everywhere
        _unassign(rec)
        self.metrics.redispatched()
        log.info(
            "re-dispatching (attempt %d) after: %s",
            rec.attempt,
            error.message,
            extra=ids(rec.request_id, rec.span.traceparent if rec.span else None, rec.principal),
        )
        if rec.span is not None:
            rec.span.event("redispatched", {"omnirail.attempt": rec.attempt, "why": error.message})
        # Whatever the old attempt left on other stages is cleaned up like an abort.
        self._broadcast_abort(old, f"re-dispatched after: {error.message}")
        asyncio.get_running_loop().call_later(
            REDISPATCH_DELAY_S * (rec.attempt - 1),
            self._dispatch_again,
            rec,
            rec.wire_id,
            error,
            time.monotonic() + REDISPATCH_WAIT_S,
        )

    def _dispatch_again(
        self, rec: RequestRecord, wire_id: str, error: OmniError, give_up: float
    ) -> None:
        """Sends the new attempt once every stage it may pass has a live replica; waits
        for one (the launcher restarts what died) until `give_up` or its deadline."""
        if rec.finished or rec.wire_id != wire_id:
            return
        missing = [s for s in sorted(rec.possible) if not self.registry.live(s)]
        if missing:
            if time.monotonic() < give_up and time.time() + REDISPATCH_DELAY_S < rec.deadline:
                asyncio.get_running_loop().call_later(
                    REDISPATCH_DELAY_S, self._dispatch_again, rec, wire_id, error, give_up
                )
                return
            message = f"{error.message}; no live replica of {missing[0]!r} came back"
            self._fail(rec, unavailable(message, error.stage or missing[0]))
            return
        self._dispatch(rec, rec.retry_item)

    def _channel(self, address: str) -> DeliverChannel:
        channel = self._channels.get(address)
        if channel is None:
            channel = DeliverChannel(
                address,
                "coordinator",
                self._on_lost,
                max_message_bytes=self._max_message,
                security=self.security,
                credentials=lambda: self.registry.credentials,
            )
            self._channels[address] = channel
        return channel

    def _on_lost(self, request_ids: list[str], why: str) -> None:
        for wire_id in request_ids:
            rec = self.requests.by_wire(wire_id)
            if rec is not None:
                self._lost(rec, unavailable(f"could not deliver to the entry stage: {why}"))

    def client_outbox(
        self, call: str, combine: Callable[[list[Any]], Any] | None = None
    ) -> ClientOutbox[Any]:
        """The bounded outbox of one client call of kind `call` (session, kserve_stream,
        generate): client_buffer_mb and client_stream_buffer bound it."""
        return ClientOutbox(
            call,
            self.client_buffer_bytes,
            self.client_buffer,
            combine,
            on_full=lambda: self.metrics.slow_client(call, "paused"),
        )

    def push_chunk(
        self, outbox: ClientOutbox[Any], rec: RequestRecord, message: Any, slack: int = 1
    ) -> None:
        """Queues a stream chunk of `rec` for its client, unless what waits for the call is
        at `slack` times its bound: then `rec` fails (the client is not reading)."""
        if outbox.full(slack):
            self.client_too_slow(rec, outbox)
        else:
            outbox.push(message)

    def client_too_slow(self, rec: RequestRecord, outbox: ClientOutbox[Any]) -> None:
        self.metrics.slow_client(outbox.call, "failed")
        self._fail(
            rec,
            OmniError(
                Code.RESOURCE_EXHAUSTED,
                f"the client is not reading its stream: {outbox.describe()}",
            ),
        )

    def _expire(self, rec: RequestRecord, timeout: float) -> None:
        self.metrics.deadline_overrun(time.time() - rec.deadline)
        tp = rec.span.traceparent if rec.span is not None else None
        log.info(
            "request exceeded its %gs deadline",
            timeout,
            extra=ids(rec.request_id, tp, rec.principal),
        )
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
        self.end(rec, state, error)

    def end(self, rec: RequestRecord, state: int, error: OmniError | None) -> None:
        if self.requests.finish(rec, state, error) and state != State.COMPLETED:
            # Other branches may still hold slots for it: clean up everywhere.
            self._broadcast_abort(rec.wire_id, error.message if error else "")
        if self._unreleased:
            self._unreleased = self.registry.release_drained(self.requests.live.values())

    def close_conversation(self, conversation_id: str) -> None:
        """Every stage drops what it keeps of the conversation (raises OmniError for a
        malformed id)."""
        check_conversation_id(conversation_id)
        self.registry.broadcast(mesh_pb2.CoordinatorCommand(closed_conversations=[conversation_id]))

    def abort_soon(self, request_id: str, reason: str) -> None:
        """Aborts a live request without waiting for the stages' acks; one not known yet
        is remembered, in case the abort overtook its request's start."""
        rec = self.requests.live.get(request_id)
        if rec is not None:
            self.end(rec, State.ABORTED, OmniError(Code.CANCELLED, reason))
        elif self.requests.get(request_id) is None:
            self._early_aborts.add(request_id, reason)

    async def abort(
        self, rec: RequestRecord, error: OmniError, *, wait: bool
    ) -> tuple[list[str], list[str]]:
        """Ends `rec` as aborted; with `wait`, waits up to abort_ack_timeout_s for every
        replica to acknowledge cleanup. Returns the replicas that did ("stage/replica") and
        those that did not in time."""
        if not self.requests.finish(rec, State.ABORTED, error):
            return [], []
        event = self._broadcast_abort(rec.wire_id, error.message)
        if self._unreleased:
            self._unreleased = self.registry.release_drained(self.requests.live.values())
        if not wait:
            return [], []
        try:
            await asyncio.wait_for(event.wait(), self.pipeline.abort_ack_timeout_s)
        except TimeoutError:
            pass
        owed, acked, _ = self._abort_waits.pop(rec.wire_id, (set(), [], event))
        missing = sorted(f"{stage}/{replica}" for stage, replica in owed)
        if missing:
            log.warning(
                "abort of %s: not acknowledged within %gs by %s",
                rec.request_id,
                self.pipeline.abort_ack_timeout_s,
                ", ".join(missing),
            )
        return acked, missing

    def _broadcast_abort(self, rid: str, reason: str) -> asyncio.Event:
        """Tells every replica to drop what it holds of `rid` (a wire id)."""
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

    # ---- replicas that leave -------------------------------------------------------

    def _lose(self, replica: Replica, why: str) -> bool:
        """Takes `replica` out of the mesh; the requests it touched are re-dispatched or
        fail (coordinator/failover.py). False when it was already out."""
        before = self.registry.replicas(replica.stage)
        if not self.registry.remove(replica):
            return False
        if replica.draining:  # a planned exit, after it finished its work
            log.info("stage %s replica %s left (drained)", replica.stage, replica.replica_id)
        else:
            log.warning("stage %s replica %s %s", replica.stage, replica.replica_id, why)
            self.metrics.replica_lost(replica.stage)
        error = unavailable(
            f"stage {replica.stage!r} replica {replica.replica_id} {why}", replica.stage
        )
        for rec in list(self.requests.live.values()):
            if touched(replica, before, rec, self._entry):
                self._lost(rec, error)
        channel = self._channels.pop(replica.address, None)
        if channel is not None:
            asyncio.get_running_loop().create_task(channel.close())
        return True

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
            self.end(
                rec,
                State.FAILED,
                unavailable(f"the mesh shut down before the request ended (drain_s {grace_s:g})"),
            )
        return len(left)

    async def close(self) -> None:
        if self._liveness is not None:
            self._liveness.cancel()
        for channel in self._channels.values():
            await channel.close()


def _unassign(rec: RequestRecord) -> None:
    """The request's attempt no longer counts against its entry replica."""
    if rec.entry is not None:
        rec.entry.assigned -= 1
        rec.entry = None
