"""`omnirail up`: the coordinator and one process per stage process group, as children.

Every child sets PR_SET_PDEATHSIG on itself (see `die_with_parent`) so it dies with the
launcher even when the launcher is killed hard; `stop()` terminates them in order and
sweeps the run's shared-memory names. No `preexec_fn`: forking a process that runs gRPC
threads in Python code crashes the child in gRPC's fork handlers; spawning without it
lets subprocess use vfork/posix_spawn.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omnirail.client.connect import client_options
from omnirail.config import PipelineConfig, load_pipeline
from omnirail.ops.plan import StageProcess, plan_processes
from omnirail.ops.supervise import Supervisor
from omnirail.telemetry import SPAN_DIR_ENV
from omnirail.tuning.cpu_latency import CpuWakeLatency, check_us, try_hold
from omnirail.tuning.cpus import available_cpus, format_cpus, spread
from omnirail.wire.errors import Code, OmniError

if TYPE_CHECKING:
    from omnirail.client.sdk import Client

_PR_SET_PDEATHSIG = 1


PARENT_ENV = "OMNIRAIL_DIE_WITH_PARENT"


# Set in a replicated stage process: its replica index within its process group.
REPLICA_ENV = "OMNIRAIL_REPLICA"


def die_with_parent() -> None:
    """In a launched child: exit with SIGTERM when the launcher (its parent) dies.
    Strictly, when the launcher's *thread* that started it ends (that is how
    PR_SET_PDEATHSIG works): stage processes are started from long-lived threads only
    (the main one, the supervisor's watch)."""
    parent = os.environ.pop(PARENT_ENV, None)
    if not parent:
        return
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent):  # the launcher died before prctl took effect
        sys.exit(1)


