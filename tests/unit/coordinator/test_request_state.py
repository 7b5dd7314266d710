"""`State` mirrors the wire's RequestState exactly (it exists only to skip the enum
wrapper's per-attribute Python call)."""

from omnirail.coordinator.requests import State
from omnirail.v1 import common_pb2


def test_state_is_the_wire_enum_as_plain_ints() -> None:
    wire = common_pb2.RequestState
    for name in ("PENDING", "RUNNING", "COMPLETED", "FAILED", "ABORTED"):
        value = getattr(State, name)
        assert type(value) is int and value == wire.Value(name) and State.Name(value) == name
    assert State.values() == wire.values()
