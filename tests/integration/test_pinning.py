"""`--pin` and `cpus:`: every thread of every mesh process runs where it was told to."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from omnirail.client.sdk import Client
from omnirail.ops.launcher import Mesh
from omnirail.tuning.cpus import available_cpus
from tests.integration.conftest import PIPELINES


def _thread_masks(pid: int) -> set[frozenset[int]]:
    return {frozenset(os.sched_getaffinity(int(t))) for t in os.listdir(f"/proc/{pid}/task")}


def test_pin_spreads_processes_and_keeps_configured_cpus(tmp_path: Path) -> None:
    cpus = available_cpus()
    spec = yaml.safe_load((PIPELINES / "linear.yaml").read_text())
    spec["stages"][1]["cpus"] = [cpus[-1]]  # "double" chooses its own CPU
    path = tmp_path / "linear.yaml"
    path.write_text(yaml.safe_dump(spec))
    with Mesh(path, pin=True) as mesh:
        procs = mesh.processes()
        with Client(mesh.address or "", timeout=60) as client:
            assert client.generate({"n": 4}).output["sum"] == 12
        masks = {name: _thread_masks(pid) for name, pid in procs.items()}
    # One mask per process, shared by all its threads (grpc's, the scheduler's, ...).
    assert all(len(m) == 1 for m in masks.values()), masks
    placed = {name: sorted(next(iter(m))) for name, m in masks.items()}
    assert placed["stage-double"] == [cpus[-1]]
    spread = ["coordinator", "stage-source", "stage-summarize"]
    assert [placed[n] for n in spread] == [[cpus[i % len(cpus)]] for i in range(3)]


def test_unpinned_mesh_keeps_every_cpu() -> None:
    with Mesh(PIPELINES / "linear.yaml") as mesh:
        masks = {name: _thread_masks(pid) for name, pid in mesh.processes().items()}
    assert all(m == {frozenset(available_cpus())} for m in masks.values()), masks
