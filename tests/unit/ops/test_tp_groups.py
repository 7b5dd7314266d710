"""RankGroups: a tensor-parallel group whose rank exits is stopped and started again whole,
on a fresh rendezvous, within a restart budget (real processes stand in for the ranks)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from omnirail.ops.plan import StageProcess
from omnirail.ops.tp_groups import RankGroups

RANKS = [StageProcess("mlp", ("mlp",), None, (), r, 2) for r in range(2)]


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]


class Spawner:
    def __init__(self) -> None:
        self.started: list[tuple[Child, str]] = []

    def __call__(self, p: StageProcess, init: str) -> Child:
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


def wait_for(cond, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end
        time.sleep(0.02)


def test_a_rank_that_exits_restarts_the_whole_group(spawner: Spawner) -> None:
    said: list[str] = []
    groups = RankGroups(spawner, said.append)
    groups.start_group("mlp", RANKS)
    first = [c for c, _ in spawner.started]
    assert [c.name for c in first] == ["stage-mlp_tp0", "stage-mlp_tp1"]
    assert spawner.started[0][1] == spawner.started[1][1]  # one rendezvous per start
    assert spawner.started[0][1].startswith("tcp://127.0.0.1:")
    groups.watch()
    try:
        first[1].proc.kill()
        wait_for(lambda: len(spawner.started) == 4)
        assert first[0].proc.wait(10) is not None  # the live rank was stopped too
        again = [c for c, _ in spawner.started[2:]]
        assert all(c.proc.poll() is None for c in again)
        assert groups.owns(first[1]) and groups.owns(again[0])
        assert any("restarting tensor-parallel group 'mlp'" in s for s in said)
    finally:
        groups.stop()


def test_the_group_gives_up_past_its_budget(spawner: Spawner) -> None:
    said: list[str] = []
    groups = RankGroups(spawner, said.append, budget=1, window_s=60)
    groups.start_group("mlp", RANKS)
    groups.watch()
    try:
        spawner.started[0][0].proc.kill()
        wait_for(lambda: len(spawner.started) == 4)
        spawner.started[2][0].proc.kill()
        wait_for(lambda: groups.groups["mlp"].gave_up)
        assert len(spawner.started) == 4  # no third start
        assert not groups.owns(spawner.started[2][0])  # its exit is the mesh's now
        assert any("giving up" in s for s in said)
    finally:
        groups.stop()
