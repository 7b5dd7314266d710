"""How every stream writer here batches: whoever queues something sets the writer's
`wake` event, and the writer takes what one write carries, so a burst goes out as one
message. The servers' writer is `grpc_server.write_until_read_ends`; the clients' (a stage's
Deliver channels and Attach stream, the SDK's async Session) wait with `wait_until`, and
take with `take_batch`, as the blocking SDK's Session does on its grpc writer thread."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


async def wait_until(wake: asyncio.Event, ready: Callable[[], object]) -> None:
    """Returns once `ready()` is true, waiting on `wake` in between (whoever changes what
    `ready` reads sets it)."""
    while not ready():
        wake.clear()
        await wake.wait()


def take_batch(
    pending: deque[T], size_of: Callable[[T], int], max_items: int, max_bytes: int
) -> list[T]:
    """Takes from the front of `pending` what one write carries: the first item whatever
    its size, then more while the batch stays within `max_items` and `max_bytes`."""
    batch: list[T] = []
    size = 0
    while pending and len(batch) < max_items:
        item_size = size_of(pending[0])
        if batch and size + item_size > max_bytes:
            break  # the next write's first
        batch.append(pending.popleft())
        size += item_size
    return batch
