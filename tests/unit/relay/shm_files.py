"""Hand-made /dev/shm files for the shm receiver's tests: segments as pools make them
(owner-only) and grants written as a sender writes them (omnirail/relay/shm.py, "Trust")."""

from __future__ import annotations

import os

import numpy as np

from omnirail.relay.shm_handles import SLOT_MASK
from omnirail.relay.shm_pool import (
    GRANT_END,
    GRANT_FORWARDER,
    GRANT_SEGMENT,
    GRANT_START,
    GRANT_TID,
    MARKS_BYTES,
    SHM_DIR,
    grant_index,
)


def shm_file(name: str, size: int, fill: bytes = b"") -> str:
    """/dev/shm file `name` of `size` bytes (sparse beyond `fill`), mode 0600; its path."""
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    with open(fd, "wb") as f:
        f.write(fill)
        f.truncate(size)
    return path


def write_grant(
    marks: str, *, tid: int, number: int, start: int, end: int, forwarder: int = 0
) -> str:
    """Grants transfer `tid` bytes [start, end) of data segment `number` in marks file
    `marks` (a path or a name in /dev/shm; made, 0600 and of the marks' size, if missing)."""
    path = marks if os.path.isabs(marks) else os.path.join(SHM_DIR, marks)
    if not os.path.exists(path):
        shm_file(os.path.basename(path), MARKS_BYTES)
    words = np.memmap(path, np.uint64, "r+", shape=(MARKS_BYTES // 8,))
    g = grant_index(tid & SLOT_MASK)
    words[g + GRANT_SEGMENT] = number
    words[g + GRANT_START] = start
    words[g + GRANT_END] = min(end, 2**64 - 1)
    words[g + GRANT_FORWARDER] = forwarder
    words[g + GRANT_TID] = tid
    words.flush()
    del words
    return path
