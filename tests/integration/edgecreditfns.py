"""Stage functions of the edge credits pipeline (pipelines/edge_credits.yaml)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from omnirail.stage import SimpleScheduler


def make_blob(nbytes: int = 64 << 10) -> Any:
    """A payload far above the inline bound: it goes through the shm relay."""

    def fn(inputs: dict[str, Any]) -> dict[str, Any]:
        return {"blob": np.full(nbytes, inputs["i"] % 256, np.uint8), "i": inputs["i"]}

    return fn


def make_holder(sleep_s: float = 0.1) -> SimpleScheduler:
    """Computes one input at a time, slowly, and reports how many inputs waited in its
    inbox when it started this one. Each of them holds its shm view, i.e. its relay credit
    on the edge from the sender, until its request ends here; so one computing plus those
    waiting is at most what the sender's relay lets out on the edge."""
    scheduler: SimpleScheduler

    def fn(payload: dict[str, Any]) -> dict[str, Any]:
        waiting = scheduler.inbox.qsize()
        time.sleep(sleep_s)
        return {"waiting": waiting, "i": payload["i"], "bytes": int(payload["blob"].nbytes)}

    scheduler = SimpleScheduler(fn, name="holder")
    return scheduler
