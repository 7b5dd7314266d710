"""`ConversationStore`: what a stage keeps of each conversation between its turns.

A request with a conversation id (`GenerateRequest.conversation_id`) is one turn of it;
every hop routes the turns of one conversation to the same replica while it lives
(`omnirail.wire.routing`), so a stage can keep state from one turn for the next (a KV
cache: the next turn then prefills only what is new). The state is a cache, never the
truth: each turn carries what its pipeline needs to answer from scratch, so state that is
gone (evicted, expired, closed, or on a replica that was lost) is rebuilt from the turn
itself, slower, never wrong. A stage that keeps state must therefore check that what it
kept fits the turn (e.g. the longest common prefix of token ids) and use only that.

Bounded three ways: `max_bytes` in all (the least recently used state goes first; a state
larger than the whole budget is not kept), `idle_s` without a turn (checked whenever the
store is used, and at each metrics scrape), and `close(conversation)` (the client closed it:
`Client.close_conversation`, through the scheduler's `close_conversation`). A turn `take`s
its state out while it runs and `put`s the new one back when it ends, so two turns of one
conversation that overlap never share it: the second rebuilds. Thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

EVICTION_REASONS = ("budget", "idle", "closed")


@dataclass(frozen=True, slots=True)
class ConversationFigures:
    """A store's counts (`Scheduler.conversations()`), exported as the stage's
    `omnirail_conversation_*` metrics: states kept and their bytes, states dropped by reason
    (budget, idle, closed), turns that found their state (`reused`) or rebuilt it, and the
    tokens turns computed (`prefill_tokens`) and took from kept state (`reused_tokens`)."""

    states: int
    bytes: int
    evicted: dict[str, int]
    turns_reused: int
    turns_rebuilt: int
    prefill_tokens: int
    reused_tokens: int


@dataclass(slots=True)
class _Kept(Generic[T]):
    state: T
    nbytes: int
    used: float


class ConversationStore(Generic[T]):
    """Per-conversation state, bounded by `max_bytes` and `idle_s` (see the module)."""

    def __init__(self, max_bytes: int, idle_s: float) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        if not idle_s > 0:
            raise ValueError(f"idle_s must be above 0, got {idle_s}")
        self.max_bytes = max_bytes
        self.idle_s = idle_s
        self._kept: OrderedDict[str, _Kept[T]] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._lock = threading.Lock()
        self._evicted = dict.fromkeys(EVICTION_REASONS, 0)
        self._turns = {"reused": 0, "rebuilt": 0}
        self._tokens = {"prefill": 0, "reused": 0}

    def take(self, conversation_id: str) -> T | None:
        """Removes and returns the conversation's state (None: none kept, or it expired)."""
        with self._lock:
            self._expire(time.monotonic())
            kept = self._kept.pop(conversation_id, None)
            if kept is None:
                return None
            self._bytes -= kept.nbytes
            return kept.state

    def put(self, conversation_id: str, state: T, nbytes: int) -> None:
        """Keeps `state` (`nbytes` of it) for the conversation's next turn, replacing what
        was kept; least recently used states go to make room."""
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            old = self._kept.pop(conversation_id, None)
            if old is not None:
                self._bytes -= old.nbytes
            if nbytes > self.max_bytes:
                self._evicted["budget"] += 1
                return
            while self._kept and self._bytes + nbytes > self.max_bytes:
                _, dropped = self._kept.popitem(last=False)
                self._bytes -= dropped.nbytes
                self._evicted["budget"] += 1
            self._kept[conversation_id] = _Kept(state, nbytes, now)
            self._bytes += nbytes

    def close(self, conversation_id: str) -> bool:
        """Drops the conversation's state now; False when none was kept."""
        with self._lock:
            kept = self._kept.pop(conversation_id, None)
            if kept is None:
                return False
            self._bytes -= kept.nbytes
            self._evicted["closed"] += 1
            return True

    def record_turn(self, reused: bool, prefill_tokens: int = 0, reused_tokens: int = 0) -> None:
        """Counts one turn: whether it found its state, and the tokens it computed and
        reused (for stages that count tokens)."""
        with self._lock:
            self._turns["reused" if reused else "rebuilt"] += 1
            self._tokens["prefill"] += prefill_tokens
            self._tokens["reused"] += reused_tokens

    def figures(self) -> ConversationFigures:
        with self._lock:
            self._expire(time.monotonic())
            return ConversationFigures(
                states=len(self._kept),
                bytes=self._bytes,
                evicted=dict(self._evicted),
                turns_reused=self._turns["reused"],
                turns_rebuilt=self._turns["rebuilt"],
                prefill_tokens=self._tokens["prefill"],
                reused_tokens=self._tokens["reused"],
            )

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)

    def _expire(self, now: float) -> None:
        """Drops the states idle for `idle_s` (under the lock)."""
        limit = now - self.idle_s
        while self._kept:
            cid, kept = next(iter(self._kept.items()))
            if kept.used > limit:
                return
            del self._kept[cid]
            self._bytes -= kept.nbytes
            self._evicted["idle"] += 1
