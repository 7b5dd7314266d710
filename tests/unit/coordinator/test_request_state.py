"""`State` mirrors the wire's RequestState exactly (it exists only to skip the enum
wrapper's per-attribute Python call); early aborts; what the table keeps of ended
requests."""

import time

from omnirail.coordinator.requests import EarlyAborts, Ended, RequestRecord, RequestTable, State
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


def _ended(table: RequestTable, rid: str, keep: bool) -> None:
    rec = RequestRecord(rid, ("t",), frozenset({"t"}), deadline=time.time() + 60)
    rec.keep_result = keep
    rec.outputs["t"] = common_pb2.Payload(header=b"x" * 1000)
    seen: list[int] = []
    rec.on_done.append(lambda r: seen.append(len(r.result().outputs)))
    assert table.finish(rec, State.COMPLETED)
    assert seen == [1]  # callbacks see the outputs...
    assert rec.outputs == {}  # ...which the live record then drops


def test_ended_requests_keep_their_state_and_only_submitted_results() -> None:
    table = RequestTable(keep_finished=3)
    _ended(table, "submitted", keep=True)
    _ended(table, "streamed", keep=False)
    kept, dropped = table.get("submitted"), table.get("streamed")
    assert isinstance(kept, Ended) and isinstance(dropped, Ended)
    assert kept.finished and kept.done.is_set()
    assert kept.status().result.outputs["t"].header == b"x" * 1000
    status = dropped.status()
    assert status.state == State.COMPLETED and not status.HasField("result")
    for rid in ("a", "b", "c"):
        _ended(table, rid, keep=False)
    assert table.get("submitted") is None  # bounded: the oldest go
    assert table.counts()["completed"] == 3
