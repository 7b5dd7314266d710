"""`omnirail bench stop`: how long `omnirail down` takes, and whether every process exits 0.

Each run starts `pipeline` (the omni demo by default) as `omnirail up --detach` does, sends
it `requests` requests one after another so that every process has done real work (torch
loaded, its threads started), then sends the launcher SIGTERM, as `omnirail down` does, and
times until the launcher has exited. The mesh is idle by then, so this is the stop itself:
the coordinator's drain with nothing to wait for, each process's own shutdown, and the
launcher's exit. Per run it reports the seconds to the launcher's exit, the launcher's own
"stopped in" figure (its processes' stops only) and what it said of their exit codes; over
the runs, the median and the maximum, and whether any process needed SIGKILL.

This is the figure `tests/integration/test_drain.py` does not time: a test must pass on a
busy host, so it checks only that the stop ends well inside `drain_s` with every exit 0.
"""

from __future__ import annotations

import os
import re
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omnirail.models.omni_demo import pipeline_file

# The installed omni demo's pipeline file (package data: runs from a wheel).
DEMO = pipeline_file()
# The launcher's last line (omnirail.cli.commands.cmd_up): "stopped in 0.35s; all 9 ...".
_STOPPED = re.compile(r"\[omnirail\] stopped in ([0-9.]+)s; (.*)")
_EXIT_WAIT_S = 60.0


def run_stop_bench(
    pipeline: str | None = None,
    inputs: dict[str, Any] | None = None,
    runs: int = 3,
    requests: int = 1,
    progress: Callable[[str], None] = lambda _msg: None,
) -> dict[str, Any]:
    """Runs `runs` up/requests/down cycles of `pipeline` and reports each stop."""
    from omnirail.bench.demo_bench import DEFAULT_INPUT
    from omnirail.config.loading import load_pipeline

    path = Path(pipeline or DEMO).resolve()
    load_pipeline(path)  # a bad pipeline is refused before anything starts
    if inputs is None and path == DEMO.resolve():
        inputs = DEFAULT_INPUT
    if inputs is None:
        requests = 0  # nothing to send: the stop of a mesh that only started
    per_run = []
    for i in range(runs):
        progress(f"run {i + 1}/{runs}: up")
        per_run.append(_one_stop(path, inputs, requests, progress))
    took = [r["down_s"] for r in per_run]
    return {
        "bench": "stop",
        "pipeline": str(path),
        "runs": runs,
        "requests_before_stop": requests,
        "down_s": {"median": statistics.median(took), "max": max(took)},
        "stopped_in_s": {"median": statistics.median(r["stopped_in_s"] for r in per_run)},
        "all_exited_0": all(r["all_exited_0"] for r in per_run),
        "sigkill": any(r["sigkill"] for r in per_run),
        "per_run": per_run,
        "host": {"cpus": os.cpu_count()},
    }


def _one_stop(
    path: Path, inputs: dict[str, Any] | None, requests: int, progress: Callable[[str], None]
) -> dict[str, Any]:
    from omnirail.client.sdk import Client
    from omnirail.ops.launcher import pid_alive, read_states, state_dir, terminate

    name = f"stopbench-{uuid.uuid4().hex[:8]}"
    log = state_dir() / f"{name}.log"
    up = subprocess.run(
        [sys.executable, "-m", "omnirail", "up", str(path), "--detach", "--name", name],
        capture_output=True,
        text=True,
        timeout=300,
    )
    pid: int | None = None
    try:
        if up.returncode != 0:
            raise RuntimeError(f"the mesh did not start: {up.stderr.strip()[-2000:]}")
        pid = int(read_states()[name]["pid"])  # type: ignore[arg-type]
        if requests:
            with Client(up.stdout.strip(), timeout=120) as client:
                for _ in range(requests):
                    client.generate(dict(inputs or {}))
        progress("down")
        t0 = time.monotonic()
        exited = terminate(pid, _EXIT_WAIT_S, poll_s=0.005)
        down_s = time.monotonic() - t0
        if not exited:
            raise RuntimeError(f"the launcher did not exit within {_EXIT_WAIT_S:g}s of SIGTERM")
        text = log.read_text(errors="replace")
    finally:
        if pid is not None and pid_alive(pid):
            # A request that failed, or a launcher that hung: its mesh goes all the same.
            if not terminate(pid, _EXIT_WAIT_S):
                os.kill(pid, signal.SIGKILL)
        log.unlink(missing_ok=True)
    found = _STOPPED.findall(text)
    if not found:
        raise RuntimeError(f"the launcher's log has no 'stopped in' line: {text[-2000:]}")
    stopped_in, codes = found[-1]
    return {
        "down_s": round(down_s, 4),
        "stopped_in_s": float(stopped_in),
        "exit_codes": codes,
        "all_exited_0": codes.startswith("all ") and codes.endswith("exited 0"),
        "sigkill": "SIGKILL" in text,
    }
