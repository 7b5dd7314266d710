"""Receiving side of stream edges in `Stage`: chunk checks, acks, early chunks, aborts.

Stage "b" is fed only by a's stream; "h" gets a's payload and a's stream. Each fault test
keeps a healthy request "ok" in flight around the broken one, to show the fault stays
with its request. Tests poll for conditions and never sleep for a fixed time.
"""

from __future__ import annotations

from typing import Any

import pytest

from omnirail.config import PipelineConfig
from omnirail.stage.streaming import StreamingScheduler
from omnirail.stage_service.host import build_scheduler
from omnirail.wire.errors import Code, OmniError
from tests.unit.stage_service.stage_fakes import (
    HERE,
    TRACE,
    Harness,
    RecordingScheduler,
    chunk,
    done,
    payload,
    pipeline,
    running,
    stream_error,
    until,
)


def streams_only() -> PipelineConfig:
    """a streams to b (which takes no payload); c is a's payload successor only."""
    return pipeline(
        {"name": "a", "next": ["c"], "stream_to": ["b"]},
        {"name": "b", "terminal": True},
        {"name": "c", "terminal": True},
    )


def payload_and_stream(hold: bool) -> PipelineConfig:
    return pipeline(
        {"name": "a", "next": ["h"], "stream_to": ["h"]},
        {"name": "h", "terminal": True, "stream": {"hold_early_chunks": hold}},
    )


async def finish_ok(h: Harness, data: Any = None, to: str = "b") -> None:
    """Ends "ok" (chunk 0 already sent) and checks it completed untouched."""
    await h.send(chunk("ok", 1, "ok1", to=to), done("ok", 2, to=to))
    await until(lambda: h.reporter.done("ok"), "ok to complete")
    assert h.reporter.result("ok") == {"data": data, "chunks": ["ok0", "ok1"]}
    assert h.reporter.failures("ok") == []
    await until(lambda: len(h.acked("ok:a:1")) == 1, "ok's chunks to be acked")
    assert h.acked("ok:a:0") == h.acked("ok:a:1") == [None]


def check_failed(h: Harness, rid: str, code: int, *parts: str) -> OmniError:
    (err,) = h.reporter.failures(rid)  # reported once, however many items follow
    assert (err.code, err.stage) == (code, h.stage.name)
    for part in parts:
        assert part in err.message
    assert rid in h.scheduler.aborts
    assert not h.reporter.done(rid)
    return err


async def test_chunks_reach_scheduler_in_order_and_are_acked_once_taken() -> None:
    sched = RecordingScheduler(gated=True)
    async with running(streams_only(), "b", sched) as h:
        await h.send(*(chunk("r", i, f"v{i}") for i in range(3)), done("r", 3))
        # The done signal holds nothing, so it is acked at once; chunks wait for the take.
        assert h.acks == [("r:a:done", None)]
        assert sched.inbox.qsize() == 5

        sched.admit(2)  # new_request, then chunk 0
        await until(lambda: h.acked("r:a:0") == [None], "chunk 0's ack")
        assert h.acked("r:a:1") == h.acked("r:a:2") == []  # still in the gated inbox

        sched.admit(3)
        await until(lambda: h.reporter.done("r"), "the result")
        assert sched.of("r") == [
            ("new_request", None, "", -1),
            ("stream_chunk", "v0", "a", 0),
            ("stream_chunk", "v1", "a", 1),
            ("stream_chunk", "v2", "a", 2),
            ("stream_done", None, "", -1),
        ]
        assert h.reporter.completes == [("r", {"data": None, "chunks": ["v0", "v1", "v2"]}, TRACE)]
        await until(lambda: len(h.acks) == 4, "every chunk's ack")
        assert all(err is None for _, err in h.acks)
        assert h.stage.inflight == 0


