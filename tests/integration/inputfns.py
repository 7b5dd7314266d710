"""Stage factory for the input-stream pipelines (referenced by dotted path).

`listen` is an entry stage fed by its client's input stream: each chunk it takes (an array)
is answered at once with a stream chunk to the client (the chunk's sum and its index), and
the result counts what arrived. `chunk_ms` makes it slow, to show the client held back.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from omnirail.stage import StreamingScheduler, StreamState


def make_listener(chunk_ms: float = 0.0) -> StreamingScheduler:
    def start(state: StreamState) -> None:
        opts = state.data or {}
        state.user.update(chunk_ms=float(opts.get("chunk_ms", chunk_ms)), total=0.0)

    def window(state: StreamState, chunks: list[Any], final: bool) -> Any:
        user = state.user
        if user["chunk_ms"]:
            time.sleep(user["chunk_ms"] / 1000.0)
        value = float(np.asarray(chunks[0]).sum())
        user["total"] += value
        return {"index": state.chunks_in - 1, "sum": value}

    def finish(state: StreamState) -> Any:
        return {"chunks": state.chunks_in, "total": state.user["total"]}

    return StreamingScheduler(window, window=1, start_fn=start, finish_fn=finish, name="listen")
