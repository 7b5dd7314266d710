"""Private (anonymous) memory pool for relays whose peers read it through a library.

nixl, ucx and torchdist copy a payload into this pool once; the transfer library then reads
the extent (nixl READ by the receiver, a UCX or gloo send). Segments are huge-page advised
where the host allows, so registering and reading them touches few pages. `on_segment`
lets a backend register each new segment once (nixl `register_memory`).
"""

from __future__ import annotations

import mmap
from collections.abc import Callable

import numpy as np

from omnirail.relay.shm_pool import ALIGN, ExtentAllocator

_SEGMENT_ROUND = 2 << 20
_HUGE = 2 << 20


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


class HostSegment:
    __slots__ = ("address", "alloc", "array", "index", "mmap", "size")

    def __init__(self, index: int, size: int) -> None:
        self.index = index
        self.size = size
        self.mmap: mmap.mmap | None = mmap.mmap(
            -1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        )
        if hasattr(mmap, "MADV_HUGEPAGE") and size >= _HUGE:
            try:
                self.mmap.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass  # transparent huge pages disabled: plain pages work too
        self.array = np.frombuffer(self.mmap, np.uint8)
        self.address = int(self.array.ctypes.data)
        self.alloc = ExtentAllocator(size)

    def close(self) -> None:
        if self.mmap is None:
            return
        del self.array
        try:
            self.mmap.close()
        except BufferError:
            pass  # views still alive: unmapped when the last one goes
        self.mmap = None


class HostExtent:
    __slots__ = ("offset", "segment", "size")

    def __init__(self, segment: HostSegment, offset: int, size: int) -> None:
        self.segment = segment
        self.offset = offset
        self.size = size

    def view(self, nbytes: int) -> np.ndarray:
        return self.segment.array[self.offset : self.offset + nbytes]


class HostPool:
    """Segments of anonymous memory, the first `first_bytes`, more added when nothing fits."""

    def __init__(
        self, first_bytes: int, on_segment: Callable[[HostSegment], None] | None = None
    ) -> None:
        self.first_bytes = max(_round_up(first_bytes, mmap.PAGESIZE), mmap.PAGESIZE)
        self.segments: list[HostSegment] = []
        self._on_segment = on_segment
        self.closed = False

    def alloc(self, nbytes: int) -> HostExtent:
        size = _round_up(max(nbytes, 1), ALIGN)
        for seg in self.segments:
            off = seg.alloc.alloc(size)
            if off is not None:
                return HostExtent(seg, off, size)
        # Grow rather than wait: the extents in use may belong to transfers that wait on
        # this one.
        seg = HostSegment(
            len(self.segments), max(self.first_bytes, _round_up(size, _SEGMENT_ROUND))
        )
        if self._on_segment is not None:
            try:
                self._on_segment(seg)
            except BaseException:
                seg.close()
                raise
        self.segments.append(seg)
        off = seg.alloc.alloc(size)
        assert off is not None
        return HostExtent(seg, off, size)

    def free(self, extent: HostExtent) -> None:
        if not self.closed:
            extent.segment.alloc.free(extent.offset, extent.size)

    def trimmable(self, segment: HostSegment) -> bool:
        """Whether `trim` would unmap `segment`: the newest segment, holding no extent."""
        return (
            not self.closed
            and bool(self.segments)
            and self.segments[-1] is segment
            and not segment.alloc.used
        )

    def trim(self, segment: HostSegment) -> bool:
        """Unmaps `segment` if `trimmable` (one grown for an allocation that was given back
        at once: a receiver's failed get must not keep a segment sized by what a peer
        claimed). Whether it went."""
        if not self.trimmable(segment):
            return False
        self.segments.pop()
        segment.close()
        return True

    @property
    def nbytes(self) -> int:
        return sum(seg.size for seg in self.segments)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for seg in self.segments:
            seg.close()
