"""The one replica rule every sender and the coordinator share."""

from __future__ import annotations

import zlib

import pytest

from omnirail.wire.routing import replica_for, replica_index


def test_the_index_is_crc32_of_the_id_mod_n_and_stable() -> None:
    for rid in ["r1", "r1#0badf00d", "x" * 200, "é"]:
        for n in (1, 2, 3, 7):
            assert replica_index(rid, n) == zlib.crc32(rid.encode()) % n
            assert replica_for(rid, list(range(n))) == replica_index(rid, n)


def test_no_replicas_is_an_error_not_a_division_by_zero() -> None:
    with pytest.raises(ValueError, match="no replicas"):
        replica_index("r1", 0)
    with pytest.raises(ValueError, match="no replicas"):
        replica_for("r1", [])


def test_ids_spread_over_the_replicas() -> None:
    counts = [0, 0, 0]
    for i in range(3000):
        counts[replica_index(f"req-{i}", 3)] += 1
    assert min(counts) > 800, counts
