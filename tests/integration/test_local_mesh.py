"""LocalMesh (one process) answers what the process mesh does, for the user-facing examples.

Each test runs one pipeline both ways in the same test and compares the answers value by
value; Qwen3-Omni's comparison is in test_qwen3_omni.py (beside its process mesh).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from omnirail.client.sdk import Chunk, Client
from omnirail.ops.launcher import Mesh
from omnirail.testing.local_mesh import LocalMesh
from tests.integration.conftest import REPO, collect_stream, shm_names


def _answers(address: str, calls: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    """What `address` answers to each (kind, inputs): a result's outputs, or a stream's
    chunks (modality, data) by stage, in order (stages' chunks interleave as timing
    has it), and its outputs."""
    out: list[Any] = []
    with Client(address, timeout=120) as client:
        for kind, inputs in calls:
            if kind == "generate":
                out.append(client.generate(inputs).outputs)
            else:
                chunks, result = collect_stream(client.stream(inputs))
                by_stage: dict[str, list[tuple[str, Any]]] = {}
                for c in chunks:
                    by_stage.setdefault(c.stage, []).append((c.modality, c.data))
                out.append((by_stage, result.outputs))
    return out


def _both(pipeline: Path, calls: list[tuple[str, dict[str, Any]]]) -> tuple[Any, Any]:
    with Mesh(pipeline) as mesh:
        processes = _answers(mesh.address or "", calls)
    with LocalMesh(pipeline) as local:
        in_process = _answers(local.address or "", calls)
        prefix = local.shm_prefix
    assert shm_names(prefix) == [], "LocalMesh left shared memory behind"
    return processes, in_process


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_quickstart_answers_as_processes_do() -> None:
    inputs = json.loads((REPO / "examples/quickstart/input.json").read_text())
    calls = [("generate", inputs), ("generate", {**inputs, "text": "another prompt"})]
    processes, in_process = _both(REPO / "examples/quickstart/pipeline.yaml", calls)
    assert processes[0]["fuse"]["patches"] > 0  # a real answer, not two empty ones
    assert _equal(processes, in_process), (processes, in_process)


def test_streaming_example_streams_as_processes_do() -> None:
    inputs = json.loads((REPO / "examples/streaming/input.json").read_text())
    calls = [("stream", inputs), ("stream", {"text": "two words"})]
    processes, in_process = _both(REPO / "examples/streaming/pipeline.yaml", calls)
    chunks, _ = processes[0]
    assert sorted(chunks) == ["thinker", "vocoder"]  # text and audio reach the client
    assert _equal(processes, in_process)


def test_chunks_arrive_as_chunks() -> None:
    """The in-process mesh streams too: the first chunk comes before the result."""
    with LocalMesh(REPO / "examples/streaming/pipeline.yaml") as local:
        with local.client(timeout=60) as client:
            first = next(iter(client.stream({"text": "one two three"})))
    assert isinstance(first, Chunk)
