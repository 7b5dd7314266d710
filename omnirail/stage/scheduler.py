"""Scheduler surface shared by every scheduler, and `SimpleScheduler`.

The stage talks to a scheduler only through `inbox`, `outbox`, `start()`, `stop()` and
`abort(request_id)`; it never branches on the scheduler's type. Compute runs on the
scheduler's own thread so the stage's event loop keeps doing IO meanwhile.
"""

from __future__ import annotations

import abc
import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from omnirail.stage.conversations import ConversationFigures
from omnirail.telemetry.logs import request_context

log = logging.getLogger(__name__)

# How long stopping a scheduler waits for the computation its thread still runs.
STOP_WAIT_S = 5.0

# OutgoingMessage.target for chunks meant for the client (not a valid stage name).
CLIENT = "@client"


@dataclass(slots=True)
class IncomingMessage:
    """Work for a scheduler.

    `new_request`: `data` is the request's input payload (None for a stage fed only by
    streams). `stream_chunk`: `data` is one chunk from stage `source`, numbered `chunk_id`
    per (request, edge) from 0. `stream_done`: every stream into this stage for the
    request has ended (sent once, after the request's last chunk). `abort`: a scheduler
    that keeps per-request state puts this in its own inbox from `abort()`, so an idle
    compute thread wakes and drops it (others never see one).
    """

    request_id: str
    type: Literal["new_request", "stream_chunk", "stream_done", "abort"]
    data: Any
    source: str = ""
    chunk_id: int = -1
    # Run on the stage's loop once the scheduler has taken the message (returns the
    # sender's stream credit); schedulers never call it themselves.
    on_taken: Callable[[], None] | None = None
    # When a scheduler took it (unix ns; set by `Inbox.get`): the end of its queue wait.
    taken_ns: int = 0
    # The request's W3C traceparent: schedulers tag the logs of its compute with it.
    traceparent: str = ""
    # The conversation the request is a turn of ("" for none; on `new_request`): a
    # scheduler that keeps state across turns keys it by this (`ConversationStore`).
    conversation: str = ""


@dataclass(slots=True)
class OutgoingMessage:
    """Output of a scheduler.

    `result`: the request's final output at this stage. `stream`: one chunk, sent to
    `target`: a stage in `stream_to`, `CLIENT` (terminal stages only), or None: every
    `stream_to` target, or the client when the stage is terminal without `stream_to`.
    `metadata["modality"]` labels chunks for clients. `error`: `data` is the exception.
    """

    request_id: str
    type: Literal["result", "stream", "error"]
    data: Any
    target: str | None = None
    metadata: dict[str, Any] | None = None
    # When the scheduler emitted it (unix ns; set by `Outbox.put_many`).
    created_ns: int = 0


class Inbox:
    """The scheduler's input queue (the `queue.SimpleQueue` calls schedulers use).

    Messages with `on_taken` are reported to the stage's loop when a scheduler takes them,
    so stream credit goes back to the producer only as fast as this stage consumes. A
    scheduler that keeps chunks for later sets `defer_taken` and calls `taken(msg)` once it
    has used each one, so its producer slows down to its pace.
    """

    defer_taken = False

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[IncomingMessage | None] = queue.SimpleQueue()
        self._taken: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._wake_pending = False
        self._waker: Callable[[], None] | None = None

    def bind(self, waker: Callable[[], None]) -> None:
        """`waker` is called (from any thread) once per burst of taken messages."""
        self._waker = waker

    def put(self, msg: IncomingMessage | None) -> None:
        self._queue.put(msg)

    def get(self, block: bool = True, timeout: float | None = None) -> IncomingMessage | None:
        msg = self._queue.get(block, timeout)
        if msg is not None:
            msg.taken_ns = time.time_ns()
            if msg.on_taken is not None and not self.defer_taken:
                self._note_taken(msg.on_taken)
        return msg

    def taken(self, msg: IncomingMessage) -> None:
        """Returns `msg`'s credit (with `defer_taken`; any thread, once per message)."""
        if msg.on_taken is not None:
            self._note_taken(msg.on_taken)

    def get_nowait(self) -> IncomingMessage | None:
        return self.get(False)

    def qsize(self) -> int:
        return self._queue.qsize()

    def empty(self) -> bool:
        return self._queue.empty()

    def _note_taken(self, callback: Callable[[], None]) -> None:
        with self._lock:
            self._taken.append(callback)
            if self._wake_pending or self._waker is None:
                return
            self._wake_pending = True
        self._waker()

    def drain_taken(self) -> list[Callable[[], None]]:
        """The `on_taken` callbacks of messages taken since the last call (stage loop)."""
        with self._lock:
            self._wake_pending = False
            taken, self._taken = self._taken, []
        return taken


