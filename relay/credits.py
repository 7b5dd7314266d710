"""Per-edge credits: outstanding transfers and bytes, with FIFO waiters.

A full edge blocks the sender (backpressure) instead of growing queues. A payload larger
than the byte credit still goes once the edge is empty, so nothing is rejected for size.

The one credit implementation: the relays count their transfers with it, and a stage's
stream edges count their chunks (`omnirail.stage_service.edge_sender`). Streams also bound
one request's share of an edge (`request_slots`), so a long stream cannot starve the
others; they take credit with `try_take(edge, nbytes, request_id)`, which never queues, and
keep their own per-request queues, served round-robin when credit comes back.
"""

from __future__ import annotations

import asyncio
import sys
from collections import deque
from collections.abc import Callable

from omnirail.relay.base import RelayError


class EdgeCredit:
    """Credits of one edge: what it holds, and its bounds (`Credits.limit`)."""

    __slots__ = (
        "by_request",
        "max_bytes",
        "max_request",
        "max_slots",
        "nbytes",
        "slots",
        "waiters",
    )

    def __init__(
        self, max_slots: int = 64, max_bytes: int = 1 << 30, max_request: int = sys.maxsize
    ) -> None:
        self.slots = 0
        self.nbytes = 0
        self.max_slots = max_slots
        self.max_bytes = max_bytes
        self.waiters: deque[tuple[int, asyncio.Future[None]]] = deque()
        # Slots taken with a request id, per request, and the most one request may hold.
        self.by_request: dict[str, int] = {}
        self.max_request = max_request


class Credits:
    """Every edge's credits; `slots` and `nbytes` bound an edge that `limit` did not.

    `request_slots` bounds the slots one request may hold on an edge (None: no bound); it
    counts only what `try_take` took with a request id.
    """

    def __init__(self, slots: int, nbytes: int, request_slots: int | None = None) -> None:
        self.max_slots = slots
        self.max_bytes = nbytes
        self.max_request = sys.maxsize if request_slots is None else request_slots
        self.edges: dict[str, EdgeCredit] = {}

    def edge(self, name: str) -> EdgeCredit:
        credit = self.edges.get(name)
        if credit is None:
            credit = self.edges[name] = EdgeCredit(self.max_slots, self.max_bytes, self.max_request)
        return credit

    def limit(self, name: str, slots: int, nbytes: int) -> None:
        """Bounds edge `name` to `slots` transfers and `nbytes` bytes (its own config)."""
        if slots < 1 or nbytes < 1:
            raise ValueError(f"edge {name!r}: credits must be >= 1 (got {slots}, {nbytes})")
        credit = self.edge(name)
        credit.max_slots, credit.max_bytes = slots, nbytes
        self.wake(credit)  # a raised bound may admit who waits

    def admits(self, edge: EdgeCredit, nbytes: int) -> bool:
        if edge.slots == 0:
            return True  # an oversize payload still goes once the edge is empty
        return edge.slots < edge.max_slots and edge.nbytes + nbytes <= edge.max_bytes

    def try_take(self, edge: EdgeCredit, nbytes: int, request_id: str | None = None) -> bool:
        """Takes credit now if no one queues before us and it fits.

        With `request_id` it must also fit that request's share (`request_slots`), and it
        counts there until `give_back` with the same id. Never queues: a caller that keeps
        its own waiting items tries again once credit comes back.
        """
        if edge.waiters or not self.admits(edge, nbytes):
            return False
        if request_id is not None:
            held = edge.by_request.get(request_id, 0)
            if held >= edge.max_request:
                return False
            edge.by_request[request_id] = held + 1
        edge.slots += 1
        edge.nbytes += nbytes
        return True

    async def take(
        self, edge: EdgeCredit, nbytes: int, on_wait: Callable[[], None] | None = None
    ) -> None:
        """Takes credit, queueing (FIFO) while the edge is full.

        `on_wait` runs when we have to queue (shm starts polling its release marks there).
        Edge-wide only: no request's share is counted.
        """
        if self.try_take(edge, nbytes):
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        edge.waiters.append((nbytes, fut))
        if on_wait is not None:
            on_wait()
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                # Granted, then cancelled before we could use it: hand the credit back.
                edge.slots -= 1
                edge.nbytes -= nbytes
            self.wake(edge)
            raise

    def give_back(self, edge: EdgeCredit, nbytes: int, request_id: str | None = None) -> None:
        """Returns what `try_take` (with the same `request_id`) or `take` took."""
        edge.slots -= 1
        edge.nbytes -= nbytes
        if request_id is not None:
            held = edge.by_request.get(request_id, 0) - 1
            if held > 0:
                edge.by_request[request_id] = held
            else:
                edge.by_request.pop(request_id, None)
        if edge.waiters:
            self.wake(edge)

    def wake(self, edge: EdgeCredit) -> None:
        # Strict FIFO: a big payload at the head is not overtaken, which keeps the order
        # of transfers on the edge.
        while edge.waiters:
            nbytes, fut = edge.waiters[0]
            if fut.done():
                edge.waiters.popleft()
                continue
            if not self.admits(edge, nbytes):
                return
            edge.waiters.popleft()
            edge.slots += 1
            edge.nbytes += nbytes
            fut.set_result(None)

    def waiting(self) -> bool:
        return any(e.waiters for e in self.edges.values())

    def outstanding(self, name: str) -> tuple[int, int]:
        """(transfers, bytes) holding credit on edge `name`."""
        credit = self.edges.get(name)
        return (credit.slots, credit.nbytes) if credit else (0, 0)

    def fail_waiters(self, why: str) -> None:
        for credit in self.edges.values():
            for _, fut in credit.waiters:
                if not fut.done():
                    fut.set_exception(RelayError(why))
            credit.waiters.clear()
