"""The launcher's supervision: a stage process that exits is started again.

Every stage process is a *unit*, and so is every tensor-parallel rank group (its ranks
only work together: when one exits, rank 0 has already failed the calls in flight with
UNAVAILABLE, see `omnirail/stage/tp.py`, and the group's other ranks are stopped). A unit
whose process exits while the mesh runs is restarted after a backoff (the stage's
`restart` config: `backoff_s` doubling up to `backoff_max_s`), a TP group on a fresh
rendezvous port. More than `max` restarts within `window_s` is a crash loop: the unit
stays down with a clear message, and the rest of the mesh keeps serving what does not
need it. The restarted process registers with the coordinator like a new replica; no one
has to do anything.

A stage process that stops answering without exiting (stopped with SIGSTOP, its event
loop wedged) stops touching its heartbeat file (`omnirail stage --heartbeat`); once the
beat is older than the pipeline's `liveness_s` plus `KILL_AFTER_S`, the process is killed
(SIGKILL: a stopped process takes no other signal) and restarted like one that exited.
The extra time lets the coordinator notice the silence on its Attach stream first and
move its requests on, saying why ("stopped answering", not "went away").

`snapshot()` is what `omnirail status` shows: each process's pid, restarts and last exit.
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

from omnirail.config import RestartConfig
from omnirail.ops.plan import StageProcess

POLL_S = 0.05
KILL_AFTER_S = 2.0
STOP_GRACE_S = 2.0


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A port free right now (rank 0 binds it for the rendezvous a moment later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class Unit:
    """The processes that live and die together: one stage process, or a TP group."""

    name: str
    processes: list[StageProcess]
    policy: RestartConfig
    children: list[Any] = field(default_factory=list)  # the launcher's _Child per process
    restarts: list[float] = field(default_factory=list)  # times, within the window
    total_restarts: int = 0
    last_exit: dict[str, Any] | None = None
    restart_at: float | None = None  # when a pending restart is due (monotonic)
    gave_up: bool = False
    hung: bool = False  # its last process was killed for not answering
    rolling: bool = False  # being restarted on purpose (`restart_unit`): not a crash

    @property
    def tp(self) -> bool:
        return self.processes[0].tp_rank is not None


class Supervisor:
    """Starts units through `spawn(process, tp_init_method | None) -> child` and restarts
    a unit whose process exited, from a thread, until `stop()`."""

    def __init__(
        self,
        spawn: Callable[[StageProcess, str | None], Any],
        progress: Callable[[str], None],
        on_change: Callable[[], None] | None = None,
        liveness_s: float | None = None,
        on_exit: Callable[[Any], None] | None = None,
    ) -> None:
        self._spawn = spawn
        self._liveness_s = liveness_s
        # Called with each stage process that exited while the mesh runs (cleanup).
        self._on_exit = on_exit or (lambda child: None)
        self._progress = progress
        self._on_change = on_change or (lambda: None)
        self.units: dict[str, Unit] = {}
        self.lock = threading.RLock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start_unit(self, name: str, processes: list[StageProcess], policy: RestartConfig) -> None:
        unit = self.units.setdefault(name, Unit(name, processes, policy))
        init = f"tcp://127.0.0.1:{free_tcp_port()}" if unit.tp else None
        unit.children = [self._spawn(p, init) for p in processes]

    def watch(self) -> None:
        if self.units and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
            self._thread.start()

    def owns(self, child: Any) -> bool:
        """Whether `child` is a stage process of a unit (of any start of it)."""
        return any(child.name == c.name for u in self.units.values() for c in u.children)

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(10)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Per process: pid, state (running; restarting; stopped: out of restarts; exited:
        not handled yet), restarts, last exit."""
        out: dict[str, dict[str, Any]] = {}
        with self.lock:
            for unit in self.units.values():
                for child in unit.children:
                    if child.proc.poll() is None:
                        state = "running"
                    elif unit.gave_up:
                        state = "stopped"
                    elif unit.restart_at is not None:
                        state = "restarting"
                    else:
                        state = "exited"  # the watch has not seen it yet
                    out[child.name] = {
                        "pid": child.proc.pid,
                        "state": state,
                        "restarts": unit.total_restarts,
                        "last_exit": unit.last_exit,
                    }
        return out

    def restart_unit(self, name: str, stop_wait_s: float) -> None:
        """Restarts a unit on purpose (`omnirail restart`): SIGTERM (the process drains:
        new work goes elsewhere, what it holds finishes), up to `stop_wait_s` for it to
        exit (then SIGKILL), and a new start at once (by the watch), outside the restart
        budget. A TP group's rank 0 drains first; its followers are stopped after it."""
        unit = self.units[name]
        with self.lock:
            unit.rolling = True
        try:
            leaders = [c for c in unit.children if not _follower(c)]
            for batch in (leaders, [c for c in unit.children if _follower(c)]):
                for child in batch:
                    if child.proc.poll() is None:
                        child.proc.send_signal(signal.SIGTERM)
                end = time.monotonic() + stop_wait_s
                for child in batch:
                    try:
                        child.proc.wait(timeout=max(0.0, end - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        self._progress(f"{child.name} did not drain in {stop_wait_s:g}s: SIGKILL")
                        child.proc.kill()
                        child.proc.wait()
            with self.lock:
                unit.last_exit = {
                    "process": unit.children[0].name,
                    "code": unit.children[0].proc.returncode,
                    "at": time.time(),
                    "restarted": True,
                }
                unit.total_restarts += 1
                unit.gave_up = False
                for child in unit.children:
                    self._on_exit(child)
                # The watch thread starts it, not this (short-lived) caller's thread: a
                # stage process dies with the thread that started it (PR_SET_PDEATHSIG,
                # see launcher.die_with_parent).
                unit.restart_at = time.monotonic()
        finally:
            with self.lock:
                unit.rolling = False
            self._on_change()

    # ---- the watch ---------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.wait(POLL_S):
            for unit in list(self.units.values()):
                if unit.gave_up or unit.rolling or self._stopping.is_set():
                    continue
                with self.lock:
                    if unit.restart_at is not None:
                        if time.monotonic() >= unit.restart_at:
                            unit.restart_at = None
                            self._progress(f"restarting {unit.name!r}")
                            self.start_unit(unit.name, unit.processes, unit.policy)
                            self._on_change()
                        continue
                    self._kill_silent(unit)
                    exited = [c for c in unit.children if c.proc.poll() is not None]
                    if exited:
                        self._exited(unit, exited[0])
                        self._on_change()

    def _kill_silent(self, unit: Unit) -> None:
        """SIGKILLs a running process whose heartbeat is older than `liveness_s` +
        `KILL_AFTER_S` (one that has not beaten yet is starting up: not judged)."""
        if self._liveness_s is None:
            return
        for child in unit.children:
            beat = getattr(child, "heartbeat", None)
            if beat is None or child.proc.poll() is not None:
                continue
            try:
                silent = time.time() - beat.stat().st_mtime
            except FileNotFoundError:
                continue
            if silent > self._liveness_s + KILL_AFTER_S:
                self._progress(
                    f"{child.name} has not answered for {silent:.1f}s (liveness_s "
                    f"{self._liveness_s:g}): killing it"
                )
                unit.hung = True
                child.proc.kill()
                child.proc.wait()

    def _exited(self, unit: Unit, child: Any) -> None:
        for c in unit.children:
            if c.proc.poll() is not None:
                self._on_exit(c)
        code = child.proc.returncode
        unit.last_exit = {"process": child.name, "code": code, "at": time.time()}
        if unit.hung:
            unit.last_exit["hung"] = True
            unit.hung = False
        self._stop_others(unit)
        now = time.monotonic()
        policy = unit.policy
        unit.restarts = [t for t in unit.restarts if now - t < policy.window_s]
        if len(unit.restarts) >= policy.max:
            unit.gave_up = True
            self._progress(
                f"{child.name} exited with code {code}; {unit.name!r} restarted "
                f"{len(unit.restarts)} time(s) in the last {policy.window_s:g}s (restart.max "
                f"{policy.max}): not restarting it; the rest of the mesh keeps serving"
            )
            return
        delay = min(policy.backoff_max_s, policy.backoff_s * 2 ** len(unit.restarts))
        unit.restarts.append(now)
        unit.total_restarts += 1
        unit.restart_at = now + delay
        what = "tensor-parallel group" if unit.tp else "stage process"
        self._progress(
            f"{child.name} exited with code {code}: restarting {what} {unit.name!r} in "
            f"{delay:g}s (restart {len(unit.restarts)} of {policy.max} in {policy.window_s:g}s)"
        )

    @staticmethod
    def _stop_others(unit: Unit) -> None:
        for child in unit.children:
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + STOP_GRACE_S
        for child in unit.children:
            try:
                child.proc.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()


def _follower(child: Any) -> bool:
    """A TP rank other than 0 (its name ends `_tp<N>`, N > 0)."""
    _, sep, rank = child.name.rpartition("_tp")
    return bool(sep) and rank.isdigit() and int(rank) > 0