class Outbox:
    """Thread-safe queue that wakes the consumer's event loop once per burst.

    Producers (scheduler threads) call `put` / `put_many`; the stage binds a waker that
    schedules one drain on its loop. Waking once per burst, not per message, keeps
    cross-thread calls rare when a batch produces many results at once.

    Stream chunks are bounded: the stage reports with `sent` when chunks have left it, and
    `put` of a chunk blocks while `stream_limit` chunks are still unsent, so a slow
    consumer slows its producer instead of growing memory. `unsent(request_id)` lets a
    batching scheduler hold back just the requests whose streams are backed up.
    """

    def __init__(self, stream_limit: int = 256) -> None:
        self._items: deque[OutgoingMessage] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._wake_pending = False
        self._waker: Callable[[], None] | None = None
        self._stream_limit = stream_limit
        self._unsent = 0
        self._unsent_by_request: dict[str, int] = {}
        self._closed = False

    def bind(self, waker: Callable[[], None]) -> None:
        self._waker = waker

    def set_stream_limit(self, limit: int) -> None:
        with self._cond:
            self._stream_limit = max(1, limit)
            self._cond.notify_all()

    def put(self, msg: OutgoingMessage) -> None:
        self.put_many((msg,))

    def put_many(self, msgs: Iterable[OutgoingMessage]) -> None:
        """Queues `msgs` together: the stage drains them in one pass (one write per peer)."""
        msgs = list(msgs)
        if not msgs:
            return
        now = time.time_ns()
        for m in msgs:
            m.created_ns = now
        streams = [m.request_id for m in msgs if m.type == "stream"]
        with self._cond:
            if streams:
                while self._unsent >= self._stream_limit and not self._closed:
                    self._cond.wait()
                self._unsent += len(streams)
                for rid in streams:
                    self._unsent_by_request[rid] = self._unsent_by_request.get(rid, 0) + 1
            self._items.extend(msgs)
            if self._wake_pending or self._waker is None:
                return
            self._wake_pending = True
        self._waker()

    def drain(self) -> list[OutgoingMessage]:
        with self._cond:
            self._wake_pending = False
            items = list(self._items)
            self._items.clear()
        return items

    def sent(self, request_id: str, n: int = 1) -> None:
        """`n` stream chunks of `request_id` left the stage (or were dropped)."""
        with self._cond:
            left = self._unsent_by_request.get(request_id, 0) - n
            if left > 0:
                self._unsent_by_request[request_id] = left
            else:
                self._unsent_by_request.pop(request_id, None)
            self._unsent = max(0, self._unsent - n)
            self._cond.notify_all()

    def unsent(self, request_id: str | None = None) -> int:
        """Stream chunks put but not yet sent on: all, or those of one request."""
        if request_id is None:
            return self._unsent
        return self._unsent_by_request.get(request_id, 0)

    def close(self) -> None:
        """Unblocks producers for good (the stage is stopping)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __len__(self) -> int:
        return len(self._items)


class AbortSet:
    """Bounded record of aborted request ids (checked by scheduler threads)."""

    def __init__(self, capacity: int = 65536) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def add(self, request_id: str) -> None:
        with self._lock:
            self._ids[request_id] = None
            while len(self._ids) > self._capacity:
                self._ids.popitem(last=False)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._ids


@dataclass(slots=True, frozen=True)
class EngineFigures:
    """A serving engine's own counts (`Scheduler.figures`), exported as the stage's
    `omnirail_engine_*` metrics: requests running and waiting in the engine, the share of KV
    cache blocks in use (0..1), and prompt tokens looked up in / found in the prefix cache."""

    running: int
    waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class Scheduler(abc.ABC):
    """The surface the stage uses. Subclasses own their compute thread(s)."""

    # Whether stream chunks may be fed to it (a stage named in some `stream_to` needs it).
    takes_streams = True

    def __init__(self) -> None:
        self.inbox = Inbox()
        self.outbox = Outbox()
        self.aborted = AbortSet()

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def stop(self) -> None: ...

    def stop_within(self, seconds: float) -> None:
        """Stops, waiting at most about `seconds` for a compute still running (a process
        about to exit, whose compute can only be for requests it no longer holds).
        Schedulers whose `stop` may block override it; this one just stops."""
        self.stop()

    def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)

    @property
    def queue_depth(self) -> int:
        return self.inbox.qsize()

    @property
    def held_requests(self) -> int:
        """Requests whose state this scheduler keeps (KV caches, stream windows): none for
        one that computes each request in one call. Read from another thread, at scrapes:
        a moment's count, for audits after the mesh is idle."""
        return 0

    def figures(self) -> EngineFigures | None:
        """A serving engine's own counts (None: no engine). Read from another thread, at
        scrapes."""
        return None

    def conversations(self) -> ConversationFigures | None:
        """The counts of the state this scheduler keeps across conversations' turns (None:
        it keeps none). Read from another thread, at scrapes."""
        return None

    def close_conversation(self, conversation_id: str) -> None:
        """The client closed the conversation: drop what is kept of it (called from the
        stage's event loop thread; a scheduler that keeps none ignores it)."""
        return None


