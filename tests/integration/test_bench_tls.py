"""`omnirail bench pipeline --tls`: a plaintext and a secured mesh side by side, in one
interleaved run, with the ratios in the report (the figures are the machine's to vary)."""

from __future__ import annotations

import json

from tests.integration.conftest import explain, omnirail


def test_the_tls_bench_measures_both_meshes_in_one_run() -> None:
    proc = omnirail(
        *("bench", "pipeline", "--tls", "--requests", "40", "--throughput-requests", "200"),
        *("--cpu-wake-latency-us", "off", "--json"),
        timeout=600,
    )
    assert proc.returncode == 0, explain(proc)
    report = json.loads(proc.stdout)
    assert report["rounds"] == 3 and report["transport"] == "unix"
    for kind in ("plaintext", "tls"):
        side = report[kind]
        assert side["latency_p50_ms"] > 0 and side["throughput_rps"] > 0
        assert len(side["rounds_throughput_rps"]) == 3
    assert set(report["tls_over_plaintext"]) == {"latency_p50", "latency_p99", "throughput"}
