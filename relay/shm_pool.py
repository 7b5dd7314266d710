"""Shared-memory pool of the `shm` relay: segments in /dev/shm and an extent allocator.

One pool per sender process. Segments are plain files in /dev/shm (not
multiprocessing.shared_memory, whose resource tracker unlinks or warns in receivers).
Extents are variable-size, 64-byte aligned, first-fit with coalescing: first-fit keeps
reusing the lowest offsets, so the pages (and cache lines) a stream touches stay warm.
Segments are never shrunk: the pool keeps its high-water mark, like any memory pool.
"""

from __future__ import annotations

import atexit
import bisect
import itertools
import mmap
import os
import re

import numpy as np

SHM_DIR = "/dev/shm"
ALIGN = 64
# New segments are rounded to this so a run of slightly growing payloads does not add a
# segment each time.
_SEGMENT_ROUND = 2 << 20
# Always used with fullmatch: `$` would also match before a trailing newline.
NAME_RE = re.compile(r"[A-Za-z0-9_.-]+")


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


class ExtentAllocator:
    """First-fit allocator over [0, size) with coalescing of adjacent free extents."""

    def __init__(self, size: int) -> None:
        self.size = size
        # Sorted, non-adjacent free extents as parallel lists (offsets, sizes).
        self._offs: list[int] = [0] if size else []
        self._sizes: list[int] = [size] if size else []
        self.used = 0

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a free extent of `nbytes` (a multiple of ALIGN), or None."""
        for i, free in enumerate(self._sizes):
            if free >= nbytes:
                off = self._offs[i]
                if free == nbytes:
                    del self._offs[i], self._sizes[i]
                else:
                    self._offs[i] = off + nbytes
                    self._sizes[i] = free - nbytes
                self.used += nbytes
                return off
        return None

    def free(self, off: int, nbytes: int) -> None:
        i = bisect.bisect_left(self._offs, off)
        if (i < len(self._offs) and self._offs[i] < off + nbytes) or (
            i > 0 and self._offs[i - 1] + self._sizes[i - 1] > off
        ):
            raise ValueError(f"double free of extent [{off}, {off + nbytes})")
        self.used -= nbytes
        merge_prev = i > 0 and self._offs[i - 1] + self._sizes[i - 1] == off
        merge_next = i < len(self._offs) and off + nbytes == self._offs[i]
        if merge_prev and merge_next:
            self._sizes[i - 1] += nbytes + self._sizes[i]
            del self._offs[i], self._sizes[i]
        elif merge_prev:
            self._sizes[i - 1] += nbytes
        elif merge_next:
            self._offs[i] = off
            self._sizes[i] += nbytes
        else:
            self._offs.insert(i, off)
            self._sizes.insert(i, nbytes)

    @property
    def free_extents(self) -> list[tuple[int, int]]:
        return list(zip(self._offs, self._sizes, strict=True))

    @property
    def largest_free(self) -> int:
        return max(self._sizes, default=0)


class Segment:
    """One writable /dev/shm file owned by this process (0600: owner-only), the
    `number`th data segment of its pool (-1: the marks segment)."""

    def __init__(self, name: str, size: int, number: int = -1) -> None:
        self.name = name
        self.number = number
        self.path = os.path.join(SHM_DIR, name)
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # The mode above is filtered by the umask; this one is not (and a umask can
            # only remove bits, so 0600 is what any umask leaves at most: made explicit).
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, size)
            self.mmap: mmap.mmap | None = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)
        self.size = size
        self.array = np.frombuffer(self.mmap, np.uint8)  # writable: the copy-in target
        self.alloc = ExtentAllocator(size)

    def close(self) -> None:
        if self.mmap is not None:
            del self.array
            close_mapping(self.mmap)
            self.mmap = None


def close_mapping(mm: mmap.mmap, view: memoryview | None = None) -> None:
    """Unmaps now if no view is exported, else leaves it to the last view's release."""
    try:
        if view is not None:
            view.release()
        mm.close()
    except BufferError:
        # Closing with exported views would leave them dangling (segfault on access);
        # dropping our references unmaps once the last view goes away.
        pass


class Extent:
    """A range of one segment; `size` is rounded up to ALIGN."""

    # A plain class: a frozen dataclass costs ~1 us per transfer to construct.
    __slots__ = ("offset", "segment", "size")

    def __init__(self, segment: Segment, offset: int, size: int) -> None:
        self.segment = segment
        self.offset = offset
        self.size = size


# Release marks: one uint64 per transfer slot in a small segment next to the pool. A
# receiver that is done with a transfer writes its id into the slot; the sender reclaims
# marked extents itself, so a release needs no message back over the Deliver stream.
MARK_SLOTS = 1 << 16
MARKS_SUFFIX = "marks"
# After the marks, the grant table: GRANT_WORDS uint64 per slot, written by the sender for
# each live transfer (and cleared as it is released), read by receivers before they read
# anything (see omnirail/relay/shm.py, "Trust"): the transfer id, the data segment's
# number, the extent's start and end, and the forward tag of the stage that last handed
# the transfer on (0: none).
GRANT_WORDS = 5
GRANT_TID, GRANT_SEGMENT, GRANT_START, GRANT_END, GRANT_FORWARDER = range(GRANT_WORDS)
MARKS_BYTES = MARK_SLOTS * 8 * (1 + GRANT_WORDS)


def grant_index(slot: int) -> int:
    """Index of slot `slot`'s grant in the marks segment's uint64 view."""
    return MARK_SLOTS + GRANT_WORDS * slot


def marks_name(region: str) -> str:
    """The marks segment of the pool that owns data segment `region`."""
    return region.rsplit("-", 1)[0] + "-" + MARKS_SUFFIX


