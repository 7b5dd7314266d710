"""`cpu_wake_latency_us` and `--cpu-wake-latency-us`: every mesh process holds the bound
while it runs, and nothing holds it once the mesh is down."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from omnirail.client.sdk import Client
from omnirail.ops.launcher import Mesh
from omnirail.tuning import cpu_latency
from tests.integration.conftest import PIPELINES

pytestmark = pytest.mark.skipif(
    not cpu_latency.available(), reason=f"{cpu_latency.DEVICE} cannot be held here"
)


def _holds(pid: int) -> bool:
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == cpu_latency.DEVICE:
                return True
        except OSError:
            pass  # closed meanwhile
    return False


def _linear(tmp_path: Path, **extra: object) -> Path:
    spec = yaml.safe_load((PIPELINES / "linear.yaml").read_text())
    spec.update(extra)
    path = tmp_path / "linear.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_every_process_holds_the_pipelines_bound_while_up(tmp_path: Path) -> None:
    said: list[str] = []
    with Mesh(_linear(tmp_path, cpu_wake_latency_us=0), progress=said.append) as mesh:
        procs = mesh.processes()
        with Client(mesh.address or "", timeout=60) as client:
            assert client.generate({"n": 4}).output["sum"] == 12
        holding = {name: _holds(pid) for name, pid in procs.items()}
        assert cpu_latency.current_us() == 0
        assert _holds(os.getpid())  # the launcher too: it reports a refusal at start-up
    assert all(holding.values()), holding
    assert "idle CPUs held to wake within 0 µs" in said
    assert not _holds(os.getpid())


def test_the_flag_overrides_and_no_setting_holds_nothing(tmp_path: Path) -> None:
    with Mesh(PIPELINES / "linear.yaml", cpu_wake_latency_us=20) as mesh:
        tuned = {name: _holds(pid) for name, pid in mesh.processes().items()}
        assert cpu_latency.current_us() <= 20
    with Mesh(PIPELINES / "linear.yaml") as mesh:
        untuned = {name: _holds(pid) for name, pid in mesh.processes().items()}
        assert not _holds(os.getpid())
    assert all(tuned.values()), tuned
    assert not any(untuned.values()), untuned


def test_a_bad_flag_fails_before_anything_starts() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "omnirail",
            "up",
            str(PIPELINES / "linear.yaml"),
            "--cpu-wake-latency-us",
            "soon",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "not an integer of µs: 'soon'" in proc.stderr, proc.stderr
