"""`State` mirrors the wire's RequestState exactly (it exists only to skip the enum
wrapper's per-attribute Python call)."""

import time

from omnirail.coordinator.requests import EarlyAborts, State
from omnirail.v1 import common_pb2


def test_state_is_the_wire_enum_as_plain_ints() -> None:
    wire = common_pb2.RequestState
    for name in ("PENDING", "RUNNING", "COMPLETED", "FAILED", "ABORTED"):
        value = getattr(State, name)
        assert type(value) is int and value == wire.Value(name) and State.Name(value) == name
    assert State.values() == wire.values()


def test_early_aborts_are_remembered_once_for_a_while_and_bounded() -> None:
    early = EarlyAborts(ttl_s=0.2, limit=2)
    early.add("a", "why a")
    assert early.take("a") == "why a"
    assert early.take("a") is None  # once
    early.add("b", "")
    early.add("c", "")
    early.add("d", "")  # past the limit: the oldest goes
    assert early.take("b") is None and early.take("c") == ""
    early.add("e", "late")
    time.sleep(0.3)
    assert early.take("e") is None  # expired
