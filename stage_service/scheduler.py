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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

log = logging.getLogger(__name__)


@dataclass(slots=True)
class IncomingMessage:
    request_id: str
    type: Literal["new_request", "stream_chunk", "stream_done"]
    data: Any


@dataclass(slots=True)
class OutgoingMessage:
    request_id: str
    type: Literal["result", "stream", "error"]
    data: Any
    target: str | None = None
    metadata: dict[str, Any] | None = None


class Outbox:
    """Thread-safe queue that wakes the consumer's event loop once per burst.

    Producers (scheduler threads) call `put`; the stage binds a waker that schedules one
    drain on its loop. Waking once per burst, not per message, keeps cross-thread calls
    rare when a batch produces many results at once.
    """

    def __init__(self) -> None:
        self._items: deque[OutgoingMessage] = deque()
        self._lock = threading.Lock()
        self._wake_pending = False
        self._waker: Callable[[], None] | None = None

    def bind(self, waker: Callable[[], None]) -> None:
        self._waker = waker

    def put(self, msg: OutgoingMessage) -> None:
        with self._lock:
            self._items.append(msg)
            if self._wake_pending or self._waker is None:
                return
            self._wake_pending = True
        self._waker()

    def drain(self) -> list[OutgoingMessage]:
        with self._lock:
            self._wake_pending = False
            items = list(self._items)
            self._items.clear()
        return items

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


class Scheduler(abc.ABC):
    """The surface the stage uses. Subclasses own their compute thread(s)."""

    def __init__(self) -> None:
        self.inbox: queue.SimpleQueue[IncomingMessage | None] = queue.SimpleQueue()
        self.outbox = Outbox()
        self.aborted = AbortSet()

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def stop(self) -> None: ...

    def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)

    @property
    def queue_depth(self) -> int:
        return self.inbox.qsize()


class SimpleScheduler(Scheduler):
    """`fn(payload) -> result` per request, or `batch_fn(payloads) -> results`.

    With `batch_fn`, up to `max_batch_size` waiting requests are computed together; the
    thread waits at most `max_wait_ms` for a batch to fill once the first one arrived.
    """

    def __init__(
        self,
        fn: Callable[[Any], Any] | None = None,
        *,
        batch_fn: Callable[[list[Any]], list[Any]] | None = None,
        max_batch_size: int = 8,
        max_wait_ms: float = 0.0,
        name: str = "simple",
    ) -> None:
        super().__init__()
        if (fn is None) == (batch_fn is None):
            raise ValueError("SimpleScheduler needs exactly one of fn or batch_fn")
        if max_batch_size < 1 or max_wait_ms < 0:
            raise ValueError("max_batch_size must be >= 1 and max_wait_ms >= 0")
        self._fn = fn
        self._batch_fn = batch_fn
        self._max_batch = max_batch_size if batch_fn else 1
        self._max_wait_s = max_wait_ms / 1000.0
        self._name = name
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"scheduler-{self._name}", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self.inbox.put(None)
            self._thread.join(timeout=5)
            self._thread = None

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
