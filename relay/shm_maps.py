"""The `shm` relay receiver's mappings of senders' segments, cached by name.

A receiver maps each sender's data segment (read-only) and its release-marks segment
(read-write) once, and keeps them while the file is the same one: a sender that restarted
creates a new file under the same name (another inode), and a sender that is gone leaves
none. `SegmentMaps` opens, caches, checks and drops those mappings; which names a receiver
may map at all (its own prefix, announced and trusted ones) is `ShmRelay`'s decision,
made before anything here is called.

Every check on a file happens on the open descriptor before it is mapped (a regular file,
of the size a descriptor needs or exactly the marks' slots), so a descriptor can never make
the receiver map (and keep) address space for bytes that are not there.
"""

from __future__ import annotations

import mmap
import os
import stat
from dataclasses import dataclass

import numpy as np

from omnirail.relay.base import RelayError, shown
from omnirail.relay.shm_pool import MARKS_BYTES, SHM_DIR, close_mapping

__all__ = ["Mapping", "SegmentMaps", "outside"]


def outside(name: str, end: int, size: int) -> RelayError:
    return RelayError(
        f"descriptor points outside segment {shown(name)}: its bytes end at {end} (size {size})"
    )


@dataclass(slots=True)
class Mapping:
    mmap: mmap.mmap
    view: memoryview
    dev: int
    ino: int
    size: int
    # A marks segment: its uint64 view. A data segment: the view of its pool's marks.
    marks: memoryview | None = None
    addr: int = 0  # where the mapping starts in this process (data segments)
    # A data segment's sending process (its shm peer id) and number in its pool.
    owner: str = ""
    number: int = -1

    def same_file(self, st: os.stat_result) -> bool:
        """Whether `st` is the file this maps (not a restarted sender's new one)."""
        return st.st_ino == self.ino and st.st_dev == self.dev

    @property
    def writable(self) -> bool:
        """A release-marks segment (data segments are mapped read-only)."""
        return not self.view.readonly

    def unmap(self) -> None:
        """Unmaps a mapping that never entered the cache (a refused get): nothing but the
        mapping's own views can reference it yet, so the unmap happens now."""
        if self.writable and self.marks is not None:
            self.marks.release()  # a data mapping's marks belong to its pool's mapping
        self.marks = None
        close_mapping(self.mmap, self.view)


class SegmentMaps:
    """Segment name -> its cached `Mapping` (`mapped`), with the opening and pruning
    around it."""

    def __init__(self) -> None:
        self.mapped: dict[str, Mapping] = {}

    def still_current(self, name: str, mapping: Mapping) -> bool:
        """Whether the cached mapping is still the file named `name` (not a restarted
        sender's new one); one lstat, the only syscall on the cached path."""
        return mapping.same_file(self._lstat(name))

    def open(self, name: str, writable: bool = False, end: int = 0) -> tuple[Mapping, bool]:
        """(mapping of segment `name`, whether it is new): the cached one while the file
        is the same, else a new one that the caller caches (or unmaps) itself. A data
        segment must hold `end` bytes, a marks segment exactly its slots; the size is
        checked on the open file before anything is mapped."""
        st = self._lstat(name)
        cached = self.mapped.get(name)
        if cached is not None and cached.same_file(st):
            return cached, False
        # New segment or sender restart: also forget mappings of senders that are gone, or
        # a long-lived receiver would pin every dead pool's memory.
        self.prune()
        if not stat.S_ISREG(st.st_mode):
            raise RelayError(f"shm segment {shown(name)} is not a regular file")
        # O_NONBLOCK: should the name turn into a FIFO after the lstat, open must not
        # wait for a writer (fstat refuses it below); it changes nothing for a file.
        flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            fd = os.open(os.path.join(SHM_DIR, name), flags | os.O_CLOEXEC)
        except OSError as e:
            raise RelayError(f"cannot open shm segment {shown(name)}: {e}") from None
        try:
            st = os.fstat(fd)
            size = st.st_size
            if not stat.S_ISREG(st.st_mode):
                raise RelayError(f"shm segment {shown(name)} is not a regular file")
            if st.st_mode & 0o077:
                # Pools make their files owner-only: one that others may write could
                # change (grants included) under a reader.
                raise RelayError(
                    f"shm segment {shown(name)} is not owner-only "
                    f"(mode {stat.S_IMODE(st.st_mode):o})"
                )
            if writable and size != MARKS_BYTES:
                raise RelayError(f"shm segment {shown(name)} has a bad size ({size})")
            if not writable and size == 0:
                raise RelayError(f"shm segment {shown(name)} has a bad size (0)")
            if end > size:
                # Before mapping: a descriptor must not make the receiver map (and keep)
                # address space for bytes that are not there.
                raise outside(name, end, size)
            prot = mmap.PROT_READ | mmap.PROT_WRITE if writable else mmap.PROT_READ
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
        except (OSError, ValueError, OverflowError) as e:
            raise RelayError(f"cannot map shm segment {shown(name)}: {e}") from None
        finally:
            os.close(fd)
        view = memoryview(mm)
        mapping = Mapping(mm, view, st.st_dev, st.st_ino, size)
        if writable:
            mapping.marks = view.cast("Q")
        else:
            mapping.addr = np.frombuffer(view, np.uint8).ctypes.data
        return mapping, True

    def cache(self, name: str, mapping: Mapping) -> None:
        self.drop(name)  # the sender restarted under the same name
        self.mapped[name] = mapping

    def drop(self, name: str) -> None:
        mapping = self.mapped.pop(name, None)
        if mapping is not None:
            # Views still held stay valid: the unmap waits for the last of them.
            close_mapping(mapping.mmap, mapping.view)

    def prune(self) -> None:
        """Drops the mappings whose file is gone or is another one now."""
        for name, mapping in list(self.mapped.items()):
            try:
                st = os.lstat(os.path.join(SHM_DIR, name))
            except OSError:
                self.drop(name)
                continue
            if not mapping.same_file(st):
                self.drop(name)

    def close(self) -> None:
        for name in list(self.mapped):
            self.drop(name)

    def _lstat(self, name: str) -> os.stat_result:
        try:
            return os.lstat(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            self.prune()  # the sender is gone: forget its segments and marks
            raise RelayError(f"shm segment {shown(name)} does not exist (sender gone?)") from None
        except OSError as e:
            raise RelayError(f"cannot stat shm segment {shown(name)}: {e}") from None
