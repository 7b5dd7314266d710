"""ARScheduler in-process: continuous batching, FIFO admission, errors, aborts, fairness.

Step functions record the batch they saw; tests hold a step open with an event to let
messages queue up at a known step boundary. No sleeps or timing assertions.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from omnirail.stage.ar import ARRequest, ARScheduler, ARStep
from omnirail.stage.scheduler import IncomingMessage
from tests.unit.stage.scheduler_support import TIMEOUT, Collector, new


def countdown(batch: list[ARRequest]) -> list[ARStep]:
    """Each request emits its step number and finishes after `data` steps."""
    return [
        ARStep(chunk=r.steps, finished=r.steps + 1 >= r.data, result=f"{r.request_id}-done")
        for r in batch
    ]


class Recorder:
    """A step_fn wrapper recording batch membership; `hold` pauses the next step."""

    def __init__(self, inner: Callable[[list[ARRequest]], list[ARStep]] = countdown) -> None:
        self.inner = inner
        self.batches: list[list[str]] = []
        self.held = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def hold(self) -> None:
        self.held.clear()
        self.release.clear()

    def __call__(self, batch: list[ARRequest]) -> list[ARStep]:
        self.batches.append([r.request_id for r in batch])
        if not self.release.is_set():
            self.held.set()
            assert self.release.wait(TIMEOUT)
        return self.inner(batch)


@pytest.fixture
def started() -> Iterator[Callable[..., tuple[ARScheduler, Collector]]]:
    scheds: list[ARScheduler] = []

    def make(*args: Any, **kwargs: Any) -> tuple[ARScheduler, Collector]:
        sched = ARScheduler(*args, **kwargs)
        out = Collector(sched.outbox)
        scheds.append(sched)
        sched.start()
        return sched, out

    yield make
    for s in scheds:
        s.stop()


def test_requests_join_and_leave_at_step_boundaries(started) -> None:
    rec = Recorder()
    sched, out = started(rec)
    rec.hold()
    sched.inbox.put(new("a", 4))
    assert rec.held.wait(TIMEOUT)  # step 1 of "a" is running
    sched.inbox.put(new("b", 2))
    rec.release.set()
    out.final_for("a")
    out.final_for("b")
    # "b" joined after a's first step, left after two; "a" kept going alone.
    assert rec.batches == [["a"], ["a", "b"], ["a", "b"], ["a"]]
    assert out.of("a") == [*[("stream", i) for i in range(4)], ("result", "a-done")]
    assert out.of("b") == [("stream", 0), ("stream", 1), ("result", "b-done")]


def test_max_batch_size_with_fifo_waiting(started) -> None:
    rec = Recorder()
    sched, out = started(rec, max_batch_size=2)
    rec.hold()
    sched.inbox.put(new("a", 1))
    assert rec.held.wait(TIMEOUT)
    for rid, n in (("b", 3), ("c", 1), ("d", 1)):
        sched.inbox.put(new(rid, n))
    rec.release.set()
    for rid in "abcd":
        assert out.final_for(rid).type == "result"
    # "a" leaves after one step; b and c fill the two slots; d waits for c's slot.
    assert rec.batches == [["a"], ["b", "c"], ["b", "d"], ["b"]]
    assert max(len(b) for b in rec.batches) <= 2


def test_one_put_many_per_step(started) -> None:
    rec = Recorder()
    sched = ARScheduler(rec)
    calls: list[list[str]] = []
    real_put_many = sched.outbox.put_many

    def counting_put_many(msgs: Any) -> None:
        msgs = list(msgs)
        calls.append([f"{m.request_id}:{m.type}" for m in msgs])
        real_put_many(msgs)

    sched.outbox.put_many = counting_put_many  # type: ignore[method-assign]
    out = Collector(sched.outbox)
    for rid, n in (("a", 2), ("b", 1), ("c", 3)):
        sched.inbox.put(new(rid, n))
    sched.start()  # all three are queued before the thread runs: they start together
    try:
        out.final_for("c")
    finally:
        sched.stop()
    assert rec.batches == [["a", "b", "c"], ["a", "c"], ["c"]]
    assert calls == [
        ["a:stream", "b:stream", "b:result", "c:stream"],
        ["a:stream", "a:result", "c:stream"],
        ["c:stream", "c:result"],
    ]


def test_step_fn_error_fails_that_batch_only() -> None:
    rec = Recorder()

    def step(batch: list[ARRequest]) -> list[ARStep]:
        if any(r.data == "boom" for r in batch):
            raise RuntimeError("step failed")
        return countdown(batch)

    rec.inner = step
    sched = ARScheduler(rec, max_batch_size=2)
    out = Collector(sched.outbox)
    for rid, n in (("x", "boom"), ("y", 5), ("z", 2)):
        sched.inbox.put(new(rid, n))
    sched.start()  # x and y form the first batch; z waits for a slot
    try:
        assert str(out.final_for("x").data) == "step failed"
        assert out.final_for("y").data is out.final_for("x").data
        assert out.final_for("z").type == "result"
        # The scheduler still takes work.
        sched.inbox.put(new("later", 1))
        assert out.final_for("later").type == "result"
    finally:
        sched.stop()
    assert rec.batches[:3] == [["x", "y"], ["z"], ["z"]]
    assert out.of("y") == [("error", out.final_for("x").data)]


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        (lambda b: None, "step_fn must return a list of 2 ARStep (one per request), got NoneType"),
        (lambda b: [ARStep()], "step_fn must return a list of 2 ARStep (one per request), got 1"),
        (lambda b: [ARStep(), "x"], "step_fn must return a list of ARStep; item 1 is str"),
    ],
    ids=["not-a-list", "too-short", "wrong-item"],
)
def test_bad_step_fn_return_fails_batch_with_clear_message(
    returned: Callable[[list[ARRequest]], Any], message: str
) -> None:
    sched = ARScheduler(returned)
    out = Collector(sched.outbox)
    sched.inbox.put(new("a"))
    sched.inbox.put(new("b"))
    sched.start()
    try:
        errs = [out.final_for("a"), out.final_for("b")]
    finally:
        sched.stop()
    for e in errs:
        assert e.type == "error" and isinstance(e.data, TypeError)
        assert str(e.data) == message
    assert len(out.items) == 2


def test_aborted_request_removed_at_next_step(started) -> None:
    rec = Recorder()
    sched, out = started(rec)
    rec.hold()
    sched.inbox.put(new("a", 10))
    sched.inbox.put(new("b", 3))
    assert rec.held.wait(TIMEOUT)  # first step of a and b is running
    sched.abort("a")
    rec.release.set()
    out.final_for("b")
    assert rec.batches == [["a", "b"], ["b"], ["b"]]
    assert out.of("a") == []  # its first step finished after the abort: dropped
    assert "a" not in sched._live


def test_init_fn_runs_once_on_join_and_failure_fails_only_that_request(started) -> None:
    inits: list[str] = []

    def init_fn(req: ARRequest) -> None:
        inits.append(req.request_id)
        if req.data == "bad":
            raise ValueError("prefill failed")
        req.state["n"] = req.data

    def step(batch: list[ARRequest]) -> list[ARStep]:
        return [ARStep(finished=r.steps + 1 >= r.state["n"], result=r.steps + 1) for r in batch]

    sched, out = started(step, init_fn=init_fn)
    sched.inbox.put(new("bad", "bad"))
    sched.inbox.put(new("ok", 3))
    assert str(out.final_for("bad").data) == "prefill failed"
    assert out.final_for("ok").data == 3
    assert inits == ["bad", "ok"]


def test_backpressured_request_does_not_stall_others(started) -> None:
    rec = Recorder()
    sched = ARScheduler(rec, max_unsent=4)
    backed_up = threading.Event()
    backed_up.set()
    real_unsent = sched.outbox.unsent

    def fake_unsent(rid: str | None = None) -> int:
        if rid == "slow" and backed_up.is_set():
            return 100
        return real_unsent(rid)

    sched.outbox.unsent = fake_unsent  # type: ignore[method-assign]
    out = Collector(sched.outbox)
    sched.inbox.put(new("slow", 2))
    sched.inbox.put(new("fast", 3))
    sched.start()
    try:
        assert out.final_for("fast").type == "result"
        assert all(b == ["fast"] for b in rec.batches), rec.batches
        backed_up.clear()  # the consumer caught up: "slow" rejoins
        assert out.final_for("slow").type == "result"
    finally:
        sched.stop()
    assert rec.batches[-2:] == [["slow"], ["slow"]]


def test_stream_inputs_reach_inputs_and_inputs_done(started) -> None:
    seen: list[tuple[list[str], bool]] = []

    def step(batch: list[ARRequest]) -> list[ARStep]:
        steps = []
        for r in batch:
            seen.append((list(r.inputs), r.inputs_done))
            if r.inputs_done:
                steps.append(ARStep(finished=True, result="".join(r.inputs)))
            else:
                steps.append(ARStep(needs_input=True))
        return steps

    sched, out = started(step)
    sched.inbox.put(new("r"))
    for i, c in enumerate("abc"):
        sched.inbox.put(IncomingMessage("r", "stream_chunk", c, source="up", chunk_id=i))
    sched.inbox.put(IncomingMessage("r", "stream_done", None))
    assert out.final_for("r").data == "abc"
    assert seen[-1] == (["a", "b", "c"], True)
    # Parked between messages: at most one step per delivered message, plus the first.
    assert len(seen) <= 5
    # Input for unknown requests is ignored.
    sched.inbox.put(IncomingMessage("ghost", "stream_chunk", "x"))
    sched.inbox.put(new("r2"))
    sched.inbox.put(IncomingMessage("r2", "stream_done", None))
    assert out.final_for("r2").data == ""
    assert not any(m.request_id == "ghost" for m in out.items)


def test_needs_input_after_stream_done_fails_request(started) -> None:
    sched, out = started(lambda b: [ARStep(needs_input=True) for _ in b])
    sched.inbox.put(new("r"))
    sched.inbox.put(IncomingMessage("r", "stream_done", None))
    err = out.final_for("r")
    assert err.type == "error" and "more input after stream_done" in str(err.data)


def test_duplicate_new_request_fails_that_request(started) -> None:
    rec = Recorder()
    sched, out = started(rec)
    rec.hold()
    sched.inbox.put(new("a", 5))
    assert rec.held.wait(TIMEOUT)
    sched.inbox.put(new("a", 5))
    sched.inbox.put(new("b", 1))
    rec.release.set()
    out.final_for("b")
    assert out.final_for("a").type == "error"
    assert "already running" in str(out.final_for("a").data)
    assert rec.batches == [["a"], ["b"]]


@pytest.mark.parametrize("kwargs", [{"max_batch_size": 0}, {"max_unsent": 0}])
def test_rejects_bad_settings(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        ARScheduler(countdown, **kwargs)


def test_stop_joins_thread_with_running_requests() -> None:
    sched = ARScheduler(lambda b: [ARStep(needs_input=True) for _ in b])
    sched.inbox.put(new("parked"))
    sched.start()
    thread = sched._thread
    assert thread is not None
    sched.stop()
    assert not thread.is_alive()


def test_hold_inputs_returns_credit_only_as_step_fn_takes_inputs() -> None:
    recorder: Recorder
    acks: list[tuple[str, int]] = []

    def ack(name: str) -> Callable[[], None]:
        return lambda: acks.append((name, len(recorder.batches)))  # the step that took it

    def one_per_step(batch: list[ARRequest]) -> list[ARStep]:
        out = []
        for r in batch:
            if r.inputs:
                [x] = r.take_inputs(1)
                out.append(ARStep(chunk=x))
            elif r.inputs_done:
                out.append(ARStep(finished=True, result="done"))
            else:
                out.append(ARStep(needs_input=True))
        return out

    recorder = Recorder(one_per_step)
    sched = ARScheduler(recorder, hold_inputs=True)
    collector = Collector(sched.outbox)
    # Run the credit callbacks as soon as they are due (the stage does it on its loop).
    sched.inbox.bind(lambda: [fn() for fn in sched.inbox.drain_taken()])
    recorder.hold()
    sched.start()
    try:
        sched.inbox.put(new("r"))
        assert recorder.held.wait(TIMEOUT)  # step 1 is open; queue three chunks and done
        for i in range(3):
            sched.inbox.put(IncomingMessage("r", "stream_chunk", i, "up", i, ack(f"c{i}")))
        sched.inbox.put(IncomingMessage("r", "stream_done", None))
        recorder.release.set()
        assert collector.final_for("r").data == "done"
        assert [d for t, d in collector.of("r") if t == "stream"] == [0, 1, 2]
        # Each chunk's credit went back in the step that took it, not when it arrived.
        assert acks == [("c0", 2), ("c1", 3), ("c2", 4)]
    finally:
        sched.stop()


def test_hold_inputs_releases_held_chunks_on_abort() -> None:
    released: list[int] = []

    def hoard(batch: list[ARRequest]) -> list[ARStep]:
        return [ARStep(needs_input=True) for _ in batch]  # never takes its inputs

    sched = ARScheduler(hoard, hold_inputs=True)
    sched.inbox.bind(lambda: None)
    sched.start()
    try:
        sched.inbox.put(new("r"))
        for i in range(3):
            sched.inbox.put(
                IncomingMessage("r", "stream_chunk", i, "up", i, lambda i=i: released.append(i))
            )
        deadline = threading.Event()
        for _ in range(int(TIMEOUT / 0.01)):  # wait until the chunks are parked in `inputs`
            if sched.inbox.empty():
                break
            deadline.wait(0.01)
        assert not sched.inbox.drain_taken()  # held: no credit back yet
        sched.abort("r")
        sched.inbox.put(new("other"))  # wakes the loop so it handles the abort
        for _ in range(int(TIMEOUT / 0.01)):
            taken = sched.inbox.drain_taken()
            for fn in taken:
                fn()
            if len(released) == 3:
                break
            deadline.wait(0.01)
        assert sorted(released) == [0, 1, 2]
    finally:
        sched.stop()


def test_end_fn_runs_once_for_every_admitted_request_however_it_ends(started) -> None:
    """Finished, aborted mid-run, failed in init_fn: end_fn once each; a request aborted
    while it waited was never initialized and gets none."""
    ended: list[str] = []

    def init_fn(req: ARRequest) -> None:
        if req.request_id == "bad":
            raise ValueError("prefill failed")

    rec = Recorder()
    sched, out = started(rec, init_fn=init_fn, end_fn=ended.append, max_batch_size=2)
    rec.hold()
    for rid, steps in (("a", 2), ("b", 500), ("w", 5), ("bad", 1)):
        sched.inbox.put(new(rid, steps))
    assert rec.held.wait(TIMEOUT)  # a and b run; w and bad wait for a slot
    sched.abort("w")
    rec.release.set()
    out.final_for("a")
    sched.abort("b")
    assert str(out.final_for("bad").data) == "prefill failed"
    deadline = time.monotonic() + TIMEOUT
    while sorted(ended) != ["a", "b", "bad"]:
        assert time.monotonic() < deadline, ended
        time.sleep(0.01)
    assert len(ended) == 3 and sched._admitted == set()
