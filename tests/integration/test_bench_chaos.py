"""`omnirail bench chaos`, small: aborts, short deadlines, bad inputs and replica kills
against the quickstart and streaming examples, then the audit must find every request
ended (within its deadline plus 1 s) and nothing left behind."""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import explain, omnirail


@pytest.mark.parametrize(("shape", "requests"), [("quickstart", 800), ("streaming", 300)])
def test_a_small_chaos_soak_is_clean(shape: str, requests: int) -> None:
    proc = omnirail(
        *("bench", "chaos", "--shape", shape, "--requests", str(requests)),
        *("--concurrency", "16", "--kill-every", "1.5", "--json"),
        timeout=900,
    )
    assert proc.returncode == 0, explain(proc)
    report = json.loads(proc.stdout)
    assert report["without_terminal_status"] == 0, report
    assert report["ended_after_deadline_plus_1s"] == 0, report
    assert report["orphan_segments"] == [], report
    held = report["held_after"]
    assert held.pop("all_replicas_live") is True, report
    assert held.pop("where") == {}, held
    assert not any(held.values()), report
    assert report["clean"] is True
    outcomes = report["outcomes"]
    assert outcomes["abort"].get("CANCELLED", 0) > 0, outcomes
    assert sum(outcomes["normal"].values()) > 0 and outcomes["normal"].get("OK", 0) > 0
    # The oversized inputs were refused at the door.
    assert outcomes["bad"].get("RESOURCE_EXHAUSTED", 0) > 0, outcomes


def test_bad_fractions_are_refused() -> None:
    proc = omnirail(
        "bench", "chaos", "--abort-fraction", "0.9", "--deadline-fraction", "0.2", timeout=120
    )
    assert proc.returncode != 0 and "sum <= 1" in proc.stderr, explain(proc)
