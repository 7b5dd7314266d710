"""Prometheus metrics: names and units, label sets, abort reasons, the Stage's
observations (with tracing off), and the registries served over HTTP."""

from __future__ import annotations

import math
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from omnirail.config import ConfigError, PipelineConfig
from omnirail.relay.base import RelaySettings, create_relay
from omnirail.stage.scheduler import SimpleScheduler
from omnirail.stage_service.edges import EdgeRelays
from omnirail.stage_service.stage import Stage
from omnirail.telemetry.metrics import CoordinatorMetrics, StageMetrics, abort_reason, watch_relay
from omnirail.telemetry.metrics_http import start_metrics_server, stop_metrics_server
from omnirail.v1 import common_pb2
from omnirail.wire.errors import Code, OmniError
from tests.unit.stage_service.stage_fakes import (
    FakeReporter,
    FakeRouter,
    RecordingScheduler,
    payload,
    pipeline,
    until,
)

State = common_pb2.RequestState

LABELS = {
    "omnirail_requests": {"state"},
    "omnirail_requests_running": set(),
    "omnirail_request_duration_seconds": {"state"},
    "omnirail_time_to_first_chunk_seconds": set(),
    "omnirail_aborts": {"reason"},
    "omnirail_requests_refused": set(),
    "omnirail_requests_redispatched": set(),
    "omnirail_replicas_lost": {"stage"},
    "omnirail_deadline_overrun_seconds": set(),
    "omnirail_slow_client": {"call", "action"},
    "omnirail_input_chunks": set(),
    "omnirail_input_bytes": set(),
    "omnirail_input_credit_wait_seconds": set(),
    "omnirail_principal_requests": {"principal", "state"},
    "omnirail_principal_refused": {"principal", "reason"},
    "omnirail_principal_requests_running": {"principal"},
    "omnirail_stage_queue_depth": {"stage"},
    "omnirail_stage_inflight": {"stage"},
    "omnirail_stage_held_requests": {"stage"},
    "omnirail_relay_held": {"backend"},
    "omnirail_stage_queue_seconds": {"stage"},
    "omnirail_stage_compute_seconds": {"stage"},
    "omnirail_stage_requests": {"stage", "outcome"},
    "omnirail_relay_bytes": {"backend", "edge", "op"},
    "omnirail_relay_seconds": {"backend", "edge", "op"},
}

COORDINATOR_FAMILIES = {
    "omnirail_requests",
    "omnirail_requests_running",
    "omnirail_request_duration_seconds",
    "omnirail_time_to_first_chunk_seconds",
    "omnirail_aborts",
    "omnirail_requests_refused",
    "omnirail_requests_redispatched",
    "omnirail_replicas_lost",
    "omnirail_deadline_overrun_seconds",
    "omnirail_slow_client",
    "omnirail_input_chunks",
    "omnirail_input_bytes",
    "omnirail_input_credit_wait_seconds",
    "omnirail_principal_requests",
    "omnirail_principal_refused",
    "omnirail_principal_requests_running",
}


def _filled() -> tuple[CoordinatorMetrics, StageMetrics]:
    coord = CoordinatorMetrics()
    coord.watch_running(lambda: 2)
    coord.request_ended(State.COMPLETED, None, 0.25)
    coord.request_ended(State.ABORTED, OmniError(Code.CANCELLED, "gone"), 0.5)
    coord.first_chunk(0.01)
    coord.replica_lost("a")
    coord.deadline_overrun(0.003)
    coord.slow_client("session", "paused")
    coord.request_ended(State.COMPLETED, None, 0.1, "web")
    coord.refused("web", "share")
    coord.principal_running("web", 1)
    stage = StageMetrics()
    rec = stage.stage("a", queue_depth=lambda: 3, inflight=lambda: 4, held=lambda: 1)
    watch_relay(stage, "shm", lambda: 0)
    rec.computed(1_000, 2_000, 5_000)
    rec.ended("completed")
    rec.relay_put("shm", "b", 1 << 20, 0.001)
    rec.relay_get("shm", "src", 1 << 10, 0.0001)
    return coord, stage


def _families(registry: CollectorRegistry) -> dict[str, object]:
    return {f.name: f for f in registry.collect()}


def test_names_have_the_prefix_base_units_and_no_colons() -> None:
    coord, stage = _filled()
    families = {**_families(coord.registry), **_families(stage.registry)}
    assert set(families) == set(LABELS)
    for name, family in families.items():
        assert name.startswith("omnirail_"), name
        assert ":" not in name, name
        for sample in family.samples:  # type: ignore[attr-defined]
            assert ":" not in sample.name and sample.name.startswith("omnirail_")
        if family.type == "histogram":  # type: ignore[attr-defined]
            assert name.endswith("_seconds"), f"{name}: durations are in seconds"
        assert not any(u in name for u in ("_ms", "milli", "micro", "_kb", "_mb")), name
    assert families["omnirail_relay_bytes"].type == "counter"  # type: ignore[attr-defined]