# Names `ShmPool(prefix)` gives its segments, in any process: f"{prefix}-{pid}.{pool}-{n}"
# (data) and f"{prefix}-{pid}.{pool}-marks". Fullmatch only; the numbers are ASCII digits
# (`\d` would take other scripts' digits too), so the prefix is whatever comes before.
_DATA_NAME_RE = re.compile(r"(([A-Za-z0-9_.-]+)-[0-9]{1,10})\.[0-9]{1,10}-([0-9]{1,10})")
_MARKS_NAME_RE = re.compile(rf"([A-Za-z0-9_.-]+)-[0-9]{{1,10}}\.[0-9]{{1,10}}-{MARKS_SUFFIX}")


def data_segment_prefix(name: str) -> str | None:
    """The name prefix of data segment `name`, None when no pool would make that name
    (marks segments included). A receiver maps only data segments of prefixes it trusts."""
    match = _DATA_NAME_RE.fullmatch(name)
    return match.group(2) if match is not None else None


def data_segment_parts(name: str) -> tuple[str, str, int] | None:
    """(prefix, owner, segment number) of data segment `name`, None when no pool would
    make that name. The owner, f"{prefix}-{pid}", is the sending process's shm peer id."""
    match = _DATA_NAME_RE.fullmatch(name)
    if match is None:
        return None
    return match.group(2), match.group(1), int(match.group(3))


def segment_prefix(name: str) -> str | None:
    """The name prefix of a pool's data or marks segment `name` (None: neither)."""
    match = _DATA_NAME_RE.fullmatch(name)
    if match is not None:
        return match.group(2)
    match = _MARKS_NAME_RE.fullmatch(name)
    return match.group(1) if match is not None else None


class _Reaper:
    """atexit hook unlinking a pool's files; an object per pool so unregister is exact."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths
        self.pid = os.getpid()

    def __call__(self) -> None:
        if os.getpid() != self.pid:
            return  # a forked child inherited the hook: the files are its parent's
        for path in self.paths:
            try:
                os.unlink(path)
            except OSError:
                pass
        self.paths.clear()


_pool_ids = itertools.count()


class ShmPool:
    """Segments named f"{prefix}-{pid}.{pool}-{n}", the first `first_bytes`, more added.

    `pool` numbers the pools of one process, so each has its own marks segment
    (f"{prefix}-{pid}.{pool}-marks") even when several share a prefix.
    """

    def __init__(self, prefix: str, first_bytes: int) -> None:
        if not NAME_RE.fullmatch(prefix):
            raise ValueError(f"bad shm name prefix {prefix!r}")
        self.prefix = prefix
        self.first_bytes = max(_round_up(first_bytes, mmap.PAGESIZE), mmap.PAGESIZE)
        self.segments: list[Segment] = []
        self._next = 0
        self._paths: list[str] = []
        self._reaper = _Reaper(self._paths)
        atexit.register(self._reaper)
        self.closed = False
        self._stem = f"{prefix}-{os.getpid()}.{next(_pool_ids)}"
        self._marks_segment = self._create(f"{self._stem}-{MARKS_SUFFIX}", MARKS_BYTES)
        self.marks = np.frombuffer(self._marks_segment.mmap, np.uint64)  # type: ignore[arg-type]

    def alloc(self, nbytes: int) -> Extent:
        size = _round_up(max(nbytes, 1), ALIGN)
        for seg in self.segments:
            off = seg.alloc.alloc(size)
            if off is not None:
                return Extent(seg, off, size)
        # Nothing fits: grow instead of rejecting or waiting (waiting could deadlock when
        # the extents in use belong to transfers that wait on this one).
        step = _SEGMENT_ROUND if self.segments else mmap.PAGESIZE
        seg = self._add_segment(max(self.first_bytes, _round_up(size, step)))
        off = seg.alloc.alloc(size)
        assert off is not None
        return Extent(seg, off, size)

    def free(self, extent: Extent) -> None:
        if not self.closed:
            extent.segment.alloc.free(extent.offset, extent.size)

    def _add_segment(self, size: int) -> Segment:
        while True:
            number = self._next
            name = f"{self._stem}-{number}"
            self._next += 1
            try:
                seg = Segment(name, size, number)
            except FileExistsError:
                # Left over by a dead process with our pid (containers reuse pids): skip.
                continue
            self.segments.append(seg)
            self._paths.append(seg.path)
            return seg

    def _create(self, name: str, size: int) -> Segment:
        try:
            seg = Segment(name, size)
        except FileExistsError:
            # A dead process with our pid left it (containers reuse pids): replace it.
            os.unlink(os.path.join(SHM_DIR, name))
            seg = Segment(name, size)
        self._paths.append(seg.path)
        return seg

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._reaper()
        atexit.unregister(self._reaper)
        for seg in self.segments:
            seg.close()
        self.segments.clear()
        del self.marks
        self._marks_segment.close()


def sweep_segments(prefix: str, pid: int | None = None) -> int:
    """Unlinks /dev/shm files named `prefix-*` (leftovers of killed processes); with
    `pid`, only that process's (`prefix-PID.*`: a stage process that died while the rest
    of the mesh runs on). A receiver that still maps one keeps its bytes."""
    if not prefix or not NAME_RE.fullmatch(prefix):
        raise ValueError(f"bad shm name prefix {prefix!r}")
    start = prefix + "-" if pid is None else f"{prefix}-{int(pid)}."
    removed = 0
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return 0
    for name in names:
        if name.startswith(start):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed += 1
            except OSError:
                pass
    return removed
