"""Prometheus metrics: one registry per service process (its `/metrics` endpoint is
`omnirail.telemetry.metrics_http`).

Names carry the `omnirail_` prefix and base units (seconds, bytes). Each service gets its
own `CollectorRegistry`, not prometheus_client's process-global one, so services that
share a process (tests, in-process meshes) never collide. Label children are bound once,
so an observation on the request path costs one prometheus_client call (~1-2 µs) and at
most a dict lookup. Observations happen on the service's event loop thread; the HTTP
server reads them from its own threads (prometheus_client values are locked).

Queue depth, in-flight and running counts are read at scrape time from callables rather
than kept up to date on the request path.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from omnirail.v1.common_pb2 import ErrorCode, RequestState

if TYPE_CHECKING:
    from omnirail.wire.errors import OmniError

# Seconds: sub-millisecond stage hops up to requests that run for a minute.
LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
# A relay put or get of small tensors takes microseconds; a put that waits for edge
# credit, up to seconds.
RELAY_BUCKETS = (
    0.00001,
    0.000025,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)

COMPLETED = "completed"
FAILED = "failed"
ABORTED = "aborted"
OUTCOMES = (COMPLETED, FAILED, ABORTED)

OP_PUT = "put"  # observed by the sender
OP_GET = "get"  # observed by the receiver

# Plain ints: attribute lookups on protobuf enum wrappers cost microseconds.
_COMPLETED = int(RequestState.COMPLETED)
_STATE_NAMES = {
    _COMPLETED: COMPLETED,
    int(RequestState.FAILED): FAILED,
    int(RequestState.ABORTED): ABORTED,
}
_ABORT_REASONS = {
    int(ErrorCode.CANCELLED): "client",
    int(ErrorCode.DEADLINE_EXCEEDED): "deadline",
    int(ErrorCode.UNAVAILABLE): "unavailable",
}
ABORT_REASONS = ("client", "deadline", "unavailable", "stage_error")


def abort_reason(error: OmniError | None) -> str:
    """The `reason` label of a request that ended without completing."""
    if error is None:
        return "stage_error"
    return _ABORT_REASONS.get(error.code, "stage_error")


def _scrape_safe(fn: Callable[[], float]) -> Callable[[], float]:
    # A scrape racing a stage's shutdown must not turn the whole endpoint into a 500.
    def read() -> float:
        try:
            return float(fn())
        except Exception:
            return math.nan

    return read


class CoordinatorMetrics:
    """Request outcomes, latency, time to first chunk and aborts, seen by the coordinator."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        requests = Counter(
            "omnirail_requests_total",
            "Requests that ended, by final state (completed, failed, aborted).",
            ["state"],
            registry=r,
        )
        duration = Histogram(
            "omnirail_request_duration_seconds",
            "End-to-end request latency at the coordinator, by final state.",
            ["state"],
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self._running = Gauge(
            "omnirail_requests_running", "Requests in flight in the mesh.", registry=r
        )
        self._first_chunk = Histogram(
            "omnirail_time_to_first_chunk_seconds",
            "From a streaming request's start to its first client-bound chunk.",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self._deadline_overrun = Histogram(
            "omnirail_deadline_overrun_seconds",
            "How late the coordinator ended a request that ran past its deadline (its "
            "timer's delay: the event loop's load).",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        aborts = Counter(
            "omnirail_aborts_total",
            "Requests the coordinator aborted across the mesh (every request that ended "
            "without completing), by cause: client, deadline, unavailable, stage_error.",
            ["reason"],
            registry=r,
        )
        self._refused = Counter(
            "omnirail_requests_refused_total",
            "Requests refused at once because max_live_requests were running (overload).",
            registry=r,
        )
        # Per principal (security.quotas): the names come from the tokens file, so the
        # label's values are few.
        self._principal_requests = Counter(
            "omnirail_principal_requests_total",
            "Requests that ended, by principal (the caller a token names; `anonymous` "
            "without tokens) and final state.",
            ["principal", "state"],
            registry=r,
        )
        self._principal_refused = Counter(
            "omnirail_principal_refused_total",
            "Requests refused at admission, by principal and reason: live_limit and rate "
            "(its own quota), share (the mesh full and the principal at its weighted "
            "share), mesh_full (max_live_requests, without quotas).",
            ["principal", "reason"],
            registry=r,
        )
        self._principal_running = Gauge(
            "omnirail_principal_requests_running",
            "Requests in flight in the mesh, by principal.",
            ["principal"],
            registry=r,
        )
        self._redispatched = Counter(
            "omnirail_requests_redispatched_total",
            "Requests dispatched again after losing a replica before any output reached "
            "the client (once per re-dispatch).",
            registry=r,
        )
        self._replicas_lost = Counter(
            "omnirail_replicas_lost_total",
            "Stage replicas taken out of the mesh: their process went away, or they "
            "stopped answering for liveness_s.",
            ["stage"],
            registry=r,
        )
        self._slow_clients = Counter(
            "omnirail_slow_client_total",
            "Client calls whose unread output reached client_buffer_mb or "
            "client_stream_buffer, by kind of call (session, kserve_stream, generate) and "
            "what the coordinator did: paused (stopped reading the call's new requests) or "
            "failed (failed a streaming request whose chunk found the call past its bound).",
            ["call", "action"],
            registry=r,
        )
        self._input_chunks = Counter(
            "omnirail_input_chunks_total",
            "Input chunks clients streamed into running requests (forwarded to the entry stage).",
            registry=r,
        )
        self._input_bytes = Counter(
            "omnirail_input_bytes_total",
            "Payload bytes of the input chunks clients streamed into running requests.",
            registry=r,
        )
        self._input_wait = Counter(
            "omnirail_input_credit_wait_seconds_total",
            "Time Sessions spent not reading because a request's input stream was at its "
            "credit (input_stream.credits / credit_mb): clients held back.",
            registry=r,
        )
        self._ended = {
            state: (requests.labels(name), duration.labels(name))
            for state, name in _STATE_NAMES.items()
        }
        self._aborts = {reason: aborts.labels(reason) for reason in ABORT_REASONS}

    def watch_running(self, count: Callable[[], int]) -> None:
        """`count()` is read at each scrape for `omnirail_requests_running`."""
        self._running.set_function(_scrape_safe(count))

    def request_ended(
        self, state: int, error: OmniError | None, seconds: float, principal: str = ""
    ) -> None:
        counter, duration = self._ended[state]
        counter.inc()
        duration.observe(seconds)
        if state != _COMPLETED:
            self._aborts[abort_reason(error)].inc()
        if principal:
            self._principal_requests.labels(principal, _STATE_NAMES[state]).inc()

    def first_chunk(self, seconds: float) -> None:
        self._first_chunk.observe(seconds)

    def refused(self, principal: str = "", reason: str = "mesh_full") -> None:
        """A request refused at admission; `mesh_full` and `share` are overload refusals
        (`omnirail_requests_refused_total`), the others a principal's own quota."""
        if reason in ("mesh_full", "share"):
            self._refused.inc()
        if principal:
            self._principal_refused.labels(principal, reason).inc()

    def principal_running(self, principal: str, running: int) -> None:
        self._principal_running.labels(principal).set(running)

    def slow_client(self, call: str, action: str) -> None:
        self._slow_clients.labels(call, action).inc()

    def deadline_overrun(self, seconds: float) -> None:
        self._deadline_overrun.observe(max(0.0, seconds))

    def redispatched(self) -> None:
        self._redispatched.inc()

    def replica_lost(self, stage: str) -> None:
        self._replicas_lost.labels(stage).inc()

    def input_chunk(self, nbytes: int) -> None:
        self._input_chunks.inc()
        self._input_bytes.inc(nbytes)

    def input_waited(self, seconds: float) -> None:
        self._input_wait.inc(seconds)


class StageMetrics:
    """The metrics of one stage process; `stage(name)` binds those of a hosted stage."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge(
            "omnirail_stage_queue_depth",
            "Messages waiting in the stage scheduler's inbox.",
            ["stage"],
            registry=r,
        )
        self.inflight = Gauge(
            "omnirail_stage_inflight",
            "Requests the stage holds (waiting for inputs, queued, computing or sending).",
            ["stage"],
            registry=r,
        )
        self.held = Gauge(
            "omnirail_stage_held_requests",
            "Requests whose state the stage's scheduler keeps (KV caches, stream windows).",
            ["stage"],
            registry=r,
        )
        self.relay_held = Gauge(
            "omnirail_relay_held",
            "Payloads a relay backend of this process holds for receivers (put, not yet released).",
            ["backend"],
            registry=r,
        )
        self.queue_seconds = Histogram(
            "omnirail_stage_queue_seconds",
            "From handing a request to the scheduler to the scheduler taking it.",
            ["stage"],
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.compute_seconds = Histogram(
            "omnirail_stage_compute_seconds",
            "From the scheduler taking a request to it emitting the result.",
            ["stage"],
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.requests = Counter(
            "omnirail_stage_requests_total",
            "Requests that ended at the stage, by outcome (completed, failed, aborted).",
            ["stage", "outcome"],
            registry=r,
        )
        self.relay_bytes = Counter(
            "omnirail_relay_bytes_total",
            "Payload bytes moved through a relay backend on an edge (op: put on the "
            "sender, get on the receiver).",
            ["backend", "edge", "op"],
            registry=r,
        )
        self.relay_seconds = Histogram(
            "omnirail_relay_seconds",
            "Relay put (including any wait for relay credit) and get time per payload or chunk.",
            ["backend", "edge", "op"],
            registry=r,
            buckets=RELAY_BUCKETS,
        )

    def stage(
        self,
        name: str,
        *,
        queue_depth: Callable[[], int] | None = None,
        inflight: Callable[[], int] | None = None,
        held: Callable[[], int] | None = None,
        engine: Callable[[], Any] | None = None,
        conversations: Callable[[], Any] | None = None,
    ) -> StageRecorder:
        """Binds the stage's series; the callables are read at each scrape. `engine` returns
        a serving engine's `EngineFigures` (or None: the stage runs no engine);
        `conversations` the `ConversationFigures` of state kept across turns."""
        if engine is not None:
            self.registry.register(_EngineCollector(name, engine))
        if conversations is not None:
            self.registry.register(_ConversationCollector(name, conversations))
        if held is not None:
            self.held.labels(name).set_function(_scrape_safe(held))
        if queue_depth is not None:
            self.queue_depth.labels(name).set_function(_scrape_safe(queue_depth))
        if inflight is not None:
            self.inflight.labels(name).set_function(_scrape_safe(inflight))
        return StageRecorder(self, name)


class _FiguresCollector(Collector):
    """A stage's figures (`figures()`: a dataclass, or None for none), read at each scrape
    and turned into metric families by `families`."""

    def __init__(self, stage: str, figures: Callable[[], Any]) -> None:
        self._stage = stage
        self._figures = figures

    def collect(self) -> Iterator[Metric]:
        try:
            f = self._figures()
        except Exception:  # a scrape racing the stage's shutdown
            f = None
        if f is not None:
            yield from self.families(f)

    def families(self, f: Any) -> Iterator[Metric]:
        raise NotImplementedError


class _EngineCollector(_FiguresCollector):
    """`omnirail_engine_*`: a stage's serving engine's own counts, read at each scrape."""

    def families(self, f: Any) -> Iterator[Metric]:
        labels = [self._stage]
        for family, name, doc, value in (
            (
                GaugeMetricFamily,
                "running_requests",
                "Requests the stage's engine is running.",
                f.running,
            ),
            (
                GaugeMetricFamily,
                "waiting_requests",
                "Requests waiting in the stage's engine.",
                f.waiting,
            ),
            (
                GaugeMetricFamily,
                "kv_cache_usage",
                "Share of the engine's KV cache blocks in use (0..1).",
                f.kv_cache_usage,
            ),
            (
                CounterMetricFamily,
                "prefix_cache_queries",
                "Prompt tokens the engine looked up in its prefix cache.",
                f.prefix_cache_queries,
            ),
            (
                CounterMetricFamily,
                "prefix_cache_hits",
                "Prompt tokens the engine found in its prefix cache.",
                f.prefix_cache_hits,
            ),
        ):
            metric = family(f"omnirail_engine_{name}", doc, labels=["stage"])
            metric.add_metric(labels, value)
            yield metric


def watch_relay(metrics: StageMetrics, backend: str, held: Callable[[], int]) -> None:
    """`held()` is read at each scrape for `omnirail_relay_held{backend}`."""
    metrics.relay_held.labels(backend).set_function(_scrape_safe(held))


class StageRecorder:
    """One stage's bound series: what the stage calls on its request path."""

    __slots__ = ("_compute", "_metrics", "_outcomes", "_queue", "_relay", "stage")

    def __init__(self, metrics: StageMetrics, stage: str) -> None:
        self._metrics = metrics
        self.stage = stage
        self._queue = metrics.queue_seconds.labels(stage)
        self._compute = metrics.compute_seconds.labels(stage)
        self._outcomes = {o: metrics.requests.labels(stage, o) for o in OUTCOMES}
        # (op, backend, peer stage) -> (bytes counter, seconds histogram)
        self._relay: dict[tuple[str, str, str], tuple[Counter, Histogram]] = {}

    def computed(self, submitted_ns: int, taken_ns: int, created_ns: int) -> None:
        """Queue wait and compute of one result, from unix-ns timestamps."""
        # Wall-clock stamps can step backwards; a negative time would corrupt the sums.
        self._queue.observe(max(0, taken_ns - submitted_ns) / 1e9)
        self._compute.observe(max(0, created_ns - taken_ns) / 1e9)

    def ended(self, outcome: str) -> None:
        self._outcomes[outcome].inc()

    def relay_put(self, backend: str, target: str, nbytes: int, seconds: float) -> None:
        self._relay_op(OP_PUT, backend, target, nbytes, seconds)

    def relay_get(self, backend: str, source: str, nbytes: int, seconds: float) -> None:
        self._relay_op(OP_GET, backend, source, nbytes, seconds)

    def _relay_op(self, op: str, backend: str, peer: str, nbytes: int, seconds: float) -> None:
        key = (op, backend, peer)
        pair = self._relay.get(key)
        if pair is None:
            edge = f"{self.stage}->{peer}" if op == OP_PUT else f"{peer}->{self.stage}"
            m = self._metrics
            pair = self._relay[key] = (
                m.relay_bytes.labels(backend, edge, op),
                m.relay_seconds.labels(backend, edge, op),
            )
        pair[0].inc(nbytes)
        pair[1].observe(seconds)


class _ConversationCollector(_FiguresCollector):
    """`omnirail_conversation_*`: the state a stage keeps across conversations' turns, read
    at each scrape (`ConversationFigures`)."""

    def families(self, f: Any) -> Iterator[Metric]:
        stage = [self._stage]
        for family, name, doc, value in (
            (GaugeMetricFamily, "states", "Conversations whose state the stage keeps.", f.states),
            (GaugeMetricFamily, "state_bytes", "Bytes of the state the stage keeps.", f.bytes),
            (
                CounterMetricFamily,
                "prefill_tokens",
                "Tokens conversation turns computed (what kept state did not cover).",
                f.prefill_tokens,
            ),
            (
                CounterMetricFamily,
                "reused_tokens",
                "Tokens conversation turns took from the state kept by earlier turns.",
                f.reused_tokens,
            ),
        ):
            metric = family(f"omnirail_conversation_{name}", doc, labels=["stage"])
            metric.add_metric(stage, value)
            yield metric
        turns = CounterMetricFamily(
            "omnirail_conversation_turns",
            "Conversation turns by whether they found their state (reused) or rebuilt it.",
            labels=["stage", "state"],
        )
        turns.add_metric([self._stage, "reused"], f.turns_reused)
        turns.add_metric([self._stage, "rebuilt"], f.turns_rebuilt)
        yield turns
        evicted = CounterMetricFamily(
            "omnirail_conversation_evictions",
            "Conversation states dropped, by reason: budget (room for others), idle "
            "(expired), closed (by the client).",
            labels=["stage", "reason"],
        )
        for reason, count in f.evicted.items():
            evicted.add_metric([self._stage, reason], count)
        yield evicted
