"""Stage results through the edge senders: a part that waits for relay credit holds up
neither the request's other edges nor other requests, the request ends once it has left,
and an abort stops its put."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import numpy as np

from omnirail.stage.scheduler import IncomingMessage, OutgoingMessage
from omnirail.stage_service.edges import EdgeRelays
from omnirail.stage_service.stage import Stage
from tests.unit.stage_service.relay_fakes import ScriptedRelay
from tests.unit.stage_service.stage_fakes import (
    FakeReporter,
    FakeRouter,
    Harness,
    RecordingScheduler,
    payload,
    pipeline,
    until,
)


def big_result(sched: RecordingScheduler, msg: IncomingMessage) -> list[OutgoingMessage]:
    if msg.type != "new_request":
        return []
    return [OutgoingMessage(msg.request_id, "result", {"x": np.full(1000, 7.0)})]


@asynccontextmanager
async def fan_out() -> AsyncIterator[tuple[Harness, ScriptedRelay]]:
    """Stage s sends each result to t and u through a scripted relay."""
    cfg = pipeline(
        {"name": "s", "next": ["t", "u"]},
        {"name": "t", "terminal": True},
        {"name": "u", "terminal": True},
    )
    relay = ScriptedRelay()
    router, reporter = FakeRouter(cfg), FakeReporter()
    scheduler = RecordingScheduler(big_result)
    edges = EdgeRelays("s", relay, 1024)
    stage = Stage("s", cfg, scheduler, edges, {relay.name: relay}, router, reporter)
    stage.start()
    try:
        yield Harness(stage, scheduler, router, reporter), relay
    finally:
        await stage.stop()


def to(h: Harness, target: str) -> list[str]:
    return [i.request_id for i, _ in h.router.delivered if i.to_stage == target]


async def test_a_waiting_part_holds_up_neither_other_edges_nor_other_requests() -> None:
    async with fan_out() as (h, relay):
        relay.full_edges.add("s->t")
        await h.send(payload("r1", 1, to="s"))
        await until(lambda: to(h, "u") == ["r1"], "r1's part for u")
        await h.send(payload("r2", 2, to="s"))
        await until(lambda: to(h, "u") == ["r1", "r2"], "r2's part for u")
        assert to(h, "t") == [] and h.stage.inflight == 2
        await until(lambda: relay.waiting_puts == 2, "both puts for t waiting")
        relay.gate.set()
        await until(lambda: h.stage.inflight == 0, "both requests ended")
        assert to(h, "t") == ["r1", "r2"]  # in the order they waited
        assert all(i.payload.HasField("relay") for i, _ in h.router.delivered)
        assert h.reporter.fails == []


async def test_abort_stops_a_waiting_part() -> None:
    async with fan_out() as (h, relay):
        relay.full_edges.add("s->t")
        await h.send(payload("r", 1, to="s"))
        await until(lambda: relay.waiting_puts == 1, "the put for t waiting")
        h.stage.abort("r")
        await until(lambda: relay.cancelled_puts == 1, "the put stopped")
        relay.gate.set()
        relay.full_edges.clear()
        await h.send(payload("q", 2, to="s"))
        await until(lambda: h.stage.inflight == 0, "q ended")
        assert to(h, "t") == ["q"] and to(h, "u") == ["r", "q"]
