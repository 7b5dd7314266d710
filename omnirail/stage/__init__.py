"""The public API for model authors: what a stage's factory builds and sees.

A stage's ``factory`` (a dotted path in the pipeline file) returns either a plain function
(``fn(payload) -> output``: the stage wraps it in a `SimpleScheduler`) or one of the
schedulers below. Payloads are what the previous stage returned (or the client's inputs at
the entry stage): mappings of names to tensors, numpy arrays and plain values, read-only.
Raise `InputError` (naming the field) for a request's bad input: the client gets
INVALID_ARGUMENT and the stage keeps serving.

- `SimpleScheduler`: one function per request, or a batch function (`max_batch_size`,
  `max_wait_ms`).
- `StreamingScheduler` with `StreamState`: per-request state fed by stream chunks
  (`new_request`, `stream_chunk`, `stream_done`), computing every N chunks.
- `ARScheduler` with `ARRequest` and `ARStep`: continuous batching of an autoregressive
  step across requests, streaming tokens or hidden states.
- `EngineFigures`: what a scheduler running a serving engine reports (`Scheduler.figures`).
- `ConversationStore`: state a stage keeps across a conversation's turns (KV caches),
  bounded and expiring; `ConversationFigures` is what it reports
  (`Scheduler.conversations`).
- `TensorParallel`: the ranks of a `tp_size` stage, driven from rank 0.
- `IncomingMessage` / `OutgoingMessage`: what a custom `Scheduler` takes from its inbox and
  puts in its outbox; `CLIENT` is the destination of a chunk for the client.

Model code imports from here only, never from ``omnirail.stage_service`` (the runtime that
hosts a stage: gRPC, relays, routing), which an import-linter contract checks.
"""

from __future__ import annotations

from omnirail.stage.ar import ARRequest, ARScheduler, ARStep
from omnirail.stage.conversations import ConversationFigures, ConversationStore
from omnirail.stage.scheduler import (
    CLIENT,
    EngineFigures,
    IncomingMessage,
    OutgoingMessage,
    Scheduler,
    SimpleScheduler,
    ThreadScheduler,
)
from omnirail.stage.streaming import StreamingScheduler, StreamState
from omnirail.stage.tp import TensorParallel, TensorParallelBroken
from omnirail.wire.errors import InputError

__all__ = [
    "CLIENT",
    "ARRequest",
    "ARScheduler",
    "ARStep",
    "ConversationFigures",
    "ConversationStore",
    "EngineFigures",
    "IncomingMessage",
    "InputError",
    "OutgoingMessage",
    "Scheduler",
    "SimpleScheduler",
    "StreamState",
    "StreamingScheduler",
    "TensorParallel",
    "TensorParallelBroken",
    "ThreadScheduler",
]
