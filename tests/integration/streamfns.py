"""Stage factories for the streaming integration pipelines (referenced by dotted path).

thinker (ARScheduler) streams one chunk per step; talker forwards each chunk; vocoder
windows them and streams what each window covered to the client.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import torch

from omnirail.stage import ARRequest, ARScheduler, ARStep, StreamingScheduler, StreamState

# ---- thinker: continuous batching, one chunk per step ---------------------------------


def make_thinker(step_ms: float = 0.0, max_batch_size: int = 32) -> ARScheduler:
    """Inputs: n (chunks), chunk_bytes (0: a 1-element chunk), poison_at (a chunk whose
    value is -1), step_ms (overrides the factory's). Each chunk holds its step number."""
    clock = itertools.count()
    lock = threading.Lock()
    global_step = [0]

    def init(req: ARRequest) -> None:
        opts = req.data or {}
        req.state.update(
            n=int(opts.get("n", 8)),
            chunk_bytes=int(opts.get("chunk_bytes", 0)),
            poison_at=opts.get("poison_at"),
            step_ms=float(opts.get("step_ms", step_ms)),
            joined_at=global_step[0],
            max_batch=0,
            started=time.monotonic(),
        )

    def step(batch: list[ARRequest]) -> list[ARStep]:
        with lock:
            global_step[0] = next(clock)
        delay = max(r.state["step_ms"] for r in batch)
        if delay:
            time.sleep(delay / 1000.0)
        out = []
        for req in batch:
            st = req.state
            st["max_batch"] = max(st["max_batch"], len(batch))
            value = -1.0 if st["poison_at"] == req.steps else float(req.steps)
            size = max(1, st["chunk_bytes"] // 4)
            chunk = torch.full((size,), value, dtype=torch.float32)
            done = req.steps + 1 >= st["n"]
            result = None
            if done:
                result = {
                    "tokens": req.steps + 1,
                    "joined_at": st["joined_at"],
                    "left_at": global_step[0],
                    "max_batch": st["max_batch"],
                    "elapsed_s": time.monotonic() - st["started"],
                }
            out.append(ARStep(chunk=chunk, finished=done, result=result))
        return out

    return ARScheduler(step, init_fn=init, max_batch_size=max_batch_size, name="thinker")


# ---- talker: forwards every chunk -------------------------------------------------------


def make_talker(chunk_ms: float = 0.0) -> StreamingScheduler:
    def forward(state: StreamState, chunks: list[Any], final: bool) -> Any:
        if chunk_ms:
            time.sleep(chunk_ms / 1000.0)
        return chunks[0]

    return StreamingScheduler(forward, window=1, name="talker")


# ---- vocoder: windows, streams what each window covered ----------------------------------


class Vocoder(StreamingScheduler):
    """Emits {"ids": [chunk values], "final": bool} per window; fails on a -1 chunk.

    Records the deepest inbox it saw so tests can check that flow control bounds it.
    """

    def __init__(self, window: int, hop: int | None, chunk_ms: float) -> None:
        super().__init__(window=window, hop=hop, metadata={"modality": "audio"}, name="vocoder")
        self.chunk_ms = chunk_ms

    def new_request(self, state: StreamState) -> None:
        state.user["max_queue"] = 0

    def process_window(self, state: StreamState, chunks: list[Any], final: bool) -> Any:
        state.user["max_queue"] = max(state.user["max_queue"], self.inbox.qsize())
        if self.chunk_ms:
            time.sleep(self.chunk_ms / 1000.0)
        ids = [float(c[0]) for c in chunks]
        if -1.0 in ids:
            raise ValueError("poisoned chunk in the stream")
        return {"ids": ids, "final": final}

    def finish(self, state: StreamState) -> Any:
        return {
            "chunks": state.chunks_in,
            "windows": state.windows,
            "max_queue": state.user["max_queue"],
        }


def make_vocoder(window: int = 1, hop: int | None = None, chunk_ms: float = 0.0) -> Vocoder:
    return Vocoder(window, hop, chunk_ms)


# ---- a slow autoregressive consumer that holds its inputs' credit ----------------------


def make_slow_ar(step_ms: float = 4.0) -> ARScheduler:
    """Takes one input per step (sleeping `step_ms`), holding the rest's credit."""

    def step(batch: list[ARRequest]) -> list[ARStep]:
        time.sleep(step_ms / 1000.0)
        out = []
        for req in batch:
            st = req.state
            st["max_inputs"] = max(st.get("max_inputs", 0), len(req.inputs))
            if req.inputs:
                req.take_inputs(1)
                st["used"] = st.get("used", 0) + 1
                out.append(ARStep())
            elif req.inputs_done:
                result = {"chunks": st.get("used", 0), "max_inputs": st["max_inputs"]}
                out.append(ARStep(finished=True, result=result))
            else:
                out.append(ARStep(needs_input=True))
        return out

    return ARScheduler(step, hold_inputs=True, name="slow-ar")
