"""Sending side of stream edges in `Stage`: chunk ids, done signals, client chunks, credit.

Stage "s" runs `emit_chunks`: a request's payload says how many chunks to stream and
where. Credit comes back only when a test releases the handle passed to `router.deliver`,
standing in for the receiver's ack. Tests poll for conditions and never sleep.
"""

from __future__ import annotations

import pytest

from omnirail.config import PipelineConfig
from omnirail.stage.scheduler import CLIENT
from omnirail.wire.errors import Code
from tests.unit.stage_service.stage_fakes import (
    HERE,
    Harness,
    RecordingScheduler,
    chunk,
    done,
    emit_chunks,
    make_echo,
    payload,
    pipeline,
    running,
    until,
)


def emitter() -> RecordingScheduler:
    return RecordingScheduler(emit_chunks)


def streaming_with_next(**extra: object) -> PipelineConfig:
    """s streams to b and sends its result to t."""
    return pipeline(
        {"name": "s", "next": ["t"], "stream_to": ["b"], **extra},
        {"name": "t", "terminal": True},
        {"name": "b", "terminal": True},
    )


def terminal_streaming(**extra: object) -> PipelineConfig:
    """s is terminal (its result goes to the reporter) and streams to b."""
    return pipeline(
        {"name": "s", "terminal": True, "stream_to": ["b"], **extra},
        {"name": "b", "terminal": True},
    )


async def submit(h: Harness, rid: str, **spec: object) -> None:
    await h.send(payload(rid, spec, to="s"))


def chunks_to(h: Harness, to: str, rid: str) -> list[tuple[int, bool, object]]:
    return [(cid, is_done, v) for _, cid, is_done, v in h.router.streamed(to, rid)]


async def test_chunks_get_ids_per_request_then_done_after_result() -> None:
    async with running(streaming_with_next(), "s", emitter()) as h:
        await submit(h, "r1", n=3, modality="text")
        await submit(h, "r2", n=2)
        await until(lambda: len(h.router.results("t")) == 2, "both results")
        assert h.router.results("t") == {"r1": "fin", "r2": "fin"}
        for rid, n in (("r1", 3), ("r2", 2)):
            assert chunks_to(h, "b", rid) == [
                *((i, False, f"{rid}/{i}") for i in range(n)),
                (n, True, None),
            ]
        items = [(i, handle) for i, handle in h.router.delivered if i.HasField("stream")]
        assert {i.from_stage for i, _ in items} == {"s"}
        # Chunks hold credit until acked; the done signal holds none.
        assert [handle is None for i, handle in items] == [i.stream.done for i, _ in items]
        assert [i.stream.modality for i, _ in items if i.request_id == "r1"][:3] == ["text"] * 3
        assert h.reporter.fails == []
        assert h.stage.inflight == 0


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("t", "the scheduler streamed to 't', which is not in stream_to ['b']"),
        (CLIENT, "only terminal stages stream to the client"),
    ],
    ids=["not_in_stream_to", "client_from_non_terminal"],
)
async def test_stream_to_bad_target_fails_request(target: str, message: str) -> None:
    async with running(streaming_with_next(), "s", emitter()) as h:
        await submit(h, "bad", n=2, target=target)
        await submit(h, "ok", n=2)
        await until(lambda: "ok" in h.router.results("t"), "ok's result")
        (err,) = h.reporter.failures("bad")
        assert (err.code, err.stage, err.message) == (Code.INTERNAL, "s", message)
        assert [i.request_id for i, _ in h.router.delivered if i.request_id == "bad"] == []
        assert chunks_to(h, "b", "ok") == [(0, False, "ok/0"), (1, False, "ok/1"), (2, True, None)]
        assert h.reporter.failures("ok") == []
        # Dropped chunks count as sent, so the scheduler's outbox does not fill up.
        assert h.scheduler.outbox.unsent() == 0


