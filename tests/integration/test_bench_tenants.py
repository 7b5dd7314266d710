"""`omnirail bench tenants`, small: a principal sending at 10x the mesh's capacity beside
one at 0.2x. The quiet one's requests all complete, and the flooder is refused with
RESOURCE_EXHAUSTED and a retry hint. (The latency ratio is the benchmark's figure to
report, not this test's to bound: this machine is shared.)"""

from __future__ import annotations

import json

from tests.integration.conftest import explain, omnirail


def test_a_flooding_principal_is_refused_and_a_quiet_one_is_served() -> None:
    proc = omnirail(
        *("bench", "tenants", "--json", "--seconds", "3", "--live", "4", "--steps", "10"),
        *("--compare-fcfs",),
        timeout=600,
    )
    assert proc.returncode == 0, explain(proc)
    report = json.loads(proc.stdout)
    quiet, flood = report["quiet_flooded"], report["flood"]
    assert report["quiet_all_completed"], quiet
    assert quiet["outcomes"] == {"OK": quiet["sent"]} and quiet["sent"] >= 5
    assert report["quiet_alone"]["outcomes"] == {"OK": report["quiet_alone"]["sent"]}
    refused = flood["outcomes"].get("RESOURCE_EXHAUSTED", 0)
    assert refused > flood["sent"] / 2, flood
    assert flood["refusals_with_retry_hint"] == refused and min(flood["retry_hint_ms"]) > 0
    assert report["quiet_p50_flooded_over_alone"] > 0
    assert set(report["cpu_s_per_request"]) == {"coordinator", "stage-work"}
    # Without quotas (first come first served) the flooder holds the mesh: what the quotas
    # change is that the quiet caller gets in.
    fcfs = report["without_quotas"]["quiet_flooded"]["outcomes"]
    assert fcfs.get("RESOURCE_EXHAUSTED", 0) > 0, report["without_quotas"]