@pytest.mark.parametrize("bad_id", [2, 0], ids=["out_of_order", "duplicate"])
async def test_unexpected_chunk_id_fails_request(bad_id: int) -> None:
    async with running(streams_only(), "b", RecordingScheduler()) as h:
        await h.send(chunk("ok", 0, "ok0"), chunk("bad", 0, "x"), chunk("bad", bad_id, "y"))
        err = check_failed(
            h, "bad", Code.INVALID_ARGUMENT, f"chunk {bad_id} from 'a'", "out of order", "dup"
        )
        assert "expected chunk 1" in err.message
        assert h.acked(f"bad:a:{bad_id}")[-1] is err  # the producer learns of it too
        # The rest of the broken stream is drained quietly.
        await h.send(chunk("bad", 1, "z"), done("bad", 2))
        assert h.acked("bad:a:1") == h.acked("bad:a:done") == [None]
        await finish_ok(h)
        assert ("stream_done", None, "", -1) not in h.scheduler.of("bad")
        assert len(h.reporter.failures("bad")) == 1


async def test_chunk_after_done_fails_request() -> None:
    # Gated so "bad" cannot finish (and be forgotten) before its late chunk arrives.
    sched = RecordingScheduler(gated=True)
    async with running(streams_only(), "b", sched) as h:
        await h.send(chunk("ok", 0, "ok0"), chunk("bad", 0, "x"), done("bad", 1))
        await h.send(chunk("bad", 1, "late"))
        err = check_failed(h, "bad", Code.INVALID_ARGUMENT, "stream item 1 from 'a'")
        assert "after its done" in err.message
        assert h.acked("bad:a:1") == [err]
        sched.admit(100)
        await finish_ok(h)
        # Once a request has ended, a straggler is drained, not an error.
        await h.send(chunk("ok", 2, "after"))
        assert h.acked("ok:a:2") == [None]
        assert h.reporter.failures("ok") == []


@pytest.mark.parametrize("count", [1, 3])
async def test_done_with_wrong_count_fails_request(count: int) -> None:
    async with running(streams_only(), "b", RecordingScheduler()) as h:
        await h.send(chunk("ok", 0, "ok0"), chunk("bad", 0, "x"), chunk("bad", 1, "y"))
        await h.send(done("bad", count))
        check_failed(h, "bad", Code.INVALID_ARGUMENT, f"ended after {count} chunks, but 2 arrived")
        assert h.acked("bad:a:done")[0] is not None
        await finish_ok(h)
        assert ("stream_done", None, "", -1) not in h.scheduler.of("bad")


async def test_stream_from_stage_without_stream_to_fails_request() -> None:
    async with running(streams_only(), "b", RecordingScheduler()) as h:
        await h.send(chunk("ok", 0, "ok0"), chunk("bad", 0, "x", src="c"))
        err = check_failed(
            h, "bad", Code.INVALID_ARGUMENT, "stream from 'c'", "does not list 'b' in stream_to"
        )
        assert h.acked("bad:c:0") == [err]
        await finish_ok(h)
        assert h.scheduler.of("bad") == []


async def test_producer_error_signal_drops_request_without_reporting() -> None:
    async with running(streams_only(), "b", RecordingScheduler()) as h:
        boom = OmniError(Code.INTERNAL, "model exploded", "a")
        await h.send(chunk("ok", 0, "ok0"), chunk("bad", 0, "x"), stream_error("bad", boom))
        assert h.acked("bad:a:error") == [None]
        assert "bad" in h.scheduler.aborts
        await h.send(chunk("bad", 1, "y"), done("bad", 2))  # in flight before the error
        await finish_ok(h)
        # The producer reported the failure; a second report would duplicate it.
        assert h.reporter.failures("bad") == []
        assert not h.reporter.done("bad")
        assert [t for t, *_ in h.scheduler.of("bad")] == ["new_request", "stream_chunk"]