async def test_terminal_stage_without_stream_to_streams_to_client() -> None:
    cfg = pipeline(
        {"name": "a", "terminal": True, "stream_to": ["b"]},
        {"name": "b", "terminal": True, "factory": f"{HERE}:make_echo"},
    )
    async with running(cfg, "b", make_echo()) as h:
        await h.send(chunk("r1", 0, "x0"), chunk("r2", 0, "y0"), chunk("r1", 1, "x1"))
        await h.send(done("r1", 2), chunk("r2", 1, "y1"), done("r2", 2))
        await until(lambda: h.reporter.done("r1") and h.reporter.done("r2"), "both results")
        assert h.reporter.result("r1") == h.reporter.result("r2") == {"chunks": 2, "windows": 2}
        for rid, prefix in (("r1", "x"), ("r2", "y")):
            got = [(cid, mod, v) for r, cid, mod, v in h.reporter.chunks if r == rid]
            assert got == [(0, "audio", f"{prefix}0"), (1, "audio", f"{prefix}1")]
        assert h.router.delivered == []
        await until(lambda: len(h.acks) == 6, "every ack")
        assert all(err is None for _, err in h.acks)


async def test_stream_done_to_fn_limits_done_targets() -> None:
    cfg = pipeline(
        {
            "name": "s",
            "terminal": True,
            "stream_to": ["b", "c"],
            "stream_done_to_fn": f"{HERE}:done_to_b",
        },
        {"name": "b", "terminal": True},
        {"name": "c", "terminal": True},
    )
    async with running(cfg, "s", emitter()) as h:
        await submit(h, "r", n=2)
        await until(lambda: h.reporter.done("r"), "the result")
        sent = [(0, False, "r/0"), (1, False, "r/1")]
        assert chunks_to(h, "b", "r") == [*sent, (2, True, None)]
        assert chunks_to(h, "c", "r") == sent
        # c gets no done, and nothing of the request's streams stays open on the sender.
        assert h.stage._streams.streamed_to("r") == []


async def test_edge_credit_holds_chunks_until_released() -> None:
    cfg = terminal_streaming(stream={"credits": 2, "request_credits": 2})
    async with running(cfg, "s", emitter()) as h:
        await submit(h, "r", n=5)
        # The result does not wait for stream credit; the done signal queues behind.
        await until(lambda: h.reporter.done("r"), "the result")
        assert chunks_to(h, "b", "r") == [(0, False, "r/0"), (1, False, "r/1")]
        for released in range(3):
            h.router.delivered[released][1].release()
            sent = [c for c, is_done, _ in chunks_to(h, "b", "r") if not is_done]
            assert sent == list(range(released + 3))  # each release lets one more go
        assert chunks_to(h, "b", "r")[2:] == [
            (2, False, "r/2"),
            (3, False, "r/3"),
            (4, False, "r/4"),
            (5, True, None),
        ]
        assert h.scheduler.outbox.unsent() == 0


async def test_request_credit_serves_requests_round_robin() -> None:
    cfg = terminal_streaming(stream={"credits": 2, "request_credits": 1})
    async with running(cfg, "s", emitter()) as h:
        await submit(h, "r1", n=3)
        await submit(h, "r2", n=3)
        await until(lambda: h.reporter.done("r1") and h.reporter.done("r2"), "both results")

        def order() -> list[tuple[str, int, bool]]:
            return [(rid, cid, is_done) for rid, cid, is_done, _ in h.router.streamed("b")]

        assert order() == [("r1", 0, False), ("r2", 0, False)]
        for released in range(6):
            # Oldest outstanding chunk first, as a receiver that takes in order would ack.
            [hd for _, hd in h.router.delivered if hd is not None][released].release()
        assert order() == [
            ("r1", 0, False),
            ("r2", 0, False),
            ("r1", 1, False),
            ("r2", 1, False),
            ("r1", 2, False),
            ("r1", 3, True),
            ("r2", 2, False),
            ("r2", 3, True),
        ]
