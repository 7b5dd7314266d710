"""Who may start a request now: per-principal quotas, and fair shares of a full mesh.

Every request belongs to a principal (the caller its bearer token names, or the one a front
door forwarded; `MeshSecurity.caller`). `Admission.admit` decides at once, without queueing:

1. the principal's own limits (`security.quotas`): requests running (`max_live_requests`)
   and requests started per second (a token bucket of `burst`, refilled at
   `requests_per_s`);
2. the mesh's `max_live_requests`: below it, a request gets in (nothing waits for a share
   no one uses); at it, a principal below its weighted share still gets in, up to that
   share, and one at or above it is refused. A share is `max_live_requests * weight /
   (sum of the weights of the principals with requests running, this one included)`.

So a caller sending ten times what the mesh serves holds at most what the mesh has room
for, while a quiet one's requests keep getting in: the flooder is refused first, always.
The mesh may then run more than `max_live_requests` for a moment: at most the quiet
principals' shares more, which they return as their requests end and the flooder, now
over its share, gets nothing back until the mesh is below the limit again.

Without `security.quotas` it is the mesh-wide limit alone, first come first served.
Refusals are `Overloaded` (RESOURCE_EXHAUSTED) with a retry hint: the bucket's time to its
next token, or the overload default.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from omnirail.config.security import Quota, QuotasConfig
from omnirail.coordinator.requests import Overloaded
from omnirail.telemetry.metrics import CoordinatorMetrics

# Principals the coordinator keeps state for. Names come from the tokens file (or a front
# door's forwarding, checked against the mesh secret), so the set is small; the bound only
# keeps a misbehaving front door from growing it without end.
MAX_TENANTS = 10_000


@dataclass(slots=True)
class Tenant:
    """One principal's running requests and rate bucket."""

    principal: str
    quota: Quota
    admission: Admission
    live: int = 0
    tokens: float = 0.0
    refilled: float = 0.0  # when `tokens` was last brought up to date (monotonic s)

    @property
    def weight(self) -> float:
        return self.quota.weight

    def release(self) -> None:
        """One of its requests ended (called exactly once per admitted request)."""
        self.admission.release(self)


class Admission:
    """Admission of requests by principal (see the module doc)."""

    def __init__(
        self,
        capacity: int,
        quotas: QuotasConfig | None,
        metrics: CoordinatorMetrics | None = None,
    ) -> None:
        self.capacity = capacity
        self.quotas = quotas
        self.metrics = metrics
        self.live = 0
        self._tenants: dict[str, Tenant] = {}
        # Sum of the weights of the principals with requests running.
        self._running_weight = 0.0

    def tenant(self, principal: str, now: float | None = None) -> Tenant:
        tenant = self._tenants.get(principal)
        if tenant is None:
            quota = self.quotas.of(principal) if self.quotas is not None else Quota()
            if len(self._tenants) >= MAX_TENANTS:
                self._forget_idle()
            now = time.monotonic() if now is None else now
            tenant = Tenant(principal, quota, self, tokens=_burst(quota), refilled=now)
            self._tenants[principal] = tenant
        return tenant

    def admit(self, principal: str, now: float | None = None) -> Tenant:
        """The principal's tenant, its request counted as running; `Overloaded` (with a
        retry hint) when a limit says no. Nothing is counted for a refused request."""
        now = time.monotonic() if now is None else now
        tenant = self.tenant(principal, now)
        quota = tenant.quota
        if quota.max_live_requests is not None and tenant.live >= quota.max_live_requests:
            self._refused(tenant, "live_limit")
            raise Overloaded(
                f"principal {principal!r}: {tenant.live} of its requests are running "
                f"(its quota's max_live_requests); retry after {Overloaded.retry_after_ms} ms"
            )
        rate = quota.requests_per_s
        if rate is not None:
            elapsed = max(0.0, now - tenant.refilled)
            tenant.tokens = min(_burst(quota), tenant.tokens + elapsed * rate)
            tenant.refilled = max(now, tenant.refilled)
            if tenant.tokens < 1.0:
                self._refused(tenant, "rate")
                wait_ms = max(1, math.ceil((1.0 - tenant.tokens) / rate * 1000))
                raise Overloaded(
                    f"principal {principal!r}: over its quota of {rate:g} requests per "
                    f"second (burst {_burst(quota)}); retry after {wait_ms} ms",
                    retry_after_ms=wait_ms,
                )
        if self.live >= self.capacity:
            if self.quotas is None:
                self._refused(tenant, "mesh_full")
                raise Overloaded.live_limit(self.capacity)
            share = self.share(tenant)
            if tenant.live >= share:
                self._refused(tenant, "share")
                raise Overloaded(
                    f"overloaded: {self.live} requests are running (max_live_requests "
                    f"{self.capacity}), {tenant.live} of them principal {principal!r}'s, at "
                    f"or over its share of {share:.1f} (weight {tenant.weight:g}); retry "
                    f"after {Overloaded.retry_after_ms} ms"
                )
        if rate is not None:
            tenant.tokens -= 1.0
        tenant.live += 1
        self.live += 1
        if tenant.live == 1:
            self._running_weight += tenant.weight
        if self.metrics is not None:
            self.metrics.principal_running(principal, tenant.live)
        return tenant

    def share(self, tenant: Tenant) -> float:
        """`tenant`'s share of a full mesh: its weight's part of the running principals'."""
        weight = self._running_weight + (tenant.weight if tenant.live == 0 else 0.0)
        if tenant.weight <= 0 or weight <= 0:
            return 0.0
        return self.capacity * tenant.weight / weight

    def release(self, tenant: Tenant) -> None:
        tenant.live -= 1
        self.live -= 1
        if tenant.live == 0:
            self._running_weight = max(0.0, self._running_weight - tenant.weight)
        if self.metrics is not None:
            self.metrics.principal_running(tenant.principal, tenant.live)

    def _refused(self, tenant: Tenant, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.refused(tenant.principal, reason)

    def _forget_idle(self) -> None:
        """Drops the state of principals with nothing running (their buckets refill by
        the time they come back; at worst one burst early)."""
        for name in [n for n, t in self._tenants.items() if t.live == 0]:
            del self._tenants[name]


def _burst(quota: Quota) -> int:
    if quota.requests_per_s is None:
        return 0
    return quota.burst if quota.burst is not None else max(1, math.ceil(quota.requests_per_s))
