"""A tensor-parallel stage for the integration tests: a two-layer MLP sharded Megatron
style (the first layer's output units split across ranks, the second layer's input
units likewise, then one all-reduce), on the `TensorParallel` a stage factory is given.
With tp size 1 it is the plain MLP."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from omnirail.stage import TensorParallel


def make_mlp(
    tp: TensorParallel, device: str = "cpu", width: int = 32, hidden: int = 128, seed: int = 0
) -> Any:
    if hidden % tp.size:
        raise ValueError(f"hidden {hidden} does not split over {tp.size} ranks")
    gen = torch.Generator().manual_seed(seed)
    w1 = torch.randn(hidden, width, generator=gen) / width**0.5  # every rank makes the whole
    w2 = torch.randn(width, hidden, generator=gen) / hidden**0.5  # model, then keeps its part
    part = hidden // tp.size
    lo = tp.rank * part
    w1_part = w1[lo : lo + part].contiguous().to(device)
    w2_part = w2[:, lo : lo + part].contiguous().to(device)
    del w1, w2

    def fn(payload: dict[str, Any]) -> dict[str, Any]:
        x = torch.as_tensor(payload["x"], dtype=torch.float32).to(device)
        if payload.get("sleep_s") and tp.rank > 0:
            # A slow follower: rank 0 waits for it inside the all-reduce (time to kill a
            # rank while a request is in its step).
            time.sleep(float(payload["sleep_s"]))
        y = torch.relu(x @ w1_part.T) @ w2_part.T
        if tp.size > 1:
            torch.distributed.all_reduce(y, group=tp.group)
        return {"y": y.cpu(), "ranks": tp.size, "part": part, "pid": os.getpid()}

    return fn