def test_label_sets() -> None:
    coord, stage = _filled()
    for registry in (coord.registry, stage.registry):
        for family in registry.collect():
            for sample in family.samples:
                keys = set(sample.labels) - {"le"}
                assert keys == LABELS[family.name], (family.name, sample.labels)


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        (Code.CANCELLED, "client"),
        (Code.DEADLINE_EXCEEDED, "deadline"),
        (Code.UNAVAILABLE, "unavailable"),
        (Code.INTERNAL, "stage_error"),
        (Code.INVALID_ARGUMENT, "stage_error"),
        (Code.RESOURCE_EXHAUSTED, "stage_error"),
    ],
)
def test_abort_reason(code: int, reason: str) -> None:
    assert abort_reason(OmniError(code, "x")) == reason


def test_abort_reason_without_an_error() -> None:
    assert abort_reason(None) == "stage_error"


def test_coordinator_counts_states_and_aborts() -> None:
    m = CoordinatorMetrics()
    m.request_ended(State.COMPLETED, None, 0.1)
    m.request_ended(State.FAILED, OmniError(Code.DEADLINE_EXCEEDED, "late"), 2.0)
    m.request_ended(State.FAILED, OmniError(Code.INTERNAL, "boom", "s"), 0.2)
    m.request_ended(State.ABORTED, OmniError(Code.CANCELLED, "bye"), 0.3)
    value = m.registry.get_sample_value
    assert value("omnirail_requests_total", {"state": "completed"}) == 1
    assert value("omnirail_requests_total", {"state": "failed"}) == 2
    assert value("omnirail_requests_total", {"state": "aborted"}) == 1
    assert value("omnirail_request_duration_seconds_count", {"state": "failed"}) == 2
    assert value("omnirail_request_duration_seconds_sum", {"state": "failed"}) == 2.2
    # A completed request is no abort; every other ending is one.
    assert {r: value("omnirail_aborts_total", {"reason": r}) for r in _REASONS} == {
        "client": 1,
        "deadline": 1,
        "unavailable": 0,
        "stage_error": 1,
    }
    m.watch_running(lambda: 7)
    assert value("omnirail_requests_running") == 7
    assert value("omnirail_requests_refused_total") == 0
    m.refused()
    m.refused()
    assert value("omnirail_requests_refused_total") == 2
    # Per principal: a full mesh's refusals count as overload too, a quota's do not.
    m.refused("batch", "share")
    m.refused("batch", "rate")
    assert value("omnirail_requests_refused_total") == 3
    assert value("omnirail_principal_refused_total", {"principal": "batch", "reason": "rate"}) == 1
    m.request_ended(State.COMPLETED, None, 0.1, "web")
    assert (
        value("omnirail_principal_requests_total", {"principal": "web", "state": "completed"}) == 1
    )
    m.redispatched()
    m.replica_lost("thinker")
    m.replica_lost("thinker")
    assert value("omnirail_requests_redispatched_total") == 1
    assert value("omnirail_replicas_lost_total", {"stage": "thinker"}) == 2


_REASONS = ("client", "deadline", "unavailable", "stage_error")