def state_dir() -> Path:
    """Where this process writes a detached mesh's state and log: under
    ``$XDG_RUNTIME_DIR``, else the temporary directory."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    path = Path(base) / f"omnirail-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


# Where a mesh started from another shell may have its state: the usual XDG_RUNTIME_DIR
# (systemd's), and the temporary directory of a shell with no TMPDIR.
STATE_BASES = ("/run/user/{uid}", "/tmp")


def state_dirs() -> list[Path]:
    """Every place a mesh of this user may have written its state: a shell whose
    ``XDG_RUNTIME_DIR`` (or ``TMPDIR``) differs from the one that started the mesh (su,
    ssh, sudo -u, a service) still finds it. Only directories this user owns and nobody
    else may write are read: a state file names a pid that `down` signals."""
    uid = os.getuid()
    bases = [
        os.environ.get("XDG_RUNTIME_DIR"),
        tempfile.gettempdir(),
        *(base.format(uid=uid) for base in STATE_BASES),
    ]
    found: list[Path] = []
    for base in bases:
        if not base:
            continue
        path = Path(base) / f"omnirail-{uid}"
        try:
            st = path.stat()
        except OSError:
            continue
        if st.st_uid != uid or st.st_mode & 0o022 or path.resolve() in found:
            continue
        found.append(path.resolve())
    return found


@dataclass
class _Child:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    # A file the process touches every second while its event loop runs (None: no beat).
    heartbeat: Path | None = None

    def log_tail(self, lines: int) -> list[str]:
        return self.log.read_text(errors="replace").splitlines()[-lines:]


class Mesh:
    """A running local mesh. Use as a context manager or call `start()`/`stop()`."""

    def __init__(
        self,
        pipeline_path: str | os.PathLike[str],
        *,
        transport: str | None = None,
        host: str | None = None,
        port: int = 0,
        run_dir: str | None = None,
        progress: Callable[[str], None] | None = None,
        env: Mapping[str, str] | None = None,
        pin: bool = False,
        cpu_wake_latency_us: int | None = None,
        tls: str | None = None,
        http: str | None = None,
    ) -> None:
        """`pin`: each process whose stages (or coordinator) configure no `cpus` is pinned
        to one CPU, round-robin over the CPUs this process may use.
        `cpu_wake_latency_us`: overrides the pipeline's (see omnirail/cpu_latency.py).
        `tls="auto"`: a throwaway CA, mesh certificate and mesh secret in the run folder
        (mutual TLS on mesh-internal hops); otherwise the pipeline's `security:` and the
        OMNIRAIL_TLS_* environment decide.
        `http="HOST:PORT"`: also an `omnirail gateway` (OpenAI HTTP) there, once the mesh
        is ready; its URL is `http_address`."""
        if tls not in (None, "auto"):
            raise ValueError(f"tls must be 'auto' or None, not {tls!r}")
        self._extra_env = dict(env or {})
        self.pin = pin
        self.wake_override = None if cpu_wake_latency_us is None else check_us(cpu_wake_latency_us)
        self._wake: CpuWakeLatency | None = None
        self.pipeline_path = str(Path(pipeline_path).resolve())
        self.pipeline: PipelineConfig = load_pipeline(self.pipeline_path)
        ep = self.pipeline.endpoints
        self.transport = transport or ep.transport
        if self.transport not in ("unix", "tcp"):
            raise ValueError(f"transport must be 'unix' or 'tcp', not {self.transport!r}")
        self.host = host or ep.host
        self.port = port
        self._own_run_dir = run_dir is None and ep.base_path is None
        self.run_dir = Path(run_dir or ep.base_path or tempfile.mkdtemp(prefix="omnirail-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.run_id = uuid.uuid4().hex[:8]
        self.shm_prefix = f"omnirail-{self.run_id}"
        from omnirail.transport.security import mesh_security

        if tls == "auto":
            from omnirail.ops.certs import make_mesh_material, material_env

            material = make_mesh_material(self.run_dir / "tls", [self.host])
            self._extra_env.update(material_env(material))
        # Read now, so missing or unreadable material fails `up` before anything starts.
        self.security = mesh_security(self.pipeline, {**os.environ, **self._extra_env})
        self._progress = progress or (lambda msg: None)
        self._children: list[_Child] = []
        self._supervisor = Supervisor(
            self._spawn_stage,
            self._progress,
            self._write_status,
            self.pipeline.liveness_s,
            on_exit=self._exited,
        )
        self._stage_flags: dict[str, list[str]] = {}
        self.address: str | None = None
        if http is not None and self.pipeline.api.openai is None:
            raise ValueError(
                f"--http: pipeline {self.pipeline.name!r} has no api.openai section "
                "(see docs/guides/front-doors.md)"
            )
        self.http = http
        self.http_address: str | None = None

    def __enter__(self) -> Mesh:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- start -----------------------------------------------------------------

    def _listen(self, name: str) -> str:
        if self.transport == "unix":
            return f"unix://{self.run_dir / (name + '.sock')}"
        return f"{self.host}:0"

    def _spawn(self, name: str, args: list[str], env: Mapping[str, str] | None = None) -> _Child:
        log = self.run_dir / "logs" / f"{name}.log"
        log.parent.mkdir(exist_ok=True)
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "omnirail", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**self._child_env(), **(env or {})},
            )
        child = _Child(name, proc, log)
        self._children.append(child)
        return child

    def client_options(self) -> dict[str, Any]:
        """What a client of this mesh needs besides its address: TLS and a token."""
        return client_options(self.security)

    def client_state(self) -> dict[str, Any]:
        """What `omnirail` commands need to be this mesh's clients (paths, no secrets)."""
        tls = self.security.config.tls
        return {
            "tls_ca": tls.ca if tls is not None else None,
            "tls": tls is not None,
            "server_name": tls.server_name if tls is not None else None,
            "tokens_file": self.security.config.tokens_file,
            "tokens_env": self.security.config.tokens_env,
        }

    def client(self, **kwargs: Any) -> Client:
        """A `Client` of this mesh (TLS and a token when it is secured)."""
        from omnirail.client.sdk import Client

        return Client(self.address or "", **self.client_options(), **kwargs)

    @property
    def span_dir(self) -> Path:
        """Where processes write spans when no OTLP endpoint is configured."""
        return self.run_dir / "spans"

    def _child_env(self) -> dict[str, str]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", PARENT_ENV: str(os.getpid())}
        # Each process names itself (omnirail-coordinator, omnirail-stage-<name>); one
        # inherited name would merge every service into one.
        env.pop("OTEL_SERVICE_NAME", None)
        env.setdefault(SPAN_DIR_ENV, str(self.span_dir))
        env.update(self._extra_env)
        return env

    def start(self, timeout: float = 180.0) -> str:
        try:
            return self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        ready_file = self.run_dir / "coordinator.addr"
        ready_file.unlink(missing_ok=True)
        listen = (
            f"{self.host}:{self.port}" if self.transport == "tcp" else self._listen("coordinator")
        )
        planned = plan_processes(self.pipeline)
        processes = {f"stage-{p.name}": list(p.stages) for p in planned}
        pinned = self._pinned(processes)
        wake = self._hold_wake_latency()
        self._stage_flags = {name: [*pinned.get(name, []), *wake] for name in processes}
        self._progress(f"starting coordinator ({listen})")
        coord = self._spawn(
            "coordinator",
            [
                "coordinator",
                "--pipeline",
                self.pipeline_path,
                "--listen",
                listen,
                "--ready-file",
                str(ready_file),
                *pinned.get("coordinator", []),
                *wake,
            ],
        )
        while not ready_file.exists() or not ready_file.read_text():
            self._check_alive(coord)
            if time.monotonic() > deadline:
                raise OmniError(Code.UNAVAILABLE, f"coordinator did not start in {timeout:g}s")
            time.sleep(0.02)
        self.address = ready_file.read_text().strip()
        # Units the supervisor restarts: each stage process, and each TP rank group whole.
        units: dict[str, list[StageProcess]] = {}
        for p in planned:
            units.setdefault(p.replica_name if p.tp_rank is not None else p.name, []).append(p)
        for name, members in units.items():
            policy = self.pipeline.stage(members[0].stages[0]).restart
            self._supervisor.start_unit(f"stage-{name}", members, policy)
        self._wait_ready(deadline)
        if self.http is not None:
            self._start_gateway(deadline, timeout)
        self._supervisor.watch()
        self._write_status()
        return self.address

    def _start_gateway(self, deadline: float, timeout: float) -> None:
        assert self.http is not None and self.address is not None
        ready_file = self.run_dir / "gateway.addr"
        ready_file.unlink(missing_ok=True)
        self._progress(f"starting gateway ({self.http})")
        gateway = self._spawn(
            "gateway",
            [
                "gateway",
                "--pipeline",
                self.pipeline_path,
                "--coordinator",
                self.address,
                "--listen",
                self.http,
                "--ready-file",
                str(ready_file),
            ],
        )
        while not ready_file.exists() or not ready_file.read_text():
            self._check_alive(gateway)
            if time.monotonic() > deadline:
                raise OmniError(Code.UNAVAILABLE, f"gateway did not start in {timeout:g}s")
            time.sleep(0.02)
        self.http_address = ready_file.read_text().strip()
        self._progress(f"gateway at {self.http_address}")

    @property
    def status_file(self) -> Path:
        """Each stage process's pid, state, restarts and last exit (`omnirail status`)."""
        return self.run_dir / "processes.json"

    def status(self) -> dict[str, dict[str, object]]:
        return self._supervisor.snapshot()

    def _write_status(self) -> None:
        tmp = self.status_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._supervisor.snapshot()))
        os.replace(tmp, self.status_file)

    def _spawn_stage(self, p: StageProcess, tp_init: str | None = None) -> _Child:
        name = f"stage-{p.name}"
        self._progress(f"starting process {name!r}: stages {', '.join(p.stages)}")
        assert self.address is not None
        args = [
            "stage",
            "--pipeline",
            self.pipeline_path,
            "--stage",
            ",".join(p.stages),
            "--coordinator",
            self.address,
            "--listen",
            self._listen(name),
            "--shm-prefix",
            self.shm_prefix,
            *self._stage_flags.get(name, []),
        ]
        if tp_init is not None:  # one rank of a tensor-parallel stage
            args += ["--tp-rank", str(p.tp_rank), "--tp-init", tp_init]
        heartbeat = None
        if not p.tp_rank:  # followers run no loop: rank 0 notices a broken group
            heartbeat = self.run_dir / "heartbeats" / name
            heartbeat.parent.mkdir(exist_ok=True)
            heartbeat.unlink(missing_ok=True)  # a new process: no beat until it runs
            args += ["--heartbeat", str(heartbeat)]
        # Which replica of its group it is (0, 1, ...), for stage code and logs that care.
        env = {REPLICA_ENV: str(p.replica)} if p.replica is not None else {}
        child = self._spawn(name, args, env)
        child.heartbeat = heartbeat
        return child

    def _hold_wake_latency(self) -> list[str]:
        """Holds the wake-latency bound here too, so that a host refusing it is reported
        at start-up rather than only in each process's log; returns the flag that hands
        an override to each process (without one, each reads the pipeline's)."""
        us = self.wake_override
        if us is None:
            us = self.pipeline.cpu_wake_latency_us
        if us is None:
            return []
        self._wake, error = try_hold(us)
        if error is None:
            self._progress(f"idle CPUs held to wake within {us} µs")
        else:
            self._progress(f"warning: cpu_wake_latency_us {us} not applied: {error}")
        return [] if self.wake_override is None else ["--cpu-wake-latency-us", str(us)]

    def _pinned(self, stage_processes: dict[str, list[str]]) -> dict[str, list[str]]:
        """`--cpus` flags for the processes `pin` spreads: the coordinator, then the stage
        processes, each unless the pipeline configures its cpus."""
        if not self.pin:
            return {}
        cfg = self.pipeline
        free = ["coordinator"] if cfg.coordinator_cpus is None else []
        free += [n for n, stages in stage_processes.items() if cfg.process_cpus(stages) is None]
        spread_cpus = spread(free, available_cpus())
        return {name: ["--cpus", format_cpus(cpus)] for name, cpus in spread_cpus.items()}

    def _wait_ready(self, deadline: float) -> None:
        """Until every replica this mesh started has registered (the client's readiness),
        reporting progress and failing at once when a process exits."""

        last = ""

        def on_wait(reason: str) -> None:
            nonlocal last
            for child in self._children:
                self._check_alive(child)
            if reason != last:
                self._progress(reason)
                last = reason

        want = {s.name: s.replicas for s in self.pipeline.stages}
        with self.client() as client:
            client.wait_ready(deadline - time.monotonic(), replicas=want, on_wait=on_wait)
        self._progress(f"mesh ready: {len(want)} stages")

    def _check_alive(self, child: _Child) -> None:
        code = child.proc.poll()
        if code is not None:
            tail = child.log_tail(25)
            raise OmniError(
                Code.UNAVAILABLE,
                f"{child.name} exited with code {code} during start-up; last log lines:\n"
                + "\n".join(tail),
            )

    # ---- run state -------------------------------------------------------------

    def log_tails(self, lines: int = 30) -> str:
        """The last `lines` log lines of every process this mesh started (diagnostics)."""
        return "\n".join(
            f"--- {c.name} ---\n" + "\n".join(c.log_tail(lines)) for c in self._children
        )

    def processes(self) -> dict[str, int]:
        return {c.name: c.proc.pid for c in self._children}

    def poll_exited(self) -> list[tuple[str, int]]:
        """Processes that exited and are nobody's to restart: the coordinator and the gateway (stage
        processes are the supervisor's, which restarts them or, past their budget, leaves
        them down while the rest serves)."""
        with self._supervisor.lock:
            return [
                (c.name, c.proc.returncode)
                for c in self._children
                if c.proc.poll() is not None and not self._supervisor.owns(c)
            ]

    def _exited(self, child: _Child) -> None:
        """A stage process ended while the mesh runs: the shared memory it made goes
        (one that was killed could not unlink its own)."""
        from omnirail.relay.shm_pool import sweep_segments

        sweep_segments(self.shm_prefix, child.proc.pid)

    # ---- rolling restart ---------------------------------------------------------

    def restart_stage(self, stage: str, grace: float = 5.0, timeout: float = 180.0) -> list[str]:
        """Restarts the processes hosting `stage` one at a time (its replicas; the other
        stages sharing those processes restart with them): each drains (no new work, its
        own finishes, for up to `drain_s`) and exits, a new one starts at once, and the
        next goes only when the new one serves. Returns what was done, step by step."""

        if stage not in self.pipeline.stage_names:
            raise ValueError(
                f"unknown stage {stage!r}; this pipeline has {self.pipeline.stage_names}"
            )
        units = [n for n, u in self._supervisor.units.items() if stage in u.processes[0].stages]
        steps: list[str] = []
        with self.client() as client:
            for name in units:
                stages = self._supervisor.units[name].processes[0].stages
                before = _live_ids(client, stages)
                t0 = time.monotonic()
                self._progress(f"restarting {name!r}: draining it")
                self._supervisor.restart_unit(name, self.pipeline.drain_s + grace)
                deadline = time.monotonic() + timeout
                while not self._back(client, stages, before):
                    if time.monotonic() > deadline:
                        raise OmniError(
                            Code.UNAVAILABLE,
                            f"{name} did not serve again within {timeout:g}s; see its log",
                        )
                    time.sleep(0.05)
                steps.append(
                    f"{name}: drained, restarted, serving again in {time.monotonic() - t0:.1f}s"
                )
                self._progress(steps[-1])
        return steps

    def _back(self, client: Any, stages: tuple[str, ...], before: dict[str, set[str]]) -> bool:
        """Every stage of `stages` has all its replicas live again, one of them new."""
        now = _live_ids(client, stages)
        return all(
            len(now[s]) == self.pipeline.stage(s).replicas and now[s] - before[s] for s in stages
        )

    def handle_control(self, command: dict[str, Any]) -> dict[str, Any]:
        """One `omnirail.ops.control` command (`{"restart": STAGE}`)."""
        if set(command) != {"restart"} or not isinstance(command["restart"], str):
            raise ValueError(f'expected {{"restart": STAGE}}, got {command!r}')
        steps = self.restart_stage(command["restart"])
        return {"ok": True, "message": "\n".join(steps)}

    # ---- stop ------------------------------------------------------------------

    def stop(self, grace: float = 5.0) -> dict[str, int]:
        """Drains, then stops: the coordinator first (it refuses new requests and lets the
        running ones end, for up to the pipeline's `drain_s`, while every stage still
        serves them), then the stage processes; each gets `grace` seconds after SIGTERM
        (the coordinator, `drain_s` more) before SIGKILL. Returns each process's exit
        code (those that needed SIGKILL are reported and show -9)."""
        self._supervisor.stop()  # no restarts while everything stops
        front = [c for c in self._children if c.name == "gateway"]
        coordinator = [c for c in self._children if c.name == "coordinator"]
        stages = [c for c in self._children if c.name not in ("coordinator", "gateway")]
        exits: dict[str, int] = {}
        # Stages drain too on SIGTERM (idle by then: the coordinator drained first), and
        # the coordinator after the gateway finished its HTTP responses.
        drain = self.pipeline.drain_s
        batches = ((front, grace + drain), (coordinator, grace + drain), (stages, grace + drain))
        for batch, wait in batches:
            for child in batch:
                if child.proc.poll() is None:
                    child.proc.send_signal(signal.SIGTERM)
            end = time.monotonic() + wait
            for child in batch:
                try:
                    child.proc.wait(timeout=max(0.0, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self._progress(f"{child.name} did not stop within {wait:g}s: SIGKILL")
                    child.proc.kill()
                    child.proc.wait()
                exits[child.name] = child.proc.returncode
        self._children.clear()
        # Segments of processes that were killed (and so could not unlink their own).
        from omnirail.relay.shm_pool import sweep_segments

        sweep_segments(self.shm_prefix)
        if self._wake is not None:
            self._wake.release()
            self._wake = None
        if self._own_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        return exits


def write_state(name: str, data: dict[str, object]) -> Path:
    # Written whole then renamed: `read_states` in another process (`up --detach` polls it)
    # must never see a half-written file.
    path = state_dir() / f"{name}.json"
    tmp = path.with_name(f".{name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
    return path


def pid_alive(pid: int) -> bool:
    """True for a running process; a zombie (ended, not yet reaped) counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def terminate(pid: int, timeout_s: float, poll_s: float = 0.1) -> bool:
    """SIGTERM to a detached mesh's launcher (it stops its mesh); True once it has exited,
    False if it is still there after `timeout_s`."""
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(poll_s)
    return not pid_alive(pid)


def read_states() -> dict[str, dict[str, object]]:
    """The running detached meshes of this user by name, wherever they were started from
    (`state_dirs`)."""
    states: dict[str, dict[str, object]] = {}
    paths = [path for folder in state_dirs() for path in sorted(folder.glob("*.json"))]
    for path in paths:
        if path.stem in states:
            continue
        try:
            data = json.loads(path.read_text())
            pid = int(data["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not ours to judge: unreadable, so neither listed nor deleted
        if not pid_alive(pid):
            path.unlink(missing_ok=True)  # a mesh that is gone
            continue
        states[path.stem] = data
    return states


def _live_ids(client: Any, stages: tuple[str, ...]) -> dict[str, set[str]]:
    info = {st.name: st for st in client.describe().stages}
    return {s: {r.replica_id for r in info[s].replicas if r.live} for s in stages}


def running_meshes(name: str | None = None) -> dict[str, dict[str, object]]:
    """The running meshes by name (`read_states`), or only the one named; a ValueError
    that lists the running ones when there is no such mesh."""
    states = read_states()
    if name is None:
        return states
    if name not in states:
        raise ValueError(f"no running mesh named {name!r} (running: {sorted(states) or 'none'})")
    return {name: states[name]}
