"""The one replica rule every sender and the coordinator share."""

from __future__ import annotations

import zlib

import pytest

from omnirail.wire.routing import conversation_index, replica_for, replica_index, route_index


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


def test_a_conversation_stays_where_it_is_when_another_replica_goes() -> None:
    names = [f"unix:///run/thinker-{i}.sock" for i in range(4)]
    conversations = [f"conv-{i}" for i in range(400)]
    home = {c: names[conversation_index(c, names)] for c in conversations}
    assert len(set(home.values())) == 4  # spread over all of them
    lost = names[1]
    left = [n for n in names if n != lost]
    for c in conversations:
        now = left[conversation_index(c, left)]
        # Only the lost replica's conversations move.
        assert now == home[c] or home[c] == lost
    # A request with a conversation routes by it; one without by its id.
    assert route_index("r1", "conv-3", names) == conversation_index("conv-3", names)
    assert route_index("r1", "", names) == replica_index("r1", 4)
    with pytest.raises(ValueError):
        conversation_index("c", [])
