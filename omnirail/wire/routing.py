"""Which replica of a stage takes a request's items: one rule for every sender and the
coordinator.

A stage's replicas are ordered by replica id (the coordinator's topology lists them so);
a request's items go to replica `crc32(request id) % n`. Every producer computes the same
index without asking anyone, so the producers of a fan-in meet at one replica; the
coordinator computes it to tell which requests a lost replica held (coordinator/failover.py)
and to start a request's entry under `balance: request_id`.

A turn of a conversation goes by its conversation id instead, at every hop (the entry
too), with rendezvous hashing over the replicas' names (`crc32(conversation/name)`, the
highest wins): its turns meet the state the previous ones left, and losing a replica moves
only the conversations it held (a new replica takes over about 1/n of them). Where a
conversation moves, its state is rebuilt from the turn's history: slower, never wrong.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def replica_index(request_id: str, n: int) -> int:
    """The index, among `n` replicas sorted by id, of the one that takes `request_id`'s
    items (`request_id` is the wire id: a re-dispatched attempt has its own)."""
    if n < 1:
        raise ValueError(f"replica_index: no replicas to choose from (n={n})")
    return zlib.crc32(request_id.encode()) % n


def replica_for(request_id: str, replicas: Sequence[T]) -> T:
    """The replica of `replicas` (sorted by id) that takes `request_id`'s items."""
    return replicas[replica_index(request_id, len(replicas))]


def conversation_index(conversation_id: str, names: Sequence[str]) -> int:
    """The index, among replicas named `names` (in topology order), that holds
    `conversation_id`'s state: the highest `crc32(conversation/name)`, ties to the first."""
    if not names:
        raise ValueError("conversation_index: no replicas to choose from")
    key = conversation_id.encode() + b"/"
    scores = [zlib.crc32(key + name.encode()) for name in names]
    return scores.index(max(scores))


def route_index(request_id: str, conversation_id: str, names: Sequence[str]) -> int:
    """The replica index for an item: by conversation when it has one, else by request."""
    if conversation_id:
        return conversation_index(conversation_id, names)
    return replica_index(request_id, len(names))
