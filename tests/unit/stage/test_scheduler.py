"""SimpleScheduler and Outbox in-process: ordering, errors, aborts, batching, shutdown.

Synchronisation is by events and by the outbox waker, never by sleeping: the tests hold a
compute open with a `threading.Event` to make requests queue up behind it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from omnirail.stage.scheduler import (
    IncomingMessage,
    Outbox,
    OutgoingMessage,
    SimpleScheduler,
)
from tests.unit.stage.scheduler_support import TIMEOUT, Collector, new


@pytest.fixture
def stop_later() -> Iterator[Callable[[SimpleScheduler], SimpleScheduler]]:
    started: list[SimpleScheduler] = []

    def register(s: SimpleScheduler) -> SimpleScheduler:
        started.append(s)
        return s

    yield register
    for s in started:
        s.stop()


def test_fn_results_reach_outbox_in_order(stop_later) -> None:
    sched = stop_later(SimpleScheduler(lambda x: x * 2))
    out = Collector(sched.outbox)
    sched.start()
    for i in range(20):
        sched.inbox.put(new(f"r{i}", i))
    items = out.count(20)
    assert [(m.request_id, m.type, m.data) for m in items] == [
        (f"r{i}", "result", i * 2) for i in range(20)
    ]


def test_exception_becomes_error_and_scheduler_keeps_working(stop_later) -> None:
    def fn(x: int) -> int:
        if x < 0:
            raise ValueError(f"negative: {x}")
        return x + 1

    sched = stop_later(SimpleScheduler(fn))
    out = Collector(sched.outbox)
    sched.start()
    sched.inbox.put(new("bad", -3))
    sched.inbox.put(new("good", 4))
    items = out.count(2)
    assert [(m.request_id, m.type) for m in items] == [("bad", "error"), ("good", "result")]
    assert isinstance(items[0].data, ValueError)
    assert str(items[0].data) == "negative: -3"
    assert items[1].data == 5
    # Still alive after the failure.
    sched.inbox.put(new("later", 10))
    assert out.result_for("later")[-1].data == 11


def test_abort_before_compute_skips_request(stop_later) -> None:
    seen: list[str] = []

    def fn(x: str) -> str:
        seen.append(x)
        return x.upper()

    sched = stop_later(SimpleScheduler(fn))
    out = Collector(sched.outbox)
    sched.abort("a")
    sched.inbox.put(new("a", "a"))
    sched.inbox.put(new("b", "b"))
    sched.start()
    items = out.result_for("b")
    assert [(m.request_id, m.data) for m in items] == [("b", "B")]
    assert seen == ["b"], "an aborted request must not be computed"


def test_abort_while_queued_behind_busy_compute(stop_later) -> None:
    started, release = threading.Event(), threading.Event()
    seen: list[str] = []

    def fn(x: str) -> str:
        seen.append(x)
        if x == "hold":
            started.set()
            assert release.wait(TIMEOUT)
        return x

    sched = stop_later(SimpleScheduler(fn))
    out = Collector(sched.outbox)
    sched.start()
    sched.inbox.put(new("hold", "hold"))
    assert started.wait(TIMEOUT)
    sched.inbox.put(new("queued", "queued"))
    sched.abort("queued")
    sched.inbox.put(new("after", "after"))
    release.set()
    items = out.result_for("after")
    assert [m.request_id for m in items] == ["hold", "after"]
    assert seen == ["hold", "after"]


def test_abort_during_compute_drops_result(stop_later) -> None:
    started, release = threading.Event(), threading.Event()

    def fn(x: str) -> str:
        if x == "slow":
            started.set()
            assert release.wait(TIMEOUT)
        return x

    sched = stop_later(SimpleScheduler(fn))
    out = Collector(sched.outbox)
    sched.start()
    sched.inbox.put(new("slow", "slow"))
    assert started.wait(TIMEOUT)
    sched.abort("slow")
    release.set()
    # "next" is computed after "slow" finished, so a result for "slow" would precede it.
    sched.inbox.put(new("next", "next"))
    items = out.result_for("next")
    assert [m.request_id for m in items] == ["next"]


def test_batch_fn_batches_requests_that_queue_up(stop_later) -> None:
    started, release = threading.Event(), threading.Event()
    batches: list[list[int]] = []

    def batch_fn(xs: list[int]) -> list[int]:
        batches.append(list(xs))
        if xs == [0]:
            started.set()
            assert release.wait(TIMEOUT)
        return [x * 10 for x in xs]

    sched = stop_later(SimpleScheduler(batch_fn=batch_fn, max_batch_size=3))
    out = Collector(sched.outbox)
    sched.start()
    sched.inbox.put(new("r0", 0))
    assert started.wait(TIMEOUT)
    for i in range(1, 6):
        sched.inbox.put(new(f"r{i}", i))
    assert sched.queue_depth == 5
    release.set()
    items = out.count(6)
    assert batches == [[0], [1, 2, 3], [4, 5]]
    assert [(m.request_id, m.type, m.data) for m in items] == [
        (f"r{i}", "result", i * 10) for i in range(6)
    ]


def test_batch_fn_waits_for_batch_to_fill(stop_later) -> None:
    batches: list[list[str]] = []

    def batch_fn(xs: list[str]) -> list[str]:
        batches.append(list(xs))
        return xs

    # A long max_wait: the batch is computed as soon as it is full, not after the wait.
    sched = stop_later(SimpleScheduler(batch_fn=batch_fn, max_batch_size=2, max_wait_ms=60_000))
    out = Collector(sched.outbox)
    sched.start()
    sched.inbox.put(new("a", "a"))
    sched.inbox.put(new("b", "b"))
    out.count(2)
    assert batches == [["a", "b"]]


def test_batch_fn_skips_aborted_requests(stop_later) -> None:
    batches: list[list[str]] = []

    def batch_fn(xs: list[str]) -> list[str]:
        batches.append(list(xs))
        return xs

    sched = stop_later(SimpleScheduler(batch_fn=batch_fn, max_batch_size=8))
    out = Collector(sched.outbox)
    for rid in ("a", "b", "c"):
        sched.inbox.put(new(rid, rid))
    sched.abort("b")
    sched.start()  # all three are queued before the thread runs: one batch
    items = out.count(2)
    assert batches == [["a", "c"]]
    assert [m.request_id for m in items] == ["a", "c"]


@pytest.mark.parametrize(
    ("returned", "described"),
    [
        (lambda xs: xs[:-1], "list of 2 results for 3 requests"),
        (lambda xs: [*xs, "extra"], "list of 4 results for 3 requests"),
        (lambda xs: None, "NoneType of ? results for 3 requests"),
    ],
    ids=["too-few", "too-many", "not-a-list"],
)
def test_batch_fn_wrong_result_count_fails_every_request(
    stop_later, returned: Callable[[list[str]], Any], described: str
) -> None:
    sched = stop_later(SimpleScheduler(batch_fn=returned, max_batch_size=8))
    out = Collector(sched.outbox)
    for rid in ("a", "b", "c"):
        sched.inbox.put(new(rid, rid))
    sched.start()  # all three are queued before the thread runs: one batch
    items = out.count(3)
    assert [m.request_id for m in items] == ["a", "b", "c"]
    for m in items:
        assert m.type == "error"
        assert isinstance(m.data, TypeError)
        assert str(m.data) == f"batch_fn returned {described}"


def test_batch_fn_exception_fails_batch_and_scheduler_keeps_working(stop_later) -> None:
    def batch_fn(xs: list[str]) -> list[str]:
        if "boom" in xs:
            raise RuntimeError("batch failed")
        return [x.upper() for x in xs]

    sched = stop_later(SimpleScheduler(batch_fn=batch_fn, max_batch_size=8))
    out = Collector(sched.outbox)
    sched.inbox.put(new("a", "a"))
    sched.inbox.put(new("boom", "boom"))
    sched.start()
    items = out.count(2)
    assert [(m.request_id, m.type) for m in items] == [("a", "error"), ("boom", "error")]
    assert all(str(m.data) == "batch failed" for m in items)
    sched.inbox.put(new("c", "c"))
    last = out.result_for("c")[-1]
    assert (last.type, last.data) == ("result", "C")


def test_outbox_wakes_once_per_burst() -> None:
    box = Outbox()
    calls: list[int] = []
    box.bind(lambda: calls.append(len(box)))
    for i in range(10):
        box.put(OutgoingMessage(f"r{i}", "result", i))
    assert len(calls) == 1, "one wake for a burst of puts"
    assert len(box) == 10
    drained = box.drain()
    assert [m.data for m in drained] == list(range(10))
    assert len(box) == 0
    assert box.drain() == []
    box.put(OutgoingMessage("again", "result", None))
    box.put(OutgoingMessage("again2", "result", None))
    assert len(calls) == 2, "the first put after a drain wakes again, the second does not"
    assert [m.request_id for m in box.drain()] == ["again", "again2"]


def test_outbox_without_waker_keeps_items() -> None:
    box = Outbox()
    box.put(OutgoingMessage("a", "result", 1))
    calls: list[None] = []
    box.bind(lambda: calls.append(None))
    box.put(OutgoingMessage("b", "result", 2))
    assert len(calls) == 1
    assert [m.request_id for m in box.drain()] == ["a", "b"]


def test_outbox_waker_called_outside_lock() -> None:
    # A waker that drains synchronously (as a same-thread consumer might) must not deadlock.
    box = Outbox()
    drained: list[OutgoingMessage] = []
    box.bind(lambda: drained.extend(box.drain()))
    done = threading.Event()

    def produce() -> None:
        box.put(OutgoingMessage("a", "result", 1))
        box.put(OutgoingMessage("b", "result", 2))
        done.set()

    threading.Thread(target=produce, daemon=True).start()
    assert done.wait(TIMEOUT), "Outbox.put deadlocked calling its waker"
    assert [m.request_id for m in drained] == ["a", "b"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"fn": lambda x: x, "batch_fn": lambda xs: xs},
    ],
    ids=["neither", "both"],
)
def test_needs_exactly_one_of_fn_or_batch_fn(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="exactly one of fn or batch_fn"):
        SimpleScheduler(**kwargs)


@pytest.mark.parametrize("kwargs", [{"max_batch_size": 0}, {"max_wait_ms": -1}])
def test_rejects_bad_batch_settings(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="max_batch_size"):
        SimpleScheduler(batch_fn=lambda xs: xs, **kwargs)


def test_stop_processes_queued_requests_then_joins_thread() -> None:
    sched = SimpleScheduler(lambda x: x)
    out = Collector(sched.outbox)
    for i in range(5):
        sched.inbox.put(new(f"r{i}", i))
    sched.start()
    thread = sched._thread
    assert thread is not None and thread.is_alive()
    sched.stop()
    assert not thread.is_alive(), "stop() must join the scheduler thread"
    assert sched._thread is None
    # Requests queued before stop() were computed before the thread exited.
    assert [m.request_id for m in out.count(5)] == [f"r{i}" for i in range(5)]
    sched.stop()  # idempotent


def test_stop_after_batch_joins_thread() -> None:
    sched = SimpleScheduler(batch_fn=lambda xs: xs, max_batch_size=4, max_wait_ms=60_000)
    sched.start()
    thread = sched._thread
    assert thread is not None
    sched.inbox.put(new("a", "a"))  # waits up to 60 s for a second request ...
    sched.stop()  # ... unless stop arrives: the batch runs, then the thread exits
    assert not thread.is_alive()
    assert [m.request_id for m in sched.outbox.drain()] == ["a"]


def test_stop_without_start_is_noop() -> None:
    SimpleScheduler(lambda x: x).stop()


@pytest.mark.parametrize("kind", ["stream_chunk", "stream_done"])
def test_stream_input_fails_the_request(stop_later, kind: str) -> None:
    seen: list[Any] = []
    sched = stop_later(SimpleScheduler(lambda x: seen.append(x) or x))
    out = Collector(sched.outbox)
    sched.inbox.put(IncomingMessage("s", kind, "chunk", source="up", chunk_id=0))
    sched.inbox.put(IncomingMessage("s", kind, "chunk", source="up", chunk_id=1))
    sched.inbox.put(new("after", 1))
    sched.start()
    items = out.result_for("after")
    assert [(m.request_id, m.type) for m in items] == [("s", "error"), ("after", "result")]
    assert isinstance(items[0].data, TypeError)
    assert str(items[0].data) == (
        "stage scheduler SimpleScheduler does not take stream input; "
        "use StreamingScheduler or ARScheduler"
    )
    assert seen == [1], "fn must never see a stream chunk"
