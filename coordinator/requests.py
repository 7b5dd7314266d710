"""The coordinator's request table: live requests and a bounded memory of ended ones."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omnirail.telemetry.metrics import CoordinatorMetrics
from omnirail.telemetry.tracer import STATUS_OK, Span
from omnirail.v1 import client_pb2, common_pb2
from omnirail.wire.errors import Code, OmniError


class State:
    """`common_pb2.RequestState` as plain ints: the enum wrapper resolves every attribute
    with a Python call, and the coordinator reads these several times per request."""

    PENDING = common_pb2.PENDING
    RUNNING = common_pb2.RUNNING
    COMPLETED = common_pb2.COMPLETED
    FAILED = common_pb2.FAILED
    ABORTED = common_pb2.ABORTED
    Name = staticmethod(common_pb2.RequestState.Name)
    values = staticmethod(common_pb2.RequestState.values)


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    terminals: tuple[str, ...]
    # Stages on some path from the entry to one of `terminals`: a dead one fails the request.
    possible: frozenset[str]
    deadline: float  # unix seconds
    started: float = field(default_factory=time.monotonic)
    state: int = State.PENDING
    outputs: dict[str, common_pb2.Payload] = field(default_factory=dict)
    error: OmniError | None = None
    ended: float | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    timer: asyncio.TimerHandle | None = None
    # Called once when the request ends (Session streams answer through these).
    on_done: list[Callable[[RequestRecord], None]] = field(default_factory=list)
    # Called with each client-bound stream chunk (set by streaming calls only).
    on_chunk: list[Callable[[client_pb2.Chunk], None]] = field(default_factory=list)
    # The request's root span (None when tracing is off or the trace is not sampled).
    span: Span | None = None
    chunks: int = 0
    # The id the stages know this attempt by: the request id, or `<id>#<random>` for a
    # dispatch after a replica was lost or for an id an ended request had (stages
    # remember ended ids; '#' is not allowed in client ids, so no client id collides).
    wire_id: str = ""
    attempt: int = 1
    # The entry stage's replica the current attempt went to (it counts in its `assigned`).
    entry: Any = None
    # What went to the entry stage, kept while the request could be re-dispatched.
    retry_item: Any = None
    # Its outputs stay after it ended, for Wait and GetRequest (requests from Submit);
    # others' went to their caller, and the table of ended requests keeps only their
    # state (10,000 results of streamed audio would be gigabytes).
    keep_result: bool = False
    # The client's input stream into it (GenerateRequest.input_stream), None without one.
    input: Any = None
    # The conversation it is a turn of ("" for none): every hop routes by it.
    conversation: str = ""
    # Who it is for (coordinator/tenants.py): its principal's running count and share.
    tenant: Any = None

    @property
    def principal(self) -> str:
        return self.tenant.principal if self.tenant is not None else ""

    def __post_init__(self) -> None:
        self.wire_id = self.wire_id or self.request_id

    @property
    def finished(self) -> bool:
        return self.state in (State.COMPLETED, State.FAILED, State.ABORTED)

    def result(self) -> client_pb2.Result:
        result = client_pb2.Result(request_id=self.request_id)
        for stage, payload in self.outputs.items():
            result.outputs[stage].CopyFrom(payload)
        return result

    def status(self) -> client_pb2.RequestStatus:
        end = self.ended if self.ended is not None else time.monotonic()
        status = client_pb2.RequestStatus(
            request_id=self.request_id, state=self.state, elapsed_s=end - self.started
        )
        if self.state == State.COMPLETED and self.keep_result:
            status.result.CopyFrom(self.result())
        if self.error is not None:
            status.error.CopyFrom(self.error.to_proto())
        return status


_ENDED_EVENT = asyncio.Event()
_ENDED_EVENT.set()


@dataclass(slots=True)
class Ended:
    """What the table keeps of a request that ended: enough for GetRequest, Wait and
    Abort, a few hundred bytes (its outputs only when it came from Submit)."""

    request_id: str
    state: int
    error: OmniError | None
    started: float
    ended: float
    outputs: dict[str, common_pb2.Payload]
    keep_result: bool

    finished = True

    @property
    def done(self) -> asyncio.Event:
        return _ENDED_EVENT

    def result(self) -> client_pb2.Result:
        return RequestRecord.result(self)  # type: ignore[arg-type]

    def status(self) -> client_pb2.RequestStatus:
        return RequestRecord.status(self)  # type: ignore[arg-type]


class RequestTable:
    def __init__(
        self, keep_finished: int = 10_000, metrics: CoordinatorMetrics | None = None
    ) -> None:
        self.live: dict[str, RequestRecord] = {}
        self._finished: OrderedDict[str, Ended] = OrderedDict()
        self._keep = keep_finished
        self._metrics = metrics

    def add(self, record: RequestRecord) -> None:
        self.live[record.request_id] = record

    def get(self, request_id: str) -> RequestRecord | Ended | None:
        return self.live.get(request_id) or self._finished.get(request_id)

    def by_wire(self, wire_id: str) -> RequestRecord | None:
        """The live request whose current attempt the stages know as `wire_id` (None for
        an attempt that was re-dispatched since, or ended)."""
        rec = self.live.get(wire_id.partition("#")[0])
        return rec if rec is not None and rec.wire_id == wire_id else None

    def finish(self, record: RequestRecord, state: int, error: OmniError | None = None) -> bool:
        """Ends a live request once; returns False when it had already ended."""
        if record.finished:
            return False
        record.state = state
        record.error = error
        record.ended = time.monotonic()
        if self._metrics is not None:
            self._metrics.request_ended(
                state, error, record.ended - record.started, record.principal
            )
        if record.tenant is not None:
            record.tenant.release()
        if record.timer is not None:
            record.timer.cancel()
        self.live.pop(record.request_id, None)
        self._finished[record.request_id] = Ended(
            record.request_id,
            state,
            error,
            record.started,
            record.ended,
            record.outputs if record.keep_result else {},
            record.keep_result,
        )
        while len(self._finished) > self._keep:
            self._finished.popitem(last=False)
        record.done.set()
        span = record.span
        if span is not None:
            span.set("omnirail.state", State.Name(state).lower())
            if record.chunks:
                span.set("omnirail.stream.chunks", record.chunks)
            if error is None:
                span.status_code = STATUS_OK
            else:
                span.error(f"{error.code_name}: {error.message}")
            span.end()
        for callback in record.on_done:
            callback(record)
        record.on_done.clear()
        record.on_chunk.clear()
        if record.input is not None:
            record.input.close()
        record.retry_item = None
        record.outputs = {}  # its caller took them in `on_done`; Submit's are in Ended
        return True

    def counts(self) -> dict[str, int]:
        counts = {State.Name(s).lower(): 0 for s in State.values() if s}
        for rec in (*self.live.values(), *self._finished.values()):
            counts[State.Name(rec.state).lower()] += 1
        return counts


class EarlyAborts:
    """Request ids aborted before the coordinator knew them, remembered for `ttl_s` (at
    most `limit` of them): an Abort can overtake its request's start (they travel on
    different calls), and the start that comes after must not run."""

    def __init__(self, ttl_s: float = 30.0, limit: int = 10_000) -> None:
        self._ttl_s = ttl_s
        self._limit = limit
        self._ids: OrderedDict[str, tuple[float, str]] = OrderedDict()

    def add(self, request_id: str, reason: str) -> None:
        now = time.monotonic()
        self._ids[request_id] = (now + self._ttl_s, reason)
        self._ids.move_to_end(request_id)
        while self._ids and (
            len(self._ids) > self._limit or next(iter(self._ids.values()))[0] < now
        ):
            self._ids.popitem(last=False)

    def take(self, request_id: str) -> str | None:
        """The abort's reason if `request_id` was aborted early (and is not any more)."""
        found = self._ids.pop(request_id, None)
        if found is None or found[0] < time.monotonic():
            return None
        return found[1]


class Overloaded(OmniError):
    """Refused for overload, with a hint of when to try again (long enough for a few
    requests of a typical pipeline to end, short against their deadlines); the client
    API sends it as trailing metadata. Raised at once when `max_live_requests` are
    running (`live_limit`), and made from a stage's RESOURCE_EXHAUSTED (a full queue)."""

    retry_after_ms = 200

    def __init__(self, message: str, stage: str = "", retry_after_ms: int | None = None) -> None:
        super().__init__(Code.RESOURCE_EXHAUSTED, message, stage)
        if retry_after_ms is not None:
            # A quota knows better: the time its rate bucket needs for the next request.
            self.retry_after_ms = retry_after_ms

    @classmethod
    def live_limit(cls, limit: int) -> Overloaded:
        return cls(
            f"overloaded: {limit} requests are running (max_live_requests); "
            f"retry after {cls.retry_after_ms} ms"
        )
