"""StreamingScheduler in-process: window/hop arithmetic, flush, results, errors, aborts.

Tests synchronise on outbox wakes and events, never on sleeps or timings.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from omnirail.stage.scheduler import IncomingMessage
from omnirail.stage.streaming import StreamingScheduler, StreamState
from tests.unit.stage.scheduler_support import TIMEOUT, Collector, new


def chunk(rid: str, data: Any, n: int = 0) -> IncomingMessage:
    return IncomingMessage(rid, "stream_chunk", data, source="up", chunk_id=n)


def done(rid: str) -> IncomingMessage:
    return IncomingMessage(rid, "stream_done", None)


def feed(sched: StreamingScheduler, rid: str, chunks: list[Any], *, finish: bool = True) -> None:
    sched.inbox.put(new(rid))
    for i, c in enumerate(chunks):
        sched.inbox.put(chunk(rid, c, i))
    if finish:
        sched.inbox.put(done(rid))


@pytest.fixture
def started() -> Iterator[Callable[..., tuple[StreamingScheduler, Collector]]]:
    scheds: list[StreamingScheduler] = []

    def make(*args: Any, **kwargs: Any) -> tuple[StreamingScheduler, Collector]:
        sched = StreamingScheduler(*args, **kwargs)
        out = Collector(sched.outbox)
        scheds.append(sched)
        sched.start()
        return sched, out

    yield make
    for s in scheds:
        s.stop()


def recorder() -> tuple[list[tuple[list[Any], bool]], Callable[..., Any]]:
    seen: list[tuple[list[Any], bool]] = []

    def window_fn(state: StreamState, chunks: list[Any], final: bool) -> Any:
        seen.append((chunks, final))
        return sum(chunks)

    return seen, window_fn


@pytest.mark.parametrize(
    ("window", "hop", "n", "expected"),
    [
        # Overlap: windows advance by 2; the tail [6, 7, 8] holds one new chunk (8).
        (4, 2, 9, [([0, 1, 2, 3], False), ([2, 3, 4, 5], False), ([4, 5, 6, 7], False),
                   ([6, 7, 8], True)]),
        # Overlap ending exactly on a window: the kept [6, 7] were covered, no flush.
        (4, 2, 8, [([0, 1, 2, 3], False), ([2, 3, 4, 5], False), ([4, 5, 6, 7], False)]),
        # No overlap (hop defaults to window).
        (3, None, 7, [([0, 1, 2], False), ([3, 4, 5], False), ([6], True)]),
        (3, None, 6, [([0, 1, 2], False), ([3, 4, 5], False)]),
        # Fewer chunks than one window: everything goes in the final flush.
        (5, 1, 3, [([0, 1, 2], True)]),
        (3, 1, 5, [([0, 1, 2], False), ([1, 2, 3], False), ([2, 3, 4], False)]),
        (1, None, 3, [([0], False), ([1], False), ([2], False)]),
        (4, 2, 0, []),
    ],
)  # fmt: skip
def test_window_hop_and_flush_arithmetic(
    started, window: int, hop: int | None, n: int, expected: list[tuple[list[int], bool]]
) -> None:
    seen, window_fn = recorder()
    sched, out = started(window_fn, window=window, hop=hop)
    feed(sched, "r", list(range(n)))
    result = out.final_for("r")
    assert seen == expected
    assert out.of("r") == [("stream", sum(c)) for c, _ in expected] + [
        ("result", {"chunks": n, "windows": len(expected)})
    ]
    assert result.type == "result"
    assert all(m.target is None for m in out.items)


def test_none_return_emits_nothing_and_finish_fn_gives_result(started) -> None:
    def start_fn(state: StreamState) -> None:
        state.user["acc"] = [state.data]

    def window_fn(state: StreamState, chunks: list[str], final: bool) -> str | None:
        state.user["acc"].extend(chunks)
        return "".join(chunks) if final else None

    def finish_fn(state: StreamState) -> dict[str, Any]:
        return {"acc": state.user["acc"], "in": state.chunks_in, "windows": state.windows}

    sched, out = started(
        window_fn, window=2, start_fn=start_fn, finish_fn=finish_fn, metadata={"modality": "text"}
    )
    sched.inbox.put(new("r", "head"))
    for i, c in enumerate("abcde"):
        sched.inbox.put(chunk("r", c, i))
    sched.inbox.put(done("r"))
    out.final_for("r")
    assert out.of("r") == [
        ("stream", "e"),
        ("result", {"acc": ["head", "a", "b", "c", "d", "e"], "in": 5, "windows": 3}),
    ]
    assert out.items[0].metadata == {"modality": "text"}


def test_subclass_hooks_and_emit() -> None:
    class Doubler(StreamingScheduler):
        def new_request(self, state: StreamState) -> None:
            state.user["n"] = 0

        def process_window(self, state: StreamState, chunks: list[int], final: bool) -> None:
            for c in chunks:
                state.user["n"] += 1
                self.emit(state, c, target="left", metadata={"modality": "audio"})
                self.emit(state, -c, target="right")

        def finish(self, state: StreamState) -> int:
            return state.user["n"]

    sched = Doubler(window=2)
    out = Collector(sched.outbox)
    sched.start()
    try:
        feed(sched, "r", [1, 2, 3])
        out.final_for("r")
    finally:
        sched.stop()
    got = [(m.type, m.data, m.target) for m in out.items]
    assert got == [
        ("stream", 1, "left"),
        ("stream", -1, "right"),
        ("stream", 2, "left"),
        ("stream", -2, "right"),
        ("stream", 3, "left"),
        ("stream", -3, "right"),
        ("result", 3, None),
    ]
    assert out.items[0].metadata == {"modality": "audio"}


def test_window_fn_error_fails_only_that_request(started) -> None:
    def window_fn(state: StreamState, chunks: list[int], final: bool) -> int:
        if -1 in chunks:
            raise ValueError("bad chunk")
        return sum(chunks)

    sched, out = started(window_fn, window=2)
    sched.inbox.put(new("bad"))
    sched.inbox.put(new("good"))
    for i, (b, g) in enumerate([(0, 1), (-1, 2), (5, 3), (6, 4)]):
        sched.inbox.put(chunk("bad", b, i))
        sched.inbox.put(chunk("good", g, i))
    sched.inbox.put(done("bad"))
    sched.inbox.put(done("good"))
    err = out.final_for("bad")
    assert err.type == "error" and isinstance(err.data, ValueError)
    assert str(err.data) == "bad chunk"
    assert out.final_for("good").type == "result"
    # Nothing for "bad" after its error; "good" saw every window.
    assert out.of("bad") == [("error", err.data)]
    assert out.of("good") == [("stream", 3), ("stream", 7), ("result", {"chunks": 4, "windows": 2})]
    # The thread survived.
    feed(sched, "later", [1])
    assert out.final_for("later").type == "result"


def test_start_and_finish_errors_fail_the_request(started) -> None:
    def start_fn(state: StreamState) -> None:
        if state.data == "no-start":
            raise RuntimeError("start failed")

    def finish_fn(state: StreamState) -> str:
        if state.data == "no-finish":
            raise RuntimeError("finish failed")
        return "ok"

    sched, out = started(lambda s, c, f: None, start_fn=start_fn, finish_fn=finish_fn)
    for rid in ("no-start", "no-finish", "fine"):
        sched.inbox.put(new(rid, rid))
        sched.inbox.put(chunk(rid, 1))
        sched.inbox.put(done(rid))
    assert str(out.final_for("no-start").data) == "start failed"
    assert str(out.final_for("no-finish").data) == "finish failed"
    assert out.final_for("fine").data == "ok"
    assert len(out.of("no-start")) == 1  # its chunk and done were ignored


def test_abort_mid_stream_stops_output_and_drops_state(started) -> None:
    in_window, release = threading.Event(), threading.Event()

    def window_fn(state: StreamState, chunks: list[int], final: bool) -> int:
        if chunks == [1]:
            in_window.set()
            assert release.wait(TIMEOUT)
        return chunks[0]

    sched, out = started(window_fn)
    sched.inbox.put(new("a"))
    sched.inbox.put(chunk("a", 0, 0))
    sched.inbox.put(chunk("a", 1, 1))
    assert in_window.wait(TIMEOUT)
    sched.abort("a")
    release.set()
    sched.inbox.put(chunk("a", 2, 2))
    sched.inbox.put(done("a"))
    feed(sched, "b", [7])  # handled after all of "a": output for "a" would precede it
    out.final_for("b")
    assert out.of("a") == [("stream", 0)]
    assert "a" not in sched._states


def test_unknown_request_input_is_ignored(started) -> None:
    seen, window_fn = recorder()
    sched, out = started(window_fn)
    sched.inbox.put(chunk("ghost", 1))
    sched.inbox.put(done("ghost"))
    feed(sched, "real", [2])
    out.final_for("real")
    assert [m.request_id for m in out.items] == ["real", "real"]
    assert seen == [([2], False)]


def test_duplicate_new_request_fails_that_request(started) -> None:
    sched, out = started(lambda s, c, f: c[0])
    sched.inbox.put(new("r"))
    sched.inbox.put(chunk("r", 1))
    sched.inbox.put(new("r"))
    sched.inbox.put(chunk("r", 2))  # the request is gone: ignored
    sched.inbox.put(done("r"))
    feed(sched, "after", [])
    out.final_for("after")
    types = [t for t, _ in out.of("r")]
    assert types == ["stream", "error"]
    assert "already running" in str(out.of("r")[1][1])


def test_interleaved_requests_keep_separate_state(started) -> None:
    sched, out = started(lambda s, c, f: (s.request_id, c), window=2, hop=1)
    for rid in ("x", "y"):
        sched.inbox.put(new(rid))
    for i in range(3):
        sched.inbox.put(chunk("x", f"x{i}", i))
        sched.inbox.put(chunk("y", f"y{i}", i))
    sched.inbox.put(done("x"))
    sched.inbox.put(done("y"))
    out.final_for("x")
    out.final_for("y")
    assert [d for t, d in out.of("x") if t == "stream"] == [
        ("x", ["x0", "x1"]),
        ("x", ["x1", "x2"]),
    ]
    assert [d for t, d in out.of("y") if t == "stream"] == [
        ("y", ["y0", "y1"]),
        ("y", ["y1", "y2"]),
    ]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"window": 0}, "window must be >= 1"),
        ({"window": 2, "hop": 3}, "hop must be between 1 and window"),
        ({"window": 2, "hop": 0}, "hop must be between 1 and window"),
    ],
)
def test_rejects_bad_window_settings(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StreamingScheduler(lambda s, c, f: None, **kwargs)


def test_needs_window_fn_or_override() -> None:
    with pytest.raises(ValueError, match="window_fn"):
        StreamingScheduler()


def test_stop_joins_thread() -> None:
    sched = StreamingScheduler(lambda s, c, f: None)
    sched.start()
    thread = sched._thread
    assert thread is not None and thread.is_alive()
    sched.stop()
    assert not thread.is_alive()
    sched.stop()  # idempotent