async def test_chunks_of_aborted_request_are_acked_and_dropped() -> None:
    async with running(streams_only(), "b", RecordingScheduler()) as h:
        await h.send(chunk("ok", 0, "ok0"), chunk("mid", 0, "m0"))
        await until(lambda: len(h.scheduler.of("mid")) == 2, "mid's first chunk taken")
        h.stage.abort("gone")  # the coordinator's abort may beat the first chunk here
        h.stage.abort("mid")
        await h.send(chunk("gone", 0, "g0"), chunk("gone", 1, "g1"), done("gone", 2))
        await h.send(chunk("mid", 1, "m1"), done("mid", 2))
        for key in ("gone:a:0", "gone:a:1", "gone:a:done", "mid:a:1", "mid:a:done"):
            assert h.acked(key) == [None], key
        await finish_ok(h)
        assert h.scheduler.of("gone") == []
        assert [t for t, *_ in h.scheduler.of("mid")] == ["new_request", "stream_chunk"]
        assert h.reporter.fails == []
        assert h.stage.inflight == 0


async def test_early_chunk_fails_request_unless_held() -> None:
    async with running(payload_and_stream(hold=False), "h", RecordingScheduler()) as h:
        await h.send(payload("ok", "P", src="a", to="h"), chunk("ok", 0, "ok0", to="h"))
        await h.send(chunk("bad", 0, "x", to="h"))
        check_failed(
            h,
            "bad",
            Code.INVALID_ARGUMENT,
            "arrived before the request's payload",
            "stream.hold_early_chunks",
        )
        [err] = h.acked("bad:a:0")  # acked with the reason, like every rejected item
        assert err is not None and "hold_early_chunks" in err.message
        await h.send(payload("bad", "late", src="a", to="h"))
        await finish_ok(h, data="P", to="h")
        assert h.scheduler.of("bad") == []


async def test_held_early_chunks_follow_the_payload() -> None:
    sched = RecordingScheduler(gated=True)
    async with running(payload_and_stream(hold=True), "h", sched) as h:
        await h.send(chunk("r", 0, "v0", to="h"), chunk("r", 1, "v1", to="h"), done("r", 2, to="h"))
        assert sched.inbox.qsize() == 0  # nothing may reach the scheduler before new_request
        assert h.acks == [("r:a:done", None)]  # held chunks keep the producer's credit

        await h.send(payload("r", "P", src="a", to="h"))
        assert sched.inbox.qsize() == 4
        sched.admit(4)
        await until(lambda: h.reporter.done("r"), "the result")
        assert sched.of("r") == [
            ("new_request", "P", "", -1),
            ("stream_chunk", "v0", "a", 0),
            ("stream_chunk", "v1", "a", 1),
            ("stream_done", None, "", -1),
        ]
        assert h.reporter.result("r") == {"data": "P", "chunks": ["v0", "v1"]}
        await until(lambda: len(h.acks) == 3, "the held chunks' acks")
        assert h.acked("r:a:0") == h.acked("r:a:1") == [None]


async def test_held_early_chunks_are_acked_when_request_aborts() -> None:
    async with running(payload_and_stream(hold=True), "h", RecordingScheduler()) as h:
        await h.send(chunk("r", 0, "v0", to="h"))
        assert h.acked("r:a:0") == []
        h.stage.abort("r")  # e.g. the coordinator gave up before a's payload came
        await until(lambda: h.acked("r:a:0") == [None], "the held chunk's ack")


@pytest.mark.parametrize("factory", ["make_plain", "make_simple"])
def test_simple_scheduler_cannot_take_streams(factory: str) -> None:
    cfg = pipeline(
        {"name": "a", "terminal": True, "stream_to": ["b"]},
        {"name": "b", "terminal": True, "factory": f"{HERE}:{factory}"},
    )
    with pytest.raises(TypeError, match=r"stages\[b\]: a stream to it") as info:
        build_scheduler(cfg, "b")
    assert "SimpleScheduler takes no stream input" in str(info.value)
    # Not being a stream target, a is fine with a plain function.
    plain = pipeline({"name": "a", "terminal": True, "factory": f"{HERE}:{factory}"})
    assert not build_scheduler(plain, "a").takes_streams


def test_streaming_scheduler_may_take_streams() -> None:
    cfg = pipeline(
        {"name": "a", "terminal": True, "stream_to": ["b"]},
        {"name": "b", "terminal": True, "factory": f"{HERE}:make_echo"},
    )
    assert isinstance(build_scheduler(cfg, "b"), StreamingScheduler)
