"""The shm receiver's mapping cache: one mapping per file while it is the same file, checks
on the open file before anything is mapped, and nothing kept of a sender that is gone."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from omnirail.relay.base import RelayError
from omnirail.relay.shm_maps import SegmentMaps
from omnirail.relay.shm_pool import MARK_SLOTS, MARKS_BYTES, SHM_DIR


def mapped(path: Path) -> bool:
    """Whether this process maps the file at `path` (a line of /proc/self/maps names it)."""
    return str(path) in Path("/proc/self/maps").read_text()


@pytest.fixture
def name() -> Iterator[str]:
    base = f"omnirail-test-maps-{uuid.uuid4().hex[:8]}"
    yield base
    for p in Path(SHM_DIR).glob(base + "*"):
        p.unlink()


def write(name: str, data: bytes) -> Path:
    path = Path(SHM_DIR) / name
    tmp = path.with_name(name + ".tmp")
    tmp.write_bytes(data)
    tmp.chmod(0o600)  # as pools make them: receivers map no segment others may access
    os.replace(tmp, path)  # a new inode, as a restarted sender's segment has
    return path


def test_a_file_is_mapped_once_while_it_is_the_same_file(name: str) -> None:
    maps = SegmentMaps()
    path = write(name, b"a" * 4096)
    first, fresh = maps.open(name, end=4096)
    assert fresh and bytes(first.view[:2]) == b"aa" and first.view.readonly
    maps.cache(name, first)
    again, fresh = maps.open(name, end=10)
    assert again is first and not fresh
    assert maps.still_current(name, first)

    write(name, b"b" * 8192)  # the sender restarted under the same name
    assert not maps.still_current(name, first)
    second, fresh = maps.open(name, end=8192)
    assert fresh and bytes(second.view[:2]) == b"bb"
    maps.cache(name, second)  # drops (unmaps) the first
    assert maps.mapped == {name: second}
    maps.close()
    assert maps.mapped == {} and not mapped(path)


def test_a_gone_file_is_an_error_and_forgets_what_was_mapped(name: str) -> None:
    maps = SegmentMaps()
    path = write(name, b"a" * 4096)
    mapping, _ = maps.open(name, end=1)
    maps.cache(name, mapping)
    path.unlink()
    with pytest.raises(RelayError, match="does not exist"):
        maps.still_current(name, mapping)
    assert maps.mapped == {}


def test_marks_are_mapped_writable_as_uint64_slots(name: str) -> None:
    maps = SegmentMaps()
    write(name, bytes(MARKS_BYTES))
    marks, _ = maps.open(name, writable=True)
    # The release marks, then the grant table.
    assert marks.writable and marks.marks is not None and len(marks.marks) == MARKS_BYTES // 8
    assert len(marks.marks) > MARK_SLOTS
    marks.marks[3] = 7
    assert int.from_bytes((Path(SHM_DIR) / name).read_bytes()[24:32], "little") == 7
    marks.unmap()


@pytest.mark.parametrize(
    ("content", "writable", "end", "problem"),
    [
        (b"", False, 0, "has a bad size \\(0\\)"),
        (b"x" * 64, True, 0, "has a bad size \\(64\\)"),
        (b"x" * 64, False, 65, "its bytes end at 65 \\(size 64\\)"),
    ],
)
def test_a_file_that_cannot_serve_is_refused_before_it_is_mapped(
    name: str, content: bytes, writable: bool, end: int, problem: str
) -> None:
    maps = SegmentMaps()
    path = write(name, content)
    with pytest.raises(RelayError, match=problem):
        maps.open(name, writable=writable, end=end)
    assert maps.mapped == {} and not mapped(path)


@pytest.mark.parametrize("mode", [0o644, 0o660, 0o606, 0o666])
def test_a_segment_others_may_access_is_refused_before_it_is_mapped(name: str, mode: int) -> None:
    """Pools make their files owner-only: one that group or others may access could be
    changed (its grants too) under a reader."""
    path = write(name, b"a" * 4096)
    path.chmod(mode)
    maps = SegmentMaps()
    with pytest.raises(RelayError, match=f"is not owner-only \\(mode {mode:o}\\)"):
        maps.open(name, end=1)
    assert maps.mapped == {} and not mapped(path)


def test_what_is_not_a_regular_file_is_refused(name: str) -> None:
    os.mkfifo(Path(SHM_DIR) / name)
    with pytest.raises(RelayError, match="is not a regular file"):
        SegmentMaps().open(name)
    os.symlink("/etc/hostname", Path(SHM_DIR) / (name + "-link"))
    with pytest.raises(RelayError, match="is not a regular file"):
        SegmentMaps().open(name + "-link")
