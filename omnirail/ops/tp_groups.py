"""The launcher's watch over tensor-parallel rank groups: one rank gone, the group restarts.

A TP stage's ranks (`{process}_tp{rank}`) only work together: the model's collectives
need every rank. When one exits, rank 0 has already failed the calls in flight with
UNAVAILABLE (`stage_service/tp.py`); this stops the group's other ranks and starts every
rank again, on a fresh rendezvous port, within a restart budget (then it gives up and
the group's exit is reported like any other process's).
"""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omnirail.ops.plan import StageProcess

POLL_S = 0.05
STOP_GRACE_S = 2.0


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A port free right now (rank 0 binds it for the rendezvous a moment later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class RankGroup:
    """The rank processes of one TP stage replica, and their restarts."""

    name: str
    ranks: list[StageProcess]
    children: list[Any] = field(default_factory=list)  # the launcher's _Child per rank
    restarts: list[float] = field(default_factory=list)
    gave_up: bool = False


class RankGroups:
    """Starts rank groups through `spawn(process, init_method) -> child` and restarts a
    group whose rank exited, from a thread, until `stop()`."""

    def __init__(
        self,
        spawn: Callable[[StageProcess, str], Any],
        progress: Callable[[str], None],
        *,
        budget: int = 10,
        window_s: float = 60.0,
    ) -> None:
        self._spawn = spawn
        self._progress = progress
        self._budget = budget
        self._window_s = window_s
        self.groups: dict[str, RankGroup] = {}
        self.lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start_group(self, name: str, ranks: list[StageProcess]) -> None:
        group = self.groups.setdefault(name, RankGroup(name, ranks))
        init = f"tcp://127.0.0.1:{free_tcp_port()}"
        group.children = [self._spawn(p, init) for p in ranks]

    def watch(self) -> None:
        if self.groups and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tp-groups", daemon=True)
            self._thread.start()

    def owns(self, child: Any) -> bool:
        """Whether `child` is a rank (of any start of its group) this watch restarts: its
        exit is not the mesh's, unless the group gave up."""
        return any(
            not g.gave_up and any(child.name == c.name for c in g.children)
            for g in self.groups.values()
        )

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        while not self._stopping.wait(POLL_S):
            for group in list(self.groups.values()):
                if group.gave_up:
                    continue
                exited = [c for c in group.children if c.proc.poll() is not None]
                if exited and not self._stopping.is_set():
                    with self.lock:
                        self._restart(group, exited[0])

    def _restart(self, group: RankGroup, exited: Any) -> None:
        now = time.monotonic()
        group.restarts = [t for t in group.restarts if now - t < self._window_s]
        self._progress(
            f"{exited.name} exited with code {exited.proc.returncode}: restarting "
            f"tensor-parallel group {group.name!r} ({len(group.ranks)} ranks)"
        )
        for child in group.children:
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + STOP_GRACE_S
        for child in group.children:
            try:
                child.proc.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
        if len(group.restarts) >= self._budget:
            group.gave_up = True
            self._progress(
                f"tensor-parallel group {group.name!r} restarted {self._budget} times in "
                f"{self._window_s:g}s; giving up"
            )
            return
        group.restarts.append(now)
        self.start_group(group.name, group.ranks)
