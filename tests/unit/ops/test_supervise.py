"""Supervisor: a stage process (or a whole tensor-parallel group) that exits is started again
after a backoff, within a restart budget; past it, it stays down. Real processes stand in
for the stage processes."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from omnirail.config import RestartConfig
from omnirail.ops.plan import StageProcess
from omnirail.ops.supervise import Supervisor

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
