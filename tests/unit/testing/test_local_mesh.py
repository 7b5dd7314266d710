"""LocalMesh's own API: what it refuses, and a process stopped and started again."""

from __future__ import annotations

import pytest

from omnirail.config import PipelineConfig
from omnirail.testing import LocalMesh
from tests.unit.local_stages import stage


def pipeline(*stages: dict) -> PipelineConfig:
    return PipelineConfig.from_dict({"name": "local", "stages": list(stages)})


def test_a_tensor_parallel_stage_is_refused_naming_it() -> None:
    tp = pipeline(stage("a", next="b"), stage("b", tp_size=2, terminal=True))
    with pytest.raises(ValueError, match=r"stages\[b\]\.tp_size is 2: LocalMesh runs no"):
        LocalMesh(tp)


def test_run_needs_a_mesh_started_in_its_thread() -> None:
    mesh = LocalMesh(pipeline(stage("a", terminal=True)))

    async def nothing() -> None:
        return None

    with pytest.raises(RuntimeError, match="started with start"):
        mesh.run(nothing())


def test_a_stopped_process_starts_again_as_a_fresh_replica() -> None:
    with LocalMesh(pipeline(stage("a", next="b"), stage("b", terminal=True))) as mesh:
        assert sorted(mesh.processes()) == ["stage-a", "stage-b"]
        first = mesh.hosts["stage-b"].replica_id
        mesh.run(mesh.stop_process("stage-b"))
        with pytest.raises(KeyError, match="'stage-b' is not running"):
            mesh.run(mesh.stop_process("stage-b"))
        with mesh.client(timeout=10) as client:
            assert client.describe().stages[1].replicas == []
            mesh.run(mesh.start_process("stage-b"))
            assert mesh.hosts["stage-b"].replica_id != first
            assert client.generate({}).output["path"] == ["a", "b"]
        with pytest.raises(ValueError, match="already running"):
            mesh.run(mesh.start_process("stage-b"))
        with pytest.raises(KeyError, match="no stage process 'stage-x'"):
            mesh.run(mesh.start_process("stage-x"))
