"""Admission by principal: quotas, and the shares of a full mesh."""

from __future__ import annotations

import pytest

from omnirail.config.security import QuotasConfig
from omnirail.coordinator.requests import Overloaded
from omnirail.coordinator.tenants import Admission, Tenant
from omnirail.telemetry.metrics import CoordinatorMetrics
from omnirail.wire.errors import Code


def _admission(capacity: int, quotas: dict | None = None) -> Admission:
    config = QuotasConfig.model_validate(quotas) if quotas is not None else None
    return Admission(capacity, config, CoordinatorMetrics())


def _refused(admission: Admission, principal: str, now: float = 0.0) -> Overloaded:
    with pytest.raises(Overloaded) as ei:
        admission.admit(principal, now)
    assert ei.value.code == Code.RESOURCE_EXHAUSTED and ei.value.retry_after_ms > 0
    return ei.value


def test_without_quotas_it_is_the_mesh_limit_first_come_first_served() -> None:
    admission = _admission(3)
    held = [admission.admit(p) for p in ("a", "a", "a")]
    error = _refused(admission, "b")
    assert "max_live_requests" in error.message and error.retry_after_ms == 200
    held[0].release()
    assert admission.admit("b").live == 1
    assert admission.live == 3


def test_a_full_mesh_still_lets_in_a_principal_below_its_share() -> None:
    admission = _admission(4, {})
    flood = [admission.admit("flood") for _ in range(4)]  # alone, it may take everything
    _refused(admission, "flood")
    # The quiet one's share of the full mesh is 4 * 1/2: two requests get in at once.
    quiet = [admission.admit("quiet"), admission.admit("quiet")]
    error = _refused(admission, "quiet")
    assert "share of 2.0" in error.message and "'quiet'" in error.message
    assert admission.live == 6
    # As the flooder's requests end, it is over its share: none come back to it until the
    # mesh is below its limit.
    flood.pop().release()
    flood.pop().release()
    _refused(admission, "flood")
    flood.pop().release()
    assert admission.live == 3
    flood.append(admission.admit("flood"))
    for tenant in quiet:
        tenant.release()
    assert admission.admit("flood").live == 3


def test_weights_set_the_shares() -> None:
    admission = _admission(10, {"principals": {"big": {"weight": 4}, "small": {"weight": 1}}})
    for _ in range(10):
        admission.admit("small")
    # big's share: 10 * 4 / 5 = 8.
    big = [admission.admit("big") for _ in range(8)]
    _refused(admission, "big")
    assert admission.share(big[0]) == 8.0
    assert admission.share(admission.tenant("small")) == 2.0


def test_a_zero_weight_gets_in_only_while_the_mesh_has_room() -> None:
    admission = _admission(2, {"principals": {"bulk": {"weight": 0}}})
    admission.admit("bulk")
    admission.admit("bulk")
    _refused(admission, "bulk")
    assert admission.admit("web").live == 1  # weighted: its share of a full mesh


def test_a_principal_s_own_live_limit() -> None:
    admission = _admission(100, {"principals": {"a": {"max_live_requests": 2}}})
    first = admission.admit("a")
    admission.admit("a")
    error = _refused(admission, "a")
    assert "max_live_requests" in error.message and "'a'" in error.message
    first.release()
    admission.admit("a")


def test_the_rate_bucket_refills_and_hints_when_to_retry() -> None:
    admission = _admission(100, {"default": {"requests_per_s": 2, "burst": 3}})
    for _ in range(3):
        admission.admit("a", now=10.0).release()
    error = _refused(admission, "a", now=10.0)
    assert error.retry_after_ms == 500 and "2 requests per second" in error.message
    assert _refused(admission, "a", now=10.25).retry_after_ms == 250
    admission.admit("a", now=10.5).release()  # one token back after half a second
    _refused(admission, "a", now=10.5)
    # Other principals have buckets of their own.
    admission.admit("b", now=10.5)


def test_refusals_count_nothing_and_metrics_say_why() -> None:
    metrics = CoordinatorMetrics()
    admission = Admission(1, QuotasConfig(), metrics)
    tenant = admission.admit("a")
    assert isinstance(tenant, Tenant)
    _refused(admission, "a")
    assert admission.live == 1 and tenant.live == 1
    value = metrics.registry.get_sample_value
    labels = {"principal": "a", "reason": "share"}
    assert value("omnirail_principal_refused_total", labels) == 1
    assert value("omnirail_principal_requests_running", {"principal": "a"}) == 1
    tenant.release()
    assert value("omnirail_principal_requests_running", {"principal": "a"}) == 0
    assert admission.live == 0
