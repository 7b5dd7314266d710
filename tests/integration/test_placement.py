"""`gpu:` placement in real stage processes: the process sees only its GPU, its factory is
told the device, and on a host without CUDA a GPU stage fails start-up naming the stage
and field unless the pipeline allows `cpu_fallback`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from omnirail.client.sdk import Client
from omnirail.ops.launcher import Mesh
from omnirail.wire.errors import OmniError

CUDA = torch.cuda.is_available()


def _pipeline(tmp_path: Path, **extra: Any) -> Path:
    cfg = {
        "name": "it-placement",
        "stages": [
            {"name": "pre", "factory": "tests.integration.stagefns:make_source", "next": "where"},
            {
                "name": "where",
                "factory": "tests.integration.stagefns:make_where",
                "gpu": 0,
                "terminal": True,
            },
        ],
        **extra,
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.skipif(CUDA, reason="checks a host without CUDA")
def test_a_gpu_stage_without_cuda_fails_start_up_naming_stage_and_field(tmp_path: Path) -> None:
    mesh = Mesh(_pipeline(tmp_path))
    with pytest.raises(OmniError) as info:
        mesh.start(timeout=120)
    message = str(info.value)
    assert "stage-where exited" in message, message
    assert "stages[where].gpu: GPU 0 asked for, but this process sees no CUDA device" in message
    assert "cpu_fallback: true" in message


def test_a_gpu_stage_is_placed_or_falls_back_to_the_cpu(tmp_path: Path) -> None:
    with Mesh(_pipeline(tmp_path, cpu_fallback=True)) as mesh:
        with Client(mesh.address or "", timeout=60) as client:
            out = client.generate({"n": 3}).output
    # The process sees only GPU 0, as its device 0; its factory got its device and id.
    assert out["visible"] == "0" and out["gpu_id"] == 0 and out["sum"] == 8.0
    assert out["device"] == ("cuda:0" if CUDA else "cpu")


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_tensors_cross_edges_onto_each_receivers_device(tmp_path: Path) -> None:
    """A GPU stage's CUDA tensor crosses the shm relay (staged through host memory) to a
    stage on a GPU, which gets it on its cuda:0, and on to a CPU stage, which gets it on
    the CPU."""
    cfg = {
        "name": "it-cuda-edges",
        "stages": [
            {
                "name": "src",
                "factory": "tests.integration.stagefns:make_device_source",
                "gpu": 0,
                "next": "on_gpu",
            },
            {
                "name": "on_gpu",
                "factory": "tests.integration.stagefns:make_device_hop",
                "gpu": 0,
                "next": "on_cpu",
            },
            {
                "name": "on_cpu",
                "factory": "tests.integration.stagefns:make_device_hop",
                "terminal": True,
            },
        ],
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg))
    n = 20000
    with Mesh(path) as mesh, Client(mesh.address or "", timeout=60) as client:
        out = client.generate({"n": n}).output
    assert out["seen"] == ["cuda:0", "cpu"]
    assert out["sum"] == 2 * n * (n - 1) / 2