class ThreadScheduler(Scheduler):
    """A scheduler whose compute runs on one thread: `_run` until it takes `None`."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"scheduler-{self._name}", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        self.stop_within(STOP_WAIT_S)

    def stop_within(self, seconds: float) -> None:
        if self._thread is not None:
            self.inbox.put(None)
            self._thread.join(timeout=seconds)
            if self._thread.is_alive():
                log.warning(
                    "scheduler %s: still computing after %gs; not waiting", self._name, seconds
                )
            self._thread = None

    @abc.abstractmethod
    def _run(self) -> None: ...


class SimpleScheduler(ThreadScheduler):
    """`fn(payload) -> result` per request, or `batch_fn(payloads) -> results`.

    With `batch_fn`, up to `max_batch_size` waiting requests are computed together; the
    thread waits at most `max_wait_ms` for a batch to fill once the first one arrived.
    """

    takes_streams = False

    def __init__(
        self,
        fn: Callable[[Any], Any] | None = None,
        *,
        batch_fn: Callable[[list[Any]], list[Any]] | None = None,
        max_batch_size: int = 8,
        max_wait_ms: float = 0.0,
        name: str = "simple",
    ) -> None:
        super().__init__(name)
        if (fn is None) == (batch_fn is None):
            raise ValueError("SimpleScheduler needs exactly one of fn or batch_fn")
        if max_batch_size < 1 or max_wait_ms < 0:
            raise ValueError("max_batch_size must be >= 1 and max_wait_ms >= 0")
        self._fn = fn
        self._batch_fn = batch_fn
        self._max_batch = max_batch_size if batch_fn else 1
        self._max_wait_s = max_wait_ms / 1000.0

    def _next_batch(self) -> list[IncomingMessage] | None:
        first = self.inbox.get()
        if first is None:
            return None
        batch = [first]
        deadline = time.monotonic() + self._max_wait_s
        while len(batch) < self._max_batch:
            try:
                remaining = deadline - time.monotonic()
                msg = (
                    self.inbox.get_nowait() if remaining <= 0 else self.inbox.get(timeout=remaining)
                )
            except queue.Empty:
                break
            if msg is None:
                self.inbox.put(None)  # let the loop see the stop after this batch
                break
            batch.append(msg)
        return batch

    def _run(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            for msg in batch:
                if msg.type != "new_request" and msg.request_id not in self.aborted:
                    # fn takes whole payloads; feeding it chunks would compute garbage.
                    # Recording the request as aborted keeps its later chunks (and a
                    # new_request in the same batch) from producing more output.
                    self.aborted.add(msg.request_id)
                    err = TypeError(
                        f"stage scheduler {type(self).__name__} does not take stream input; "
                        "use StreamingScheduler or ARScheduler"
                    )
                    self.outbox.put(OutgoingMessage(msg.request_id, "error", err))
            live = [m for m in batch if m.request_id not in self.aborted]
            if not live:
                continue
            if self._batch_fn is not None:
                self._compute_batch(live)
            else:
                for msg in live:
                    self._compute_one(msg)

    def _compute_one(self, msg: IncomingMessage) -> None:
        assert self._fn is not None
        try:
            with request_context(msg.request_id, msg.traceparent):
                result = self._fn(msg.data)
        except Exception as exc:  # a failing request must not stop the scheduler
            if msg.request_id not in self.aborted:
                self.outbox.put(OutgoingMessage(msg.request_id, "error", exc))
            return
        if msg.request_id not in self.aborted:
            self.outbox.put(OutgoingMessage(msg.request_id, "result", result))

    def _compute_batch(self, batch: list[IncomingMessage]) -> None:
        assert self._batch_fn is not None
        try:
            results = self._batch_fn([m.data for m in batch])
            if not isinstance(results, (list, tuple)) or len(results) != len(batch):
                raise TypeError(
                    f"batch_fn returned {type(results).__name__} of "
                    f"{len(results) if hasattr(results, '__len__') else '?'} results "
                    f"for {len(batch)} requests"
                )
        except Exception as exc:
            for msg in batch:
                self.outbox.put(OutgoingMessage(msg.request_id, "error", exc))
            return
        for msg, result in zip(batch, results, strict=True):
            if msg.request_id not in self.aborted:
                self.outbox.put(OutgoingMessage(msg.request_id, "result", result))
