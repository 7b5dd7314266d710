"""`omnirail bench pipeline --replicas 2`: with replica 0 five times slower, least
outstanding placement sends it less work than hashing the request id does, and the
report says so (figures, shares, the ratio) in one interleaved run."""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import explain, omnirail


def test_least_outstanding_sends_the_slow_replica_less_work() -> None:
    proc = omnirail(
        *("bench", "pipeline", "--replicas", "2", "--slow-factor", "5"),
        *("--requests", "80", "--concurrency", "8", "--cpu-wake-latency-us", "off", "--json"),
        timeout=600,
    )
    assert proc.returncode == 0, explain(proc)
    report = json.loads(proc.stdout)
    assert (report["replicas"], report["rounds"], report["stage_ms"]) == (2, 3, 10.0)
    shares = report["slow_replica_share"]
    # Hashing splits evenly whatever the speed; least outstanding sees the slow one's
    # backlog. (Throughput follows, but is the machine's to vary: not asserted here.)
    assert shares["request_id"] == pytest.approx(0.5, abs=0.1), report
    assert shares["least_outstanding"] < shares["request_id"] - 0.1, report
    for policy in ("least_outstanding", "request_id"):
        side = report[policy]
        assert side["throughput_rps"] > 0 and len(side["rounds_throughput_rps"]) == 3
        assert sum(side["share_by_replica"].values()) == pytest.approx(1.0, abs=0.01)
    assert report["throughput_ratio_least_outstanding_over_hash"] > 0


def test_replicas_need_a_reason_to_differ() -> None:
    bad = omnirail("bench", "pipeline", "--replicas", "2", "--slow-factor", "0.5", timeout=120)
    assert bad.returncode != 0 and "--slow-factor must be at least 1" in bad.stderr
