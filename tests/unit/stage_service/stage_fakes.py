"""Fakes and builders for the in-process `Stage` stream tests.

A recording Router and Reporter stand in for the host and the Attach stream; a
`RecordingScheduler` logs every message it takes and can be gated so a test decides when
messages leave the inbox (chunk acks hang on that). The factories and hooks here are
referenced by dotted path from the test pipelines.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest

from omnirail.config import PipelineConfig
from omnirail.relay.base import RelaySettings, create_relay
from omnirail.stage.scheduler import (
    IncomingMessage,
    OutgoingMessage,
    Scheduler,
    SimpleScheduler,
)
from omnirail.stage.streaming import StreamingScheduler, StreamState
from omnirail.stage_service.edges import EdgeRelays
from omnirail.stage_service.stage import Stage
from omnirail.v1 import common_pb2, mesh_pb2
from omnirail.wire.errors import OmniError
from omnirail.wire.payload import decode_inline, encode_inline

HERE = "tests.unit.stage_service.stage_fakes"
TIMEOUT = 5.0  # generous: only reached when something is broken
TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


# ---- fakes ---------------------------------------------------------------------------


class FakeRouter:
    def __init__(self, pipeline: PipelineConfig) -> None:
        self._pipeline = pipeline
        # The handle is a ChunkCredit for stream chunks, None for signals and inline results.
        self.delivered: list[tuple[mesh_pb2.DeliverItem, Any]] = []

    def deliver(self, item: mesh_pb2.DeliverItem, handle: Any) -> None:
        self.delivered.append((item, handle))

    def possible_stages(self, terminals: tuple[str, ...]) -> frozenset[str]:
        return frozenset(self._pipeline.possible_stages_for(terminals))

    def streamed(self, to: str, rid: str | None = None) -> list[tuple[str, int, bool, Any]]:
        """(request, chunk_id, done, value) of the stream items sent to `to`, in order."""
        return [
            (
                i.request_id,
                i.stream.chunk_id,
                i.stream.done,
                decode_inline(i.payload) if i.HasField("payload") else None,
            )
            for i, _ in self.delivered
            if i.to_stage == to and i.HasField("stream") and rid in (None, i.request_id)
        ]

    def results(self, to: str) -> dict[str, Any]:
        """Plain (non-stream) payloads sent to `to`, by request."""
        return {
            i.request_id: decode_inline(i.payload)
            for i, _ in self.delivered
            if i.to_stage == to and not i.HasField("stream")
        }


class FakeReporter:
    def __init__(self) -> None:
        self.completes: list[tuple[str, Any, str]] = []
        self.chunks: list[tuple[str, int, str, Any]] = []
        self.fails: list[tuple[str, OmniError]] = []

    def complete(self, request_id: str, output: common_pb2.Payload, traceparent: str) -> None:
        self.completes.append((request_id, decode_inline(output), traceparent))

    def chunk(
        self, request_id: str, chunk_id: int, modality: str, data: common_pb2.Payload
    ) -> None:
        self.chunks.append((request_id, chunk_id, modality, decode_inline(data)))

    def fail(self, request_id: str, error: OmniError) -> None:
        self.fails.append((request_id, error))

    def done(self, rid: str) -> bool:
        return any(r == rid for r, _, _ in self.completes)

    def result(self, rid: str) -> Any:
        (value,) = [v for r, v, _ in self.completes if r == rid]
        return value

    def failures(self, rid: str) -> list[OmniError]:
        return [e for r, e in self.fails if r == rid]


Handler = Callable[["RecordingScheduler", IncomingMessage], list[OutgoingMessage]]


class RecordingScheduler(Scheduler):
    """Logs every message it takes; `handler` decides what it emits for each.

    Gated, it takes one message per `admit`, so a test controls exactly which messages
    have left the inbox.
    """

    def __init__(self, handler: Handler | None = None, *, gated: bool = False) -> None:
        super().__init__()
        self.taken: list[IncomingMessage] = []
        self.aborts: list[str] = []
        self._handler = handler or echo_on_done
        self._gate = threading.Semaphore(0) if gated else None
        self._stopping = False
        self._thread: threading.Thread | None = None

    def admit(self, n: int = 1) -> None:
        assert self._gate is not None
        self._gate.release(n)

    def of(self, rid: str) -> list[tuple[str, Any, str, int]]:
        return [
            (m.type, m.data, m.source, m.chunk_id) for m in list(self.taken) if m.request_id == rid
        ]

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="stagetest", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stopping = True
        self.inbox.put(None)
        if self._gate is not None:
            self._gate.release()  # set after _stopping, so the thread cannot block again
        self._thread.join(timeout=TIMEOUT)
        self._thread = None

    def abort(self, request_id: str) -> None:
        super().abort(request_id)
        self.aborts.append(request_id)

    def _run(self) -> None:
        while True:
            if self._gate is not None and not self._stopping:
                self._gate.acquire()
            msg = self.inbox.get()
            if msg is None:
                return
            self.taken.append(msg)
            if msg.request_id not in self.aborted:
                out = self._handler(self, msg)
                if out:
                    self.outbox.put_many(out)


def echo_on_done(sched: RecordingScheduler, msg: IncomingMessage) -> list[OutgoingMessage]:
    """Ends a request on stream_done with what it got: its payload and its chunks."""
    if msg.type != "stream_done":
        return []
    got = sched.of(msg.request_id)
    data = next((d for t, d, _, _ in got if t == "new_request"), None)
    chunks = [d for t, d, _, _ in got if t == "stream_chunk"]
    return [OutgoingMessage(msg.request_id, "result", {"data": data, "chunks": chunks})]


def emit_chunks(sched: RecordingScheduler, msg: IncomingMessage) -> list[OutgoingMessage]:
    """For a payload {"n", "target"?, "modality"?}: n stream chunks "rid/i", then a result."""
    if msg.type != "new_request":
        return []
    rid, spec = msg.request_id, msg.data
    meta = {"modality": spec["modality"]} if "modality" in spec else None
    out = [
        OutgoingMessage(rid, "stream", f"{rid}/{i}", spec.get("target"), meta)
        for i in range(spec["n"])
    ]
    out.append(OutgoingMessage(rid, "result", "fin"))
    return out


# ---- dotted targets ------------------------------------------------------------------


def make_recorder() -> RecordingScheduler:
    return RecordingScheduler()


def _identity(value: Any) -> Any:
    return value


def make_plain() -> Callable[[Any], Any]:
    return _identity


def make_simple() -> SimpleScheduler:
    return SimpleScheduler(_identity)


def _echo_window(state: StreamState, chunks: list[Any], final: bool) -> Any:
    return chunks[0]


def make_echo() -> StreamingScheduler:
    return StreamingScheduler(_echo_window, window=1, metadata={"modality": "audio"})


def done_to_b(request_id: str, output: Any) -> list[str]:
    return ["b"]


# ---- builders ------------------------------------------------------------------------


def pipeline(*stages: dict[str, Any]) -> PipelineConfig:
    """Stages default to the recorder factory (the Stage never calls it; validation does
    resolve it)."""
    filled = [{"factory": f"{HERE}:make_recorder", **s} for s in stages]
    return PipelineConfig.from_dict({"stages": filled, "relay": {"backend": "inline"}})


def chunk(rid: str, cid: int, value: Any, *, src: str = "a", to: str = "b") -> mesh_pb2.DeliverItem:
    return mesh_pb2.DeliverItem(
        request_id=rid,
        from_stage=src,
        to_stage=to,
        payload=encode_inline(value),
        traceparent=TRACE,
        stream=mesh_pb2.StreamSignal(chunk_id=cid),
    )


def done(rid: str, count: int, *, src: str = "a", to: str = "b") -> mesh_pb2.DeliverItem:
    signal = mesh_pb2.StreamSignal(chunk_id=count, done=True)
    return mesh_pb2.DeliverItem(
        request_id=rid, from_stage=src, to_stage=to, traceparent=TRACE, stream=signal
    )


def stream_error(
    rid: str, error: OmniError, *, src: str = "a", to: str = "b"
) -> mesh_pb2.DeliverItem:
    signal = mesh_pb2.StreamSignal(error=error.to_proto())
    return mesh_pb2.DeliverItem(
        request_id=rid, from_stage=src, to_stage=to, traceparent=TRACE, stream=signal
    )


def payload(rid: str, value: Any, *, src: str = "", to: str = "b") -> mesh_pb2.DeliverItem:
    return mesh_pb2.DeliverItem(
        request_id=rid,
        from_stage=src,
        to_stage=to,
        payload=encode_inline(value),
        traceparent=TRACE,
    )


def item_key(item: mesh_pb2.DeliverItem) -> str:
    """Names an item in `Harness.acks` as rid:source:what (what: chunk id, done, ...)."""
    head = f"{item.request_id}:{item.from_stage or 'coordinator'}"
    if not item.HasField("stream"):
        return f"{head}:payload"
    if item.stream.HasField("error"):
        return f"{head}:error"
    return f"{head}:done" if item.stream.done else f"{head}:{item.stream.chunk_id}"


# ---- running a stage -----------------------------------------------------------------


@dataclass
class Harness:
    stage: Stage
    scheduler: Any
    router: FakeRouter
    reporter: FakeReporter
    acks: list[tuple[str, OmniError | None]] = field(default_factory=list)

    async def send(self, *items: mesh_pb2.DeliverItem) -> None:
        for item in items:
            key = item_key(item)
            await self.stage.on_item(item, lambda err, key=key: self.acks.append((key, err)))

    def acked(self, key: str) -> list[OmniError | None]:
        return [err for k, err in self.acks if k == key]


@asynccontextmanager
async def running(cfg: PipelineConfig, name: str, scheduler: Scheduler) -> AsyncIterator[Harness]:
    relay = create_relay("inline", RelaySettings(name_prefix="stagetest"))
    router, reporter = FakeRouter(cfg), FakeReporter()
    edges = EdgeRelays(name, relay, cfg.relay_for(name).inline_bytes)
    stage = Stage(name, cfg, scheduler, edges, {relay.name: relay}, router, reporter)
    stage.start()
    try:
        yield Harness(stage, scheduler, router, reporter)
    finally:
        await stage.stop()
        relay.close()


async def until(cond: Callable[[], bool], what: str, timeout: float = TIMEOUT) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.005)
