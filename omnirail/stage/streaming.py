"""`StreamingScheduler`: per-request state over incoming streams, computed in windows.

For stages that consume a stream and produce one (e.g. a vocoder turning codec frames into
audio): chunks are buffered per request and handed to `window_fn` every `window` chunks,
advancing by `hop`. With `hop < window` consecutive windows overlap, which is what models
that need left context (or cross-fading between windows) want.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omnirail.stage.scheduler import IncomingMessage, OutgoingMessage, ThreadScheduler
from omnirail.telemetry.logs import request_context


@dataclass(slots=True, eq=False)
class StreamState:
    """One request's state while its input streams run.

    `user` is scratch space for the hooks (model caches, decoder state). `pending` holds
    the chunks not yet dropped by a hop; `uncovered` counts those no window has seen yet,
    so the final flush runs only when there is something new to compute.
    """

    request_id: str
    data: Any
    chunks_in: int = 0
    windows: int = 0
    user: dict[str, Any] = field(default_factory=dict)
    pending: list[Any] = field(default_factory=list)
    uncovered: int = 0


StartFn = Callable[[StreamState], None]
WindowFn = Callable[[StreamState, list[Any], bool], Any]
FinishFn = Callable[[StreamState], Any]


class StreamingScheduler(ThreadScheduler):
    """Calls `window_fn(state, chunks, final)` on sliding windows of each request's stream.

    Every `window` buffered chunks trigger a call, then the first `hop` chunks are dropped
    (`hop` defaults to `window`: no overlap). On `stream_done` the chunks that arrived since
    the last window, with the overlap kept before them, are flushed with `final=True`. A
    non-None return is emitted as one stream chunk (to every stream destination, labelled
    with `metadata`). The request's result is `finish_fn(state)`, or by default
    `{"chunks": chunks_in, "windows": windows}` so a caller can tell how much was consumed.

    Subclasses may override `new_request`, `process_window` and `finish` instead of
    passing functions, and call `emit` from them to send several chunks per window.
    """

    def __init__(
        self,
        window_fn: WindowFn | None = None,
        *,
        window: int = 1,
        hop: int | None = None,
        start_fn: StartFn | None = None,
        finish_fn: FinishFn | None = None,
        metadata: dict[str, Any] | None = None,
        name: str = "streaming",
    ) -> None:
        super().__init__(name)
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        hop = window if hop is None else hop
        if not 1 <= hop <= window:
            raise ValueError(f"hop must be between 1 and window ({window}), got {hop}")
        overridden = type(self).process_window is not StreamingScheduler.process_window
        if window_fn is None and not overridden:
            raise ValueError("StreamingScheduler needs window_fn or a process_window override")
        self.window = window
        self.hop = hop
        self._window_fn = window_fn
        self._start_fn = start_fn
        self._finish_fn = finish_fn
        self._metadata = metadata
        self._states: dict[str, StreamState] = {}
        # Aborts come from other threads; the compute thread drops their state itself so
        # `_states` has a single writer.
        self._abort_queue: deque[str] = deque()
        self._out: list[OutgoingMessage] = []

    # ---- hooks (override in subclasses) ---------------------------------------------

    @property
    def held_requests(self) -> int:
        return len(self._states)

    def new_request(self, state: StreamState) -> None:
        """Called once per request before its first chunk (e.g. to allocate a cache)."""
        if self._start_fn is not None:
            self._start_fn(state)

    def process_window(self, state: StreamState, chunks: list[Any], final: bool) -> Any | None:
        """Computes one window; a non-None return is emitted as a stream chunk."""
        assert self._window_fn is not None  # checked in __init__
        return self._window_fn(state, chunks, final)

    def finish(self, state: StreamState) -> Any:
        """The request's result, after its last window."""
        if self._finish_fn is not None:
            return self._finish_fn(state)
        return {"chunks": state.chunks_in, "windows": state.windows}

    def emit(
        self,
        state: StreamState,
        data: Any,
        *,
        target: str | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        """Queues a stream chunk; call only from the hooks (the scheduler's thread).

        Chunks go out together when the current message is handled, and are dropped if
        the request fails or is aborted meanwhile.
        """
        self._out.append(OutgoingMessage(state.request_id, "stream", data, target, metadata))

    # ---- lifecycle ------------------------------------------------------------------

    def abort(self, request_id: str) -> None:
        super().abort(request_id)
        self._abort_queue.append(request_id)
        # Wakes the compute thread should it be idle: the request's state goes now, not
        # with the next request (an idle stage must hold nothing of ended requests).
        self.inbox.put(IncomingMessage(request_id, "abort", None))

    # ---- compute thread -------------------------------------------------------------

    def _run(self) -> None:
        while True:
            msg = self.inbox.get()
            if msg is None:
                self._states.clear()
                return
            while self._abort_queue:
                self._states.pop(self._abort_queue.popleft(), None)
            self._out = []
            try:
                with request_context(msg.request_id, msg.traceparent):
                    self._handle(msg)
            except Exception as exc:  # a failing request must not stop the scheduler
                self._states.pop(msg.request_id, None)
                self._out = [OutgoingMessage(msg.request_id, "error", exc)]
            out, self._out = self._out, []
            if out and msg.request_id not in self.aborted:
                self.outbox.put_many(out)

    def _handle(self, msg: IncomingMessage) -> None:
        rid = msg.request_id
        if rid in self.aborted:
            self._states.pop(rid, None)
            return
        if msg.type == "new_request":
            if rid in self._states:
                raise RuntimeError(f"request {rid!r} is already running at this stage")
            state = StreamState(rid, msg.data)
            self.new_request(state)
            self._states[rid] = state
            return
        state = self._states.get(rid)
        if state is None:  # finished, failed or aborted: late input is dropped
            return
        if msg.type == "stream_chunk":
            state.chunks_in += 1
            state.uncovered += 1
            state.pending.append(msg.data)
            if len(state.pending) >= self.window:
                self._compute(state, state.pending[: self.window], final=False)
                del state.pending[: self.hop]
        elif msg.type == "stream_done":
            # Flushing a tail made only of overlap the last window already saw would
            # compute (and emit) the same chunks twice.
            if state.uncovered:
                self._compute(state, list(state.pending), final=True)
            state.pending.clear()
            result = self.finish(state)
            del self._states[rid]
            self._out.append(OutgoingMessage(rid, "result", result))
        else:
            raise ValueError(f"unknown message type {msg.type!r}")

    def _compute(self, state: StreamState, chunks: list[Any], *, final: bool) -> None:
        value = self.process_window(state, chunks, final)
        state.windows += 1
        state.uncovered = 0
        if value is not None:
            self.emit(state, value, metadata=self._metadata)
