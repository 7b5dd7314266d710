"""`ARScheduler`: continuous batching of an autoregressive step across requests.

Each loop iteration runs one `step_fn` over every running request; requests join and
leave the batch between steps, so a long generation never makes a short one wait for it
to end (the point of continuous batching over the fixed batches of `SimpleScheduler`).
"""

from __future__ import annotations

import logging
import queue
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omnirail.stage.scheduler import IncomingMessage, OutgoingMessage, ThreadScheduler

log = logging.getLogger(__name__)

# How long the loop waits for news when every running request is held back by its
# consumer: short, since the outbox has no signal for "chunks drained" to wait on.
_BACKPRESSURE_POLL_S = 0.002
# When all running requests wait for input only a message can wake them, but aborts do
# not come through the inbox; this bounds how long an aborted one keeps its slot.
_INPUT_POLL_S = 0.05


@dataclass(slots=True, eq=False)
class ARRequest:
    """One request in the batch. `inputs` are its stream chunks received so far.

    `steps` is the number of steps it has taken before the current one (0 on its first);
    `state` is scratch space for `init_fn` / `step_fn` (KV cache slot, sampled tokens).
    `emit` sends extra chunks from a step (e.g. text to the client next to the hidden
    state in the step's `ARStep.chunk`); they go out with the step's other output. With
    `ARScheduler(hold_inputs=True)`, `take_inputs` removes the inputs a step has used and
    only then returns their credit to the producer.
    """

    request_id: str
    data: Any
    # The conversation it is a turn of ("" for none): the key of state kept across turns.
    conversation: str = ""
    inputs: list[Any] = field(default_factory=list)
    inputs_done: bool = False
    steps: int = 0
    state: dict[str, Any] = field(default_factory=dict)
    emitted: list[OutgoingMessage] = field(default_factory=list, repr=False)
    # With hold_inputs: the messages behind `inputs`, whose credit is still held.
    held: list[IncomingMessage] = field(default_factory=list, repr=False)
    release: Callable[[IncomingMessage], None] | None = field(default=None, repr=False)

    def take_inputs(self, n: int | None = None) -> list[Any]:
        """Removes and returns the first `n` inputs (all when None), returning their
        credit to the producer when the scheduler holds it (`hold_inputs`)."""
        n = len(self.inputs) if n is None else min(n, len(self.inputs))
        taken, self.inputs = self.inputs[:n], self.inputs[n:]
        msgs, self.held = self.held[:n], self.held[n:]
        if self.release is not None:
            for msg in msgs:
                self.release(msg)
        return taken

    def release_inputs(self) -> None:
        """Returns the credit of every input still held (the request is leaving)."""
        msgs, self.held = self.held, []
        if self.release is not None:
            for msg in msgs:
                self.release(msg)

    def emit(
        self, chunk: Any, *, target: str | None = None, metadata: dict[str, Any] | None = None
    ) -> None:
        """Queues one more stream chunk from the current step (scheduler thread only)."""
        self.emitted.append(OutgoingMessage(self.request_id, "stream", chunk, target, metadata))


@dataclass(slots=True)
class ARStep:
    """What one step produced for one request.

    A non-None `chunk` is emitted as a stream chunk (to `target`, or every stream
    destination when None). `finished` ends the request with `result`. `needs_input`
    parks the request (it keeps its batch slot) until its next stream chunk or
    stream_done arrives, so a request waiting on its producer is not stepped in a loop.
    """

    chunk: Any = None
    finished: bool = False
    result: Any = None
    target: str | None = None
    metadata: dict[str, Any] | None = None
    needs_input: bool = False


StepFn = Callable[[list[ARRequest]], list[ARStep]]
InitFn = Callable[[ARRequest], None]
EndFn = Callable[[str], None]


