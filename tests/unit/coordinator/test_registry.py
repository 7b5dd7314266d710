"""StageRegistry.pick: the entry replica for a new request, by the pipeline's `balance`."""

from __future__ import annotations

import pytest

from omnirail.coordinator.registry import Replica, StageRegistry


def registry(balance: str, n: int = 3) -> tuple[StageRegistry, list[Replica]]:
    reg = StageRegistry(["a"], balance)
    reps = [Replica("a", f"r{i}", f"addr{i}", pid=i) for i in range(n)]
    for rep in reps:
        reg.add(rep)
    return reg, reps


def test_least_outstanding_takes_the_replica_with_fewest_live_requests() -> None:
    reg, reps = registry("least_outstanding")
    reps[0].assigned, reps[1].assigned, reps[2].assigned = 4, 1, 3
    assert reg.pick("a", "any") is reps[1]
    # Filling up evenly: 30 new requests land 10 on each.
    for rep in reps:
        rep.assigned = 0
    for i in range(30):
        reg.pick("a", f"req-{i}").assigned += 1  # type: ignore[union-attr]
    assert [r.assigned for r in reps] == [10, 10, 10]


def test_round_robin_and_request_id() -> None:
    reg, reps = registry("round_robin")
    picked = [reg.pick("a", "same") for _ in range(6)]
    assert {id(p) for p in picked} == {id(r) for r in reps} and picked[0] is picked[3]
    reg, reps = registry("request_id")
    reps[0].assigned = 100  # load does not matter: the id decides
    assert len({id(reg.pick("a", "same")) for _ in range(5)}) == 1


def test_no_replica_and_a_bad_policy() -> None:
    assert StageRegistry(["a"]).pick("a", "x") is None
    with pytest.raises(ValueError, match="balance must be one of"):
        StageRegistry(["a"], "random")


def test_the_topology_lists_each_registrations_token_digest_never_the_token() -> None:
    """Member tokens (omnirail/transport/members.py): one per registration, their digests
    in the topology, draining replicas listed apart (they still deliver), the coordinator's
    own digest too."""
    from omnirail.transport.members import token_digest

    reg, reps = registry("least_outstanding", 2)
    reps[1].draining = True
    topo = reg.topology()
    (routed,) = topo.stages["a"].endpoints
    (draining,) = topo.draining["a"].endpoints
    assert routed.replica_id == "r0" and draining.replica_id == "r1"
    assert routed.member_digest == token_digest(reps[0].member_token)
    assert draining.member_digest == token_digest(reps[1].member_token)
    assert reps[0].member_token != reps[1].member_token and len(reps[0].member_token) == 32
    assert topo.coordinator_digest == token_digest(reg.credentials.token)
    wire = topo.SerializeToString()
    for token in (reps[0].member_token, reps[1].member_token, reg.credentials.token):
        assert token not in wire
        assert repr(token) not in repr(reps) + repr(reg.credentials)
    assert "member_token" not in repr(reps[0]) and "token" not in repr(reg.credentials)
