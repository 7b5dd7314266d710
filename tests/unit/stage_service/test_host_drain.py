"""How long an idle stage process waits when it drains: `DRAIN_SETTLE_S` of quiet while a
coordinator is attached (items routed before the topology changed may still arrive), and
no settling once none is (a request cannot end without one: the whole mesh is stopping);
and how briefly a stopping process's stage waits for a compute thread still busy."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from omnirail.stage.scheduler import ThreadScheduler
from omnirail.stage_service import host as host_module
from omnirail.stage_service.attach import AttachClient
from omnirail.stage_service.host import StageHost
from omnirail.v1 import mesh_pb2
from omnirail.wire.errors import unavailable
from tests.unit.stage_service.stage_fakes import pipeline, running


def _host(attached: bool) -> StageHost:
    cfg = pipeline({"name": "a", "terminal": True})
    host = StageHost(cfg, ["a"], coordinator="unix:///nowhere", listen="unix:///nowhere")
    attach = AttachClient("unix:///nowhere", mesh_pb2.Register(stage="a"), lambda _cmd: None)
    if attached:
        attach.connected.set()
    host._attach["a"] = attach
    host._released.add("a")  # the coordinator released it: only the settle is left
    return host


async def _drain(host: StageHost) -> tuple[bool, float]:
    t0 = time.monotonic()
    drained = await host.drain(60.0)
    return drained, time.monotonic() - t0


async def test_with_a_coordinator_attached_an_idle_process_settles_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(host_module, "DRAIN_SETTLE_S", 0.5)
    drained, took = await _drain(_host(attached=True))
    assert drained
    assert took >= 0.5, took  # a lower bound: true however busy the host


async def test_with_no_coordinator_attached_an_idle_process_does_not_settle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A settle this long would outlast the test's timeout: only not settling passes.
    monkeypatch.setattr(host_module, "DRAIN_SETTLE_S", 3600.0)
    drained, _ = await asyncio.wait_for(_drain(_host(attached=False)), 30)
    assert drained


async def test_a_busy_process_is_not_drained_by_the_coordinator_being_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    host = _host(attached=False)
    host._attach["a"].fail("r1", unavailable("x"))  # an event not yet sent
    drained = await host.drain(0.2)
    assert not drained


class _Stuck(ThreadScheduler):
    """A compute thread busy for 30 s (for a request aborted or failed meanwhile)."""

    def __init__(self) -> None:
        super().__init__("stuck")
        self.release = threading.Event()

    def _run(self) -> None:
        self.release.wait(30)


async def test_a_stopping_stage_waits_for_busy_compute_only_briefly() -> None:
    cfg = pipeline({"name": "a", "terminal": True})
    scheduler = _Stuck()
    async with running(cfg, "a", scheduler) as harness:
        try:
            # Without the bound, stop waits the scheduler's 5 s join: past this timeout.
            await asyncio.wait_for(harness.stage.stop(compute_wait_s=0.2), 4)
        finally:
            scheduler.release.set()  # the harness's own stop then finds it ended