class ARScheduler(ThreadScheduler):
    """Steps up to `max_batch_size` requests together; the rest wait in arrival order.

    `init_fn(request)` runs once as a request joins the batch (prefill); `end_fn(request_id)`
    once as it leaves for any reason (finished, failed, aborted), on the compute thread
    in order with steps: the place to free what init_fn made outside `request.state`
    (caches a tensor-parallel stage keeps on every rank). A request with
    `max_unsent` or more chunks still unsent in the outbox sits out steps until its
    consumer catches up, so one slow client does not stall the batch.

    Stream input: by default a chunk's credit goes back to its producer as soon as it
    lands in `request.inputs`. With `hold_inputs=True` it is held until `step_fn` removes
    the chunk with `request.take_inputs()`, so a producer faster than this stage is slowed
    to its pace (a request may then hold at most the edge's `request_credits` unused
    inputs: take them as you go).
    """

    def __init__(
        self,
        step_fn: StepFn,
        *,
        max_batch_size: int = 32,
        max_unsent: int = 16,
        init_fn: InitFn | None = None,
        end_fn: EndFn | None = None,
        hold_inputs: bool = False,
        name: str = "ar",
    ) -> None:
        super().__init__(name)
        self.hold_inputs = hold_inputs
        self.inbox.defer_taken = hold_inputs
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_unsent < 1:
            raise ValueError(f"max_unsent must be >= 1, got {max_unsent}")
        self._step_fn = step_fn
        self._init_fn = init_fn
        self._end_fn = end_fn
        self.max_batch_size = max_batch_size
        self.max_unsent = max_unsent
        # Every known request, running or waiting, so input reaches waiting ones too.
        self._live: dict[str, ARRequest] = {}
        self._running: dict[str, ARRequest] = {}  # insertion order = batch order
        self._waiting: deque[ARRequest] = deque()
        self._parked: set[str] = set()  # running, but waiting for input
        self._abort_queue: deque[str] = deque()
        # Requests admitted (init_fn started) and not yet removed: end_fn is owed them.
        self._admitted: set[str] = set()

    @property
    def held_requests(self) -> int:
        return len(self._live)

    def abort(self, request_id: str) -> None:
        super().abort(request_id)
        self._abort_queue.append(request_id)
        # Wakes the compute thread should it be idle: the request's state goes now, not
        # with the next request (an idle stage must hold nothing of ended requests).
        self.inbox.put(IncomingMessage(request_id, "abort", None))

    # ---- compute thread -------------------------------------------------------------

    def _run(self) -> None:
        timeout: float | None = None
        while True:
            if not self._take_messages(timeout):
                return
            while self._abort_queue:
                self._remove(self._abort_queue.popleft())
            self._admit()
            batch = [
                r
                for r in self._running.values()
                if r.request_id not in self._parked
                and self.outbox.unsent(r.request_id) < self.max_unsent
            ]
            if batch:
                self._step(batch)
                # Waiting requests take the slots freed by this step on the next pass.
                timeout = 0.0 if self._running or self._waiting else None
            elif not self._running:
                timeout = None
            elif len(self._parked) < len(self._running):
                timeout = _BACKPRESSURE_POLL_S
            else:
                timeout = _INPUT_POLL_S

    def _take_messages(self, timeout: float | None) -> bool:
        """Handles every waiting message, first waiting up to `timeout` (None: forever)
        for one. False when told to stop."""
        try:
            msg = self.inbox.get(timeout=timeout) if timeout != 0.0 else self.inbox.get(False)
        except queue.Empty:
            return True
        while True:
            if msg is None:
                self._live.clear()
                self._running.clear()
                self._waiting.clear()
                return False
            self._handle(msg)
            try:
                msg = self.inbox.get(False)
            except queue.Empty:
                return True

    def _handle(self, msg: IncomingMessage) -> None:
        rid = msg.request_id
        req = self._live.get(rid)
        if self.hold_inputs and (req is None or msg.type != "stream_chunk" or rid in self.aborted):
            self.inbox.taken(msg)  # only chunks that join `inputs` keep their credit
        if rid in self.aborted:
            return
        if msg.type == "new_request":
            if rid in self._live:
                self._remove(rid)
                self._fail([rid], RuntimeError(f"request {rid!r} is already running here"))
                return
            req = ARRequest(rid, msg.data, msg.conversation)
            if self.hold_inputs:
                req.release = self.inbox.taken
            self._live[rid] = req
            self._waiting.append(req)
            return
        if req is None:  # finished, failed or aborted: late input is dropped
            return
        if msg.type == "stream_chunk":
            req.inputs.append(msg.data)
            if self.hold_inputs:
                req.held.append(msg)
        elif msg.type == "stream_done":
            req.inputs_done = True
        self._parked.discard(rid)

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_batch_size:
            req = self._waiting.popleft()
            rid = req.request_id
            if self._live.get(rid) is not req:  # removed while waiting (abort, duplicate)
                continue
            self._admitted.add(rid)
            if self._init_fn is not None:
                try:
                    self._init_fn(req)
                except Exception as exc:  # a failed prefill fails only its request
                    self._remove(rid)
                    self._fail([rid], exc)
                    continue
            self._running[rid] = req

    def _step(self, batch: list[ARRequest]) -> None:
        try:
            steps = self._step_fn(batch)
            self._check(steps, len(batch))
        except Exception as exc:  # fails this batch; the scheduler takes new requests
            rids = [r.request_id for r in batch]
            for rid in rids:
                self._remove(rid)
            self._fail(rids, exc)
            return
        out: list[OutgoingMessage] = []
        for req, step in zip(batch, steps, strict=True):
            req.steps += 1
            rid = req.request_id
            extra, req.emitted = req.emitted, []
            if rid in self.aborted:  # aborted mid-step: removed before the next one
                continue
            out.extend(extra)
            if step.chunk is not None:
                out.append(OutgoingMessage(rid, "stream", step.chunk, step.target, step.metadata))
            if step.finished:
                self._remove(rid)
                out.append(OutgoingMessage(rid, "result", step.result))
            elif step.needs_input:
                if req.inputs_done:
                    self._remove(rid)
                    err = RuntimeError(f"step_fn asked for more input after stream_done ({rid!r})")
                    out.append(OutgoingMessage(rid, "error", err))
                else:
                    self._parked.add(rid)
        # One put for the whole step: the stage drains it in one pass, one write per peer.
        self.outbox.put_many(out)

    @staticmethod
    def _check(steps: object, n: int) -> None:
        if not isinstance(steps, (list, tuple)):
            raise TypeError(
                f"step_fn must return a list of {n} ARStep (one per request), "
                f"got {type(steps).__name__}"
            )
        if len(steps) != n:
            raise TypeError(
                f"step_fn must return a list of {n} ARStep (one per request), got {len(steps)}"
            )
        for i, step in enumerate(steps):
            if not isinstance(step, ARStep):
                raise TypeError(
                    f"step_fn must return a list of ARStep; item {i} is {type(step).__name__}"
                )

    def _remove(self, rid: str) -> None:
        # Waiting requests stay in the deque until admitted; `_live` says they are gone.
        req = self._live.pop(rid, None)
        if req is not None:
            req.release_inputs()
        self._running.pop(rid, None)
        self._parked.discard(rid)
        if rid in self._admitted:
            self._admitted.discard(rid)
            if self._end_fn is not None:
                try:
                    self._end_fn(rid)
                except Exception:  # the request is gone either way
                    log.exception("%s: end_fn failed for %s", self.name, rid)

    def _fail(self, rids: list[str], exc: Exception) -> None:
        errors = [OutgoingMessage(r, "error", exc) for r in rids if r not in self.aborted]
        self.outbox.put_many(errors)
