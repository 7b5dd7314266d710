"""omnirail.relay.copy: how large copies are split across threads, and that every byte lands."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

from omnirail.relay.copy import _MIN_PART, _PART_ALIGN, DEFAULT_COPY_THREADS, Copier, split_parts
from omnirail.relay.options import CopyOptions, OptionsError, parse_options
from omnirail.wire.payload import pack

MiB = 1 << 20


def test_small_payloads_are_one_part():
    assert split_parts(0, 4) == [(0, 0)]
    assert split_parts(_MIN_PART * 2 - 1, 4) == [(0, _MIN_PART * 2 - 1)]
    assert split_parts(64 * MiB, 1) == [(0, 64 * MiB)]


def test_large_payloads_split_into_aligned_parts_that_cover_them():
    n = 64 * MiB + 12345
    for threads in (2, 3, 4):
        parts = split_parts(n, threads)
        assert len(parts) == threads
        assert parts[0][0] == 0 and parts[-1][1] == n
        for (_, hi), (lo, _) in itertools.pairwise(parts):
            assert hi == lo and lo % _PART_ALIGN == 0
        assert all(hi - lo >= _MIN_PART for lo, hi in parts)
    # Never more parts than _MIN_PART-sized pieces.
    assert len(split_parts(3 * _MIN_PART, 8)) == 3


@pytest.mark.parametrize(
    "options, match",
    [
        ({"copy_threads": 0}, "copy_threads: input should be greater than or equal to 1"),
        ({"copy_threads": "2"}, "copy_threads: input should be a valid integer"),
        ({"copy_threads": True}, "copy_threads: input should be a valid integer"),
        ({"copy_thread_bytes": -1}, "copy_thread_bytes: input should be greater than or equal"),
        ({"copy_thread_bytes": 1.5}, "copy_thread_bytes: input should be a valid integer"),
    ],
)
def test_bad_options_are_refused_by_name(options, match):
    with pytest.raises(OptionsError, match=match):
        parse_options("shm", CopyOptions, options)


def test_defaults():
    copier = Copier(CopyOptions())
    assert copier.threads == DEFAULT_COPY_THREADS and copier.thread_bytes == 8 * MiB
    copier.close()


def _payload(nbytes: int):
    # Several tensors, so the part boundary falls inside one of them and between others.
    rng = np.random.default_rng(0)
    first = rng.integers(0, 255, nbytes // 3, dtype=np.uint8)
    second = rng.integers(0, 1 << 30, (nbytes - first.size) // 4, dtype=np.int32)
    return pack({"first": first, "tail": [second, np.arange(7, dtype=np.int16)]})


@pytest.mark.parametrize("threads", [1, 2, 3])
async def test_threaded_copy_writes_every_byte(threads):
    packed = _payload(13 * MiB + 77)
    copier = Copier(CopyOptions(copy_threads=threads))
    target = np.full(packed.nbytes, 0xAB, np.uint8)
    try:
        await copier.start(packed, target)
    finally:
        copier.close()
    expected = np.full(packed.nbytes, 0xAB, np.uint8)
    packed.write_into(expected)
    assert np.array_equal(target, expected)


async def test_copies_at_once_share_the_helpers_and_still_copy_after_close():
    packed = _payload(9 * MiB)
    copier = Copier(CopyOptions(copy_threads=2))
    targets = [np.zeros(packed.nbytes, np.uint8) for _ in range(4)]
    await asyncio.gather(*(copier.start(packed, t) for t in targets))
    copier.close()
    late = np.zeros(packed.nbytes, np.uint8)
    await copier.start(packed, late)  # one thread now
    expected = np.zeros(packed.nbytes, np.uint8)
    packed.write_into(expected)
    assert all(np.array_equal(t, expected) for t in [*targets, late])


async def test_a_copy_into_a_too_small_target_raises():
    packed = _payload(9 * MiB)
    copier = Copier(CopyOptions(copy_threads=2))
    small = np.zeros(packed.nbytes - 1, np.uint8)  # too small: every part refuses it
    with pytest.raises(Exception, match="smaller than"):
        await copier.start(packed, small)
    copier.close()
