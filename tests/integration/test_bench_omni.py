"""`omnirail bench omni`: the Qwen3-Omni mesh against transformers' generate(), one report.

Runs the command as a user would, on the tiny random checkpoint it makes itself (nothing
is downloaded), with small token limits, and checks the report's shape and that its
numbers are sane: positive timings, audio from both systems, the ratios computed from the
figures beside them, and the greedy outputs of both systems equal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("PIL")
pytest.importorskip("vllm")

REPO = Path(__file__).resolve().parents[2]
TIMINGS = ("ttft_ms", "ttfa_ms", "e2e_ms")
RATES = ("audio_s", "rtf", "requests_per_s", "audio_s_per_s", "wall_s")

pytestmark = pytest.mark.slow  # ~30-60 s: eight stage processes load transformers


def test_bench_omni_json_against_transformers() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "omnirail",
            "bench",
            "omni",
            "--requests",
            "2",
            "--concurrency",
            "1,2",
            "--baseline",
            "transformers",
            "--max-new-tokens",
            "6",
            "--talker-max-new-tokens",
            "16",
            "--thinker",
            "vllm,native",
            "--json",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=480,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    report = json.loads(lines[0])
    assert report["model"] == "tiny random (made here)"
    assert report["baseline"] == "transformers" and report["concurrency"] == [1, 2]
    assert report["max_new_tokens"] == 6 and report["talker_max_new_tokens"] == 16
    assert report["kind"] == "text" and report["audio_sample_rate"] == 24_000
    assert "batch" in report["baseline_batching"]
    # Greedy on both sides, same weights: the same tokens and the same audio length.
    assert report["check"] == {
        "mesh_equals_transformers": True,
        "transformers_batch_equals_solo": True,
        "vllm_thinker_equals_transformers": True,
        "native_thinker_equals_transformers": True,
    }
    # Both thinkers, each its own mesh, in the same run; the first listed is `mesh`.
    assert report["thinkers"] == ["vllm", "native"]
    assert [level["concurrency"] for level in report["levels"]] == [1, 2]
    for level in report["levels"]:
        c = level["concurrency"]
        assert set(level["thinkers"]) == {"vllm", "native"}
        assert level["mesh"] == level["thinkers"]["vllm"]
        native = level["thinkers"]["native"]
        assert (
            native["requests"] == 2 and native["ttft_ms"] <= native["ttfa_ms"] <= native["e2e_ms"]
        )
        assert native["ratios"]["audio_s_per_s"] > 0 and native["cpu_s_per_request_total"] > 0
        mesh, base, ratios = level["mesh"], level["transformers"], level["ratios"]
        for side in (mesh, base):
            assert side["requests"] == 2 and side["waves"] == 2 // c, level
            for key in (*TIMINGS, *RATES):
                assert isinstance(side[key], (int, float)) and side[key] > 0, (key, level)
            for key in TIMINGS:
                assert len(side[f"{key}_runs"]) == 2, level
            assert side["audio_s_per_s"] == pytest.approx(
                side["requests_per_s"] * side["audio_s"], rel=0.01
            )
        # CPU per request: every mesh process, and this one (the client), over the mesh's
        # waves; transformers' in total (this process over its waves).
        cpu = mesh["cpu_s_per_request"]
        assert {"coordinator", "stage-thinker", "stage-talker", "stage-code2wav"} <= set(cpu)
        assert "client" in cpu and all(v >= 0 for v in cpu.values()), cpu
        assert sum(v for k, v in cpu.items() if k.startswith("stage-")) > 0, cpu
        assert mesh["cpu_s_per_request_total"] == pytest.approx(sum(cpu.values()), abs=1e-3)
        assert base["cpu_s_per_request_total"] > 0 and "cpu_s_per_request" not in base
        # At that CPU per request, with every core busy: the throughput ratio's bound.
        assert ratios["audio_s_per_s_cpu_ceiling"] == pytest.approx(
            len(os.sched_getaffinity(0)) / mesh["cpu_s_per_request_total"] / base["requests_per_s"],
            rel=0.01,
        )
        assert ratios["cpu_s_per_request"] == pytest.approx(
            mesh["cpu_s_per_request_total"] / base["cpu_s_per_request_total"], rel=0.01
        )
        # Streaming: first text, then first audio, then the end.
        assert mesh["ttft_ms"] <= mesh["ttfa_ms"] <= mesh["e2e_ms"], mesh
        # generate() does not stream: its first text and audio are at its end.
        assert base["ttft_ms"] == base["ttfa_ms"] == base["e2e_ms"], base
        assert mesh["audio_s"] == base["audio_s"]
        assert ratios["ttfa_over_transformers_e2e"] == pytest.approx(
            mesh["ttfa_ms"] / base["e2e_ms"], rel=0.01
        )
        assert ratios["audio_s_per_s"] == pytest.approx(
            mesh["audio_s_per_s"] / base["audio_s_per_s"], rel=0.01
        )
        assert ratios["requests_per_s"] == pytest.approx(
            mesh["requests_per_s"] / base["requests_per_s"], rel=0.01
        )
        # The vocoder alone, one request, costs something, and bounds the throughput ratio.
        cores = len(os.sched_getaffinity(0))
        assert base["vocoder_ms_one_request"] > 0
        assert ratios["audio_s_per_s_ceiling"] == pytest.approx(
            1000 / base["requests_per_s"] * cores / base["vocoder_ms_one_request"], rel=0.01
        )
        assert all(v > 0 for v in ratios.values()), ratios
        assert mesh["ratios"] == ratios