def test_stage_recorder_units_edges_and_scrape_time_gauges() -> None:
    m = StageMetrics()
    depth = [5]
    rec = m.stage("mid", queue_depth=lambda: depth[0], inflight=lambda: 1 // 0)
    rec.computed(1_000_000, 3_000_000, 10_000_000)
    rec.computed(5_000, 1_000, 500)  # a wall clock that stepped back counts as zero
    rec.relay_put("shm", "down", 100, 0.5)
    rec.relay_put("shm", "down", 50, 0.25)
    rec.relay_get("shm", "up", 7, 0.125)
    value = m.registry.get_sample_value
    assert value("omnirail_stage_queue_seconds_sum", {"stage": "mid"}) == pytest.approx(0.002)
    assert value("omnirail_stage_compute_seconds_sum", {"stage": "mid"}) == pytest.approx(0.007)
    assert value("omnirail_stage_queue_seconds_count", {"stage": "mid"}) == 2
    put = {"backend": "shm", "edge": "mid->down", "op": "put"}
    get = {"backend": "shm", "edge": "up->mid", "op": "get"}
    assert value("omnirail_relay_bytes_total", put) == 150
    assert value("omnirail_relay_seconds_sum", put) == 0.75
    assert value("omnirail_relay_bytes_total", get) == 7
    assert value("omnirail_stage_queue_depth", {"stage": "mid"}) == 5
    depth[0] = 0
    assert value("omnirail_stage_queue_depth", {"stage": "mid"}) == 0
    # A callable that fails (a stage shutting down) reads NaN; the scrape still works.
    assert math.isnan(value("omnirail_stage_inflight", {"stage": "mid"}))


def _fail_on_request(value: dict[str, object]) -> dict[str, object]:
    if value.get("fail"):
        raise ValueError("asked to")
    return value


async def test_stage_observes_without_tracing() -> None:
    """Queue, compute and outcomes are observed for every request, not only sampled ones."""
    cfg = pipeline({"name": "s", "terminal": True})
    relay = create_relay("inline", RelaySettings(name_prefix="metricstest"))
    metrics = StageMetrics()
    reporter = FakeReporter()
    stage = Stage(
        "s",
        cfg,
        SimpleScheduler(_fail_on_request),
        EdgeRelays("s", relay, cfg.relay_for("s").inline_bytes),
        {relay.name: relay},
        FakeRouter(cfg),
        reporter,
        None,
        metrics,
    )
    stage.start()
    value = metrics.registry.get_sample_value
    try:
        await stage.on_item(payload("ok", {"x": 1}, to="s"), lambda _: None)
        await until(lambda: reporter.done("ok"), "the result")
        await stage.on_item(payload("bad", {"fail": True}, to="s"), lambda _: None)
        await until(lambda: reporter.failures("bad"), "the failure")
    finally:
        await stage.stop()
        relay.close()
    assert value("omnirail_stage_queue_seconds_count", {"stage": "s"}) == 1
    assert value("omnirail_stage_compute_seconds_count", {"stage": "s"}) == 1
    outcomes = {
        o: value("omnirail_stage_requests_total", {"stage": "s", "outcome": o})
        for o in ("completed", "failed", "aborted")
    }
    assert outcomes == {"completed": 1, "failed": 1, "aborted": 0}


async def test_stage_counts_aborts_and_reads_queue_depth_at_scrape() -> None:
    cfg = pipeline({"name": "s", "terminal": True})
    relay = create_relay("inline", RelaySettings(name_prefix="metricstest"))
    metrics = StageMetrics()
    scheduler = RecordingScheduler(gated=True)  # takes nothing until admitted
    stage = Stage(
        "s",
        cfg,
        scheduler,
        EdgeRelays("s", relay, cfg.relay_for("s").inline_bytes),
        {relay.name: relay},
        FakeRouter(cfg),
        FakeReporter(),
        metrics=metrics,
    )
    stage.start()
    value = metrics.registry.get_sample_value
    try:
        await stage.on_item(payload("r1", {"x": 1}, to="s"), lambda _: None)
        assert value("omnirail_stage_queue_depth", {"stage": "s"}) == 1
        assert value("omnirail_stage_inflight", {"stage": "s"}) == 1
        stage.abort("r1", "client went away")
        assert value("omnirail_stage_inflight", {"stage": "s"}) == 0
        assert value("omnirail_stage_requests_total", {"stage": "s", "outcome": "aborted"}) == 1
        stage.abort("r1")  # a second abort of the same request counts nothing
        stage.abort("never-seen")  # nor does one for a request this stage never had
        assert value("omnirail_stage_requests_total", {"stage": "s", "outcome": "aborted"}) == 1
    finally:
        await stage.stop()
        relay.close()


def test_metrics_config_defaults_and_ranges() -> None:
    stages = [
        {
            "name": "a",
            "factory": "tests.unit.stage_service.stage_fakes:make_plain",
            "terminal": True,
        }
    ]
    cfg = PipelineConfig.from_dict({"stages": stages})
    assert (cfg.metrics.enabled, cfg.metrics.host, cfg.metrics.port) == (True, "127.0.0.1", 0)
    assert cfg.metrics.stage_port == 0
    for bad in ({"port": 70000}, {"stage_port": -1}, {"host": ""}, {"colour": 1}):
        with pytest.raises(ConfigError, match="metrics"):
            PipelineConfig.from_dict({"stages": stages, "metrics": bad})


def _scrape(address: str) -> dict[str, object]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        return {f.name: f for f in text_string_to_metric_families(resp.read().decode())}


def test_http_server_serves_the_registry_on_a_free_port() -> None:
    coord, stage = _filled()
    coord_address = start_metrics_server(coord.registry, "127.0.0.1", 0)
    stage_address = start_metrics_server(stage.registry, "127.0.0.1", 0)
    try:
        assert coord_address.startswith("127.0.0.1:") and not coord_address.endswith(":0")
        assert coord_address != stage_address
        coord_families = _scrape(coord_address)
        assert set(coord_families) == COORDINATOR_FAMILIES
        running = coord_families["omnirail_requests_running"]
        assert [s.value for s in running.samples] == [2]  # type: ignore[attr-defined]
        stage_families = _scrape(stage_address)
        assert set(stage_families) == set(LABELS) - COORDINATOR_FAMILIES
        relay = stage_families["omnirail_relay_bytes"].samples  # type: ignore[attr-defined]
        by_edge = {s.labels["edge"]: s.value for s in relay if s.name.endswith("_total")}
        assert by_edge == {"a->b": 1 << 20, "src->a": 1 << 10}
    finally:
        stop_metrics_server(coord_address)
        stop_metrics_server(stage_address)
    with pytest.raises(urllib.error.URLError):
        _scrape(coord_address)
