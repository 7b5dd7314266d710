"""Stopping a mesh drains it: the coordinator refuses new requests, the running ones end
(the stages still serve them) for up to `drain_s`, then everything stops, quickly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

from omnirail.client.sdk import Client
from omnirail.ops.launcher import Mesh, pid_alive, read_states, state_dir
from omnirail.wire.errors import Code, OmniError
from tests.integration.conftest import PIPELINES, shm_names

OMNI_DEMO = Path(__file__).resolve().parents[2] / "examples/omni_demo/pipeline.yaml"


def _mesh(tmp_path: Path, drain_s: float) -> Mesh:
    cfg = yaml.safe_load((PIPELINES / "linear.yaml").read_text())
    cfg["drain_s"] = drain_s
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg))
    mesh = Mesh(path)
    mesh.start(timeout=240)
    return mesh


def _during_stop(mesh: Mesh, sleep_s: float) -> tuple[dict[str, Any], float]:
    """One request of `sleep_s` in `double`; the mesh is stopped while it runs, and a new
    request is tried while it drains. Returns what happened and how long stop took."""
    seen: dict[str, Any] = {}
    with Client(mesh.address or "", timeout=60) as client:

        def run() -> None:
            try:
                seen["result"] = client.generate({"n": 4, "sleep": sleep_s}, timeout=60).output
            except OmniError as exc:
                seen["result"] = exc

        worker = threading.Thread(target=run)
        worker.start()
        time.sleep(0.7)  # running in `double`
        stopper = threading.Thread(target=lambda: seen.update(stop_s=_timed(mesh.stop)))
        stopper.start()
        time.sleep(0.5)
        try:
            client.generate({"n": 1}, timeout=10)
        except OmniError as exc:
            seen["late"] = exc
        worker.join(60)
        stopper.join(60)
    return seen, seen["stop_s"]


def _timed(fn: Any) -> float:
    t0 = time.monotonic()
    fn()
    return time.monotonic() - t0


def test_a_running_request_finishes_while_new_ones_are_refused(tmp_path: Path) -> None:
    mesh = _mesh(tmp_path, drain_s=20)
    seen, stop_s = _during_stop(mesh, sleep_s=3.0)
    assert seen["result"]["sum"] == 12.0  # it ended normally, during the stop
    late = seen["late"]
    assert isinstance(late, OmniError) and late.code == Code.UNAVAILABLE
    assert "shutting down" in late.message
    assert 2.0 < stop_s < 15.0, stop_s  # waited for it, not for drain_s
    assert shm_names(mesh.shm_prefix) == []


def test_drain_s_bounds_the_wait(tmp_path: Path) -> None:
    mesh = _mesh(tmp_path, drain_s=1)
    seen, stop_s = _during_stop(mesh, sleep_s=30.0)
    error = seen["result"]
    assert isinstance(error, OmniError) and error.code == Code.UNAVAILABLE, error
    assert "shut down before the request ended" in error.message
    assert stop_s < 15.0, stop_s


def test_down_of_the_omni_demo_is_quick_and_every_process_exits_0() -> None:
    """`omnirail down` of the 8-stage demo: under 2 s from the command to the launcher's
    exit, each process ending on its own with 0 (no SIGKILL; the launcher's log says)."""
    name = f"downtest-{uuid.uuid4().hex[:8]}"
    cli = [sys.executable, "-m", "omnirail"]
    up = subprocess.run(
        [*cli, "up", str(OMNI_DEMO), "--detach", "--name", name],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert up.returncode == 0, up.stderr
    launcher = int(read_states()[name]["pid"])  # type: ignore[arg-type]
    try:
        t0 = time.monotonic()
        os.kill(launcher, signal.SIGTERM)  # what `omnirail down` sends
        while pid_alive(launcher) and time.monotonic() - t0 < 60:
            time.sleep(0.01)
        took = time.monotonic() - t0
    finally:
        subprocess.run([*cli, "down", "--name", name], capture_output=True, timeout=120)
    log = (state_dir() / f"{name}.log").read_text()
    assert "all 9 processes exited 0" in log, log[-3000:]
    assert "SIGKILL" not in log, log[-3000:]
    assert took < 2.0, took
