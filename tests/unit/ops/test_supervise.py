"""Supervisor: a stage process (or a whole tensor-parallel group) that exits is started again
after a backoff, within a restart budget; past it, it stays down. Real processes stand in
for the stage processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from omnirail.config import RestartConfig
from omnirail.ops.plan import StageProcess
from omnirail.ops.supervise import KILL_AFTER_S, Supervisor

RANKS = [StageProcess("mlp", ("mlp",), None, (), r, 2) for r in range(2)]
ONE = [StageProcess("enc", ("enc",))]
FAST = RestartConfig(max=5, window_s=60, backoff_s=0.0)


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]


class Spawner:
    def __init__(self) -> None:
        self.started: list[tuple[Child, str | None]] = []

    def __call__(self, p: StageProcess, init: str | None) -> Child:
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        child = Child(f"stage-{p.name}", proc)
        self.started.append((child, init))
        return child

    def stop_all(self) -> None:
        for child, _ in self.started:
            if child.proc.poll() is None:
                child.proc.kill()
            child.proc.wait()


@pytest.fixture
def spawner() -> Iterator[Spawner]:
    s = Spawner()
    yield s
    s.stop_all()


def wait_for(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end
        time.sleep(0.02)


def test_a_stage_process_that_exits_is_restarted_and_counted(spawner: Spawner) -> None:
    said: list[str] = []
    changes: list[int] = []
    sup = Supervisor(spawner, said.append, lambda: changes.append(1))
    sup.start_unit("stage-enc", ONE, FAST)
    assert spawner.started[0][1] is None  # no rendezvous for a plain process
    sup.watch()
    try:
        first = spawner.started[0][0]
        first.proc.kill()
        wait_for(lambda: len(spawner.started) == 2)
        status = sup.snapshot()["stage-enc"]
        assert status["restarts"] == 1 and status["state"] == "running"
        assert status["pid"] == spawner.started[1][0].proc.pid
        assert status["last_exit"]["code"] == -9 and status["last_exit"]["process"] == "stage-enc"
        assert any("stage-enc exited with code -9: restarting stage process" in s for s in said)
        assert changes and sup.owns(first)
    finally:
        sup.stop()


def test_a_rank_that_exits_restarts_the_whole_group(spawner: Spawner) -> None:
    said: list[str] = []
    sup = Supervisor(spawner, said.append)
    sup.start_unit("stage-mlp", RANKS, FAST)
    first = [c for c, _ in spawner.started]
    assert [c.name for c in first] == ["stage-mlp_tp0", "stage-mlp_tp1"]
    assert spawner.started[0][1] == spawner.started[1][1]  # one rendezvous per start
    assert (spawner.started[0][1] or "").startswith("tcp://127.0.0.1:")
    sup.watch()
    try:
        first[1].proc.kill()
        wait_for(lambda: len(spawner.started) == 4)
        assert first[0].proc.wait(10) is not None  # the live rank was stopped too
        again = [c for c, _ in spawner.started[2:]]
        assert all(c.proc.poll() is None for c in again)
        assert spawner.started[2][1] != spawner.started[0][1]  # a fresh rendezvous
        assert any("restarting tensor-parallel group 'stage-mlp'" in s for s in said)
    finally:
        sup.stop()


def test_backoff_doubles_and_a_crash_loop_past_the_budget_stays_down(spawner: Spawner) -> None:
    said: list[str] = []
    sup = Supervisor(spawner, said.append)
    sup.start_unit("stage-enc", ONE, RestartConfig(max=2, window_s=60, backoff_s=0.2))
    sup.watch()
    try:
        spawner.started[0][0].proc.kill()
        wait_for(lambda: len(spawner.started) == 2)
        spawner.started[1][0].proc.kill()
        wait_for(lambda: len(spawner.started) == 3)
        assert any("in 0.2s (restart 1 of 2" in s for s in said), said
        assert any("in 0.4s (restart 2 of 2" in s for s in said), said
        spawner.started[2][0].proc.kill()
        wait_for(lambda: sup.units["stage-enc"].gave_up)
        time.sleep(0.3)
        assert len(spawner.started) == 3  # no fourth start
        assert sup.snapshot()["stage-enc"]["state"] == "stopped"
        assert any("not restarting it; the rest of the mesh keeps serving" in s for s in said)
    finally:
        sup.stop()


def test_max_zero_never_restarts(spawner: Spawner) -> None:
    sup = Supervisor(spawner, lambda _: None)
    sup.start_unit("stage-enc", ONE, RestartConfig(max=0))
    sup.watch()
    try:
        spawner.started[0][0].proc.kill()
        wait_for(lambda: sup.units["stage-enc"].gave_up)
        assert len(spawner.started) == 1
    finally:
        sup.stop()


def test_a_process_whose_heartbeat_stops_is_killed_and_restarted(
    spawner: Spawner, tmp_path: Path
) -> None:
    """A process that has not beaten yet is starting: left alone. One whose beat grew
    older than liveness_s + KILL_AFTER_S is killed (it may be stopped: SIGKILL) and
    restarted; its last exit says so."""
    said: list[str] = []
    beats: list[Path] = []

    def spawn(p: StageProcess, init: str | None) -> Child:
        child = spawner(p, init)
        child.heartbeat = tmp_path / f"beat-{len(spawner.started)}"  # type: ignore[attr-defined]
        beats.append(child.heartbeat)  # type: ignore[attr-defined]
        return child

    sup = Supervisor(spawn, said.append, liveness_s=0.1)
    sup.start_unit("stage-enc", ONE, FAST)
    sup.watch()
    try:
        time.sleep(KILL_AFTER_S + 0.5)
        assert len(spawner.started) == 1  # no beat yet: starting up, not judged
        beats[0].touch()
        old = time.time() - (KILL_AFTER_S + 1)
        os.utime(beats[0], (old, old))
        wait_for(lambda: len(spawner.started) == 2)
        status = sup.snapshot()["stage-enc"]
        assert status["last_exit"]["code"] == -9 and status["last_exit"]["hung"] is True
        assert any("has not answered for" in s and "killing it" in s for s in said), said
        beats[1].touch()  # the new one beats: it stays
        time.sleep(0.3)
        assert len(spawner.started) == 2
    finally:
        sup.stop()


def test_a_planned_restart_is_outside_the_budget(spawner: Spawner) -> None:
    """`restart_unit` (omnirail restart): SIGTERM, a new start by the watch thread at once,
    counted in the status but not against `restart.max`, even at max 0."""
    sup = Supervisor(spawner, lambda _: None)
    sup.start_unit("stage-enc", ONE, RestartConfig(max=0))
    sup.watch()
    try:
        sup.restart_unit("stage-enc", stop_wait_s=10)
        wait_for(lambda: len(spawner.started) == 2)
        assert spawner.started[0][0].proc.returncode == -15  # SIGTERM, not killed
        status = sup.snapshot()["stage-enc"]
        assert status["state"] == "running" and status["restarts"] == 1
        assert status["last_exit"]["restarted"] is True
        assert sup.units["stage-enc"].restarts == [] and not sup.units["stage-enc"].gave_up
    finally:
        sup.stop()
