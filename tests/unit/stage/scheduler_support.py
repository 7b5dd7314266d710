"""What the scheduler tests share: an outbox collector and message builders.

Tests synchronise on the outbox's waker and on events, never on sleeps or timings.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from omnirail.stage.scheduler import IncomingMessage, Outbox, OutgoingMessage

TIMEOUT = 30.0  # generous: only reached when something is broken


class Collector:
    """Drains an outbox from the test thread, woken by the outbox's waker."""

    def __init__(self, outbox: Outbox) -> None:
        self._outbox = outbox
        self._woken = threading.Event()
        self.items: list[OutgoingMessage] = []
        outbox.bind(self._woken.set)

    def until(self, done: Callable[[list[OutgoingMessage]], bool]) -> list[OutgoingMessage]:
        while not done(self.items):
            assert self._woken.wait(TIMEOUT), f"timed out; collected so far: {self.items}"
            self._woken.clear()
            self.items.extend(self._outbox.drain())
        return self.items

    def count(self, n: int) -> list[OutgoingMessage]:
        return self.until(lambda items: len(items) >= n)

    def result_for(self, request_id: str) -> list[OutgoingMessage]:
        """Everything collected once any message of `request_id` has come."""
        return self.until(lambda items: any(m.request_id == request_id for m in items))

    def final_for(self, rid: str) -> OutgoingMessage:
        """The request's result or error (waiting for it)."""
        ends = ("result", "error")
        self.until(lambda items: any(m.request_id == rid and m.type in ends for m in items))
        return next(m for m in self.items if m.request_id == rid and m.type in ends)

    def of(self, rid: str) -> list[tuple[str, Any]]:
        return [(m.type, m.data) for m in self.items if m.request_id == rid]


def new(rid: str, data: Any = None) -> IncomingMessage:
    return IncomingMessage(rid, "new_request", data)
