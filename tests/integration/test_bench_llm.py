"""`omnirail bench llm` as a user runs it: one JSON report with both modes at each level, the
mesh's tokens all arriving (tokens/s from what the client received), CPU per request."""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import explain, omnirail

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow


def test_bench_llm_reports_both_modes_interleaved():
    proc = omnirail(
        "bench",
        "llm",
        "--requests",
        "3",
        "--concurrency",
        "1,2",
        "--max-new-tokens",
        "6",
        "--json",
        timeout=600,
    )
    assert proc.returncode == 0, explain(proc)
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout[-2000:]  # the report alone: vLLM logs to stderr
    report = json.loads(lines[0])
    assert report["bench"] == "llm" and report["rounds"] == 2
    for mode in ("direct", "mesh"):
        for level in ("1", "2"):
            figures = report[mode][level]
            assert figures["tokens_per_s"] > 0
            assert figures["ttft_p50_ms"] > 0
            assert figures["cpu_s_per_request"] > 0
    for level in ("1", "2"):
        assert report["mesh_vs_direct"][level]["tokens_per_s_ratio"] > 0
