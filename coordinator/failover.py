"""When a stage replica is lost: its process died (its Attach stream ended) or it stopped
answering (nothing heard on its Attach stream for `liveness_s`: stopped, wedged, or cut
off). Decides which live requests it touched, and watches for the silent ones.

Which requests a lost replica touched: at the entry stage, the one the coordinator sent
the request to (it records it); at a later stage, the replica the stages route to,
`route_index(wire id, conversation, ...)` over that stage's replicas sorted by id (what every sender
computes: omnirail/wire/routing.py), under the topology from before the loss. A request that
already went through that replica counts as touched, although it may have moved on: it
is re-run or failed like the others, never left waiting. A stage hosted next to its
sender takes local items whatever the hash says; its process hosts the sender too, so the
sender's own loss covers it.

A touched request is re-dispatched (the whole request again, from the entry, under a
new wire id, `<id>#<random>`) when nothing of it reached the client yet (no stream chunk,
no terminal's result), every stage it may pass is `retry_safe`, it has re-dispatches left
(`redispatch_attempts`) and time before its deadline; else it fails with UNAVAILABLE
naming the stage and replica. A re-dispatch that finds a stage with no live replica at
all waits for one to come back (the launcher restarts it) for up to `REDISPATCH_WAIT_S`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from omnirail.coordinator.registry import Replica, StageRegistry
from omnirail.coordinator.requests import RequestRecord
from omnirail.wire.routing import route_index

log = logging.getLogger(__name__)

# What a re-dispatch waits before it goes out, per attempt: long enough for the topology
# without the lost replica to reach the stages, short against any deadline.
REDISPATCH_DELAY_S = 0.1
# How long a re-dispatch waits for a stage with no live replica to get one back (its
# process restarting) before the request fails; never past the request's deadline.
REDISPATCH_WAIT_S = 10.0


def touched(replica: Replica, before: list[Replica], rec: RequestRecord, entry: str) -> bool:
    """Whether `rec` went (or was about to go) through `replica`; `before` is its stage's
    replicas, sorted by id, as they were before it was lost."""
    if replica.stage not in rec.possible:
        return False
    if replica.stage == entry and rec.entry is not None:
        return rec.entry is replica
    if replica not in before:
        return False
    names = [r.address for r in before]
    return before[route_index(rec.wire_id, rec.conversation, names)] is replica


def can_redispatch(
    rec: RequestRecord, retry_safe: frozenset[str], attempts: int, now: float | None = None
) -> bool:
    """Whether `rec` may run again from the start (see the module's doc)."""
    return (
        rec.attempt <= attempts
        and rec.chunks == 0
        and not rec.outputs
        and rec.possible <= retry_safe
        and (time.time() if now is None else now) < rec.deadline
    )


async def watch_liveness(
    registry: StageRegistry,
    timeout_s: float,
    on_silent: Callable[[Replica, float], None],
) -> None:
    """Calls `on_silent(replica, silent_s)` for each replica not heard from for
    `timeout_s` (stages report their load every second, so silence means the process
    stopped, not that it is idle). A tick of this loop that comes late by half the
    timeout or more means the coordinator itself stalled (stopped, starved): what it did
    not hear meanwhile is its own doing, so every replica gets a fresh start."""
    interval = min(0.5, timeout_s / 4)
    last = time.monotonic()
    while True:
        await asyncio.sleep(interval)
        now = time.monotonic()
        stalled = now - last - interval >= timeout_s / 2
        last = now
        for replica in registry.all():
            if stalled:
                replica.last_heard = now
            elif now - replica.last_heard > timeout_s:
                on_silent(replica, now - replica.last_heard)
