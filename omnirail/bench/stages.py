"""Stage factories for `omnirail bench pipeline` (referenced from the generated YAML)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def source(payload_bytes: int = 0, stage_ms: float = 0.0) -> Callable[[Any], Any]:
    """First stage: materializes a uint8 tensor of `payload_bytes` per request."""
    import torch

    def fn(inputs: dict[str, Any]) -> dict[str, Any]:
        if stage_ms:
            time.sleep(stage_ms / 1000.0)
        out: dict[str, Any] = {"i": inputs.get("i", 0)}
        if payload_bytes:
            out["x"] = torch.empty(payload_bytes, dtype=torch.uint8)
        return out

    return fn


def forward(stage_ms: float = 0.0) -> Callable[[Any], Any]:
    """Middle stage: passes its input on unchanged."""

    def fn(payload: Any) -> Any:
        if stage_ms:
            time.sleep(stage_ms / 1000.0)
        return payload

    return fn


def sink(stage_ms: float = 0.0) -> Callable[[Any], Any]:
    """Last stage: a small dict saying what arrived."""

    def fn(payload: dict[str, Any]) -> dict[str, Any]:
        if stage_ms:
            time.sleep(stage_ms / 1000.0)
        x = payload.get("x")
        return {"i": payload.get("i", 0), "nbytes": 0 if x is None else int(x.numel())}

    return fn


def replica_work(stage_ms: float = 10.0, slow_factor: float = 1.0) -> Callable[[Any], Any]:
    """`omnirail bench pipeline --replicas N`: sleeps `stage_ms` per request (GIL
    released, like a kernel), `slow_factor` times longer in replica 0 (a slower card, a
    noisy neighbour); answers which replica served."""
    import os

    replica = int(os.environ.get("OMNIRAIL_REPLICA", "0"))
    delay = stage_ms * (slow_factor if replica == 0 else 1.0) / 1000.0

    def fn(inputs: dict[str, Any]) -> dict[str, Any]:
        time.sleep(delay)
        return {"i": inputs.get("i", 0), "replica": replica}

    return fn


# ---- `omnirail bench streaming` -------------------------------------------------------


def stream_producer(chunks: int = 50, interval_ms: float = 10.0, chunk_floats: int = 512) -> Any:
    """Emits `chunks` chunks, one per step, each step taking `interval_ms` (like a decode
    step on a GPU: a sleep releases the GIL as a kernel would)."""
    import torch

    from omnirail.stage import ARRequest, ARScheduler, ARStep

    def step(batch: list[ARRequest]) -> list[ARStep]:
        time.sleep(interval_ms / 1000.0)
        out = []
        for req in batch:
            n = int((req.data or {}).get("chunks", chunks))
            chunk = torch.full((chunk_floats,), float(req.steps))
            done = req.steps + 1 >= n
            out.append(ARStep(chunk=chunk, finished=done, result={"chunks": req.steps + 1}))
        return out

    return ARScheduler(step, name="producer")


def stream_forward() -> Any:
    """Passes every chunk on as it arrives."""
    from omnirail.stage import StreamingScheduler

    return StreamingScheduler(
        lambda state, chunks, final: chunks[0], window=1, metadata={"modality": "audio"}
    )


# ---- `omnirail bench tenants` ---------------------------------------------------------


def tenant_work(steps: int = 20, step_ms: float = 10.0, max_batch: int = 32) -> Any:
    """Each request takes `steps` steps; a step takes `step_ms` whatever the batch holds
    (a decode step on an accelerator: a sleep releases the GIL as a kernel would), so up
    to `max_batch` requests run at the speed of one, and a new one joins at the next step."""
    from omnirail.stage import ARRequest, ARScheduler, ARStep

    def step(batch: list[ARRequest]) -> list[ARStep]:
        time.sleep(step_ms / 1000.0)
        return [
            ARStep(finished=req.steps + 1 >= steps, result={"steps": req.steps + 1})
            for req in batch
        ]

    return ARScheduler(step, max_batch_size=max_batch, name="tenant-work")
