"""EdgeSender: the one send path of an edge (inline or relayed, order per (request, edge),
stream credit with a per-request share and round-robin, release on abort).

A scripted relay (`relay_fakes.ScriptedRelay`) stands in for a real one.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from omnirail.config import StreamConfig
from omnirail.relay.base import Relay, RelayError, create_relay
from omnirail.relay.credits import Credits
from omnirail.stage_service.edge_sender import (
    ChunkCredit,
    EdgeSender,
    EdgeSenders,
    LocalValue,
    Outgoing,
    SentToken,
)
from omnirail.stage_service.edges import EdgeRelay, EdgeRelays
from omnirail.v1 import mesh_pb2
from omnirail.wire.payload import Packed, decode_inline, pack
from tests.unit.stage_service.relay_fakes import ScriptedRelay

INLINE = 1024
BIG = np.zeros(1000)  # 8000 bytes: relayed
META = mesh_pb2.RequestMeta()
TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class Recorder:
    """Router, failure and put hooks, recording what the sender did."""

    def __init__(self) -> None:
        self.items: list[tuple[mesh_pb2.DeliverItem, Any]] = []
        # The value handed over with each item of a local edge (by position in `items`).
        self.local: list[Any] = []
        self.failed: list[tuple[str, BaseException]] = []
        self.puts: list[tuple[Any, str, str, int, bool]] = []
        self.aborted: set[str] = set()

    def deliver(self, item: mesh_pb2.DeliverItem, handle: Any, local: Any = "unset") -> None:
        self.items.append((item, handle))
        self.local.append(local)

    def on_failed(self, rid: str, exc: BaseException) -> None:
        self.failed.append((rid, exc))

    def on_put(
        self, ctx: Any, target: str, backend: str, packed: Packed, put_ns: int, forwarded: bool
    ) -> None:
        self.puts.append((ctx, target, backend, packed.nbytes, forwarded))

    def sent(self, rid: str | None = None) -> list[tuple[str, int, bool, str]]:
        """(request, chunk id, done, body) of the stream items delivered, in order."""
        return [
            (
                i.request_id,
                i.stream.chunk_id,
                i.stream.done,
                i.payload.WhichOneof("body") or "",
            )
            for i, _ in self.items
            if i.HasField("stream") and rid in (None, i.request_id)
        ]

    def handles(self) -> list[Any]:
        return [h for _, h in self.items if h is not None]


def make(
    relay: Relay | None = None,
    *,
    slots: int = 64,
    nbytes: int = 1 << 30,
    per_request: int = 16,
    local: bool = False,
) -> tuple[EdgeSender, ScriptedRelay | Relay, Recorder]:
    relay = relay if relay is not None else ScriptedRelay()
    rec = Recorder()
    sender = EdgeSender(
        "s",
        "t",
        EdgeRelay("s->t", relay, INLINE, local),
        rec.deliver,
        Credits(slots, nbytes, per_request),
        aborted=rec.aborted,
        on_failed=rec.on_failed,
        on_put=rec.on_put,
    )
    return sender, relay, rec


def result(rid: str, value: Any, *, ctx: Any = None, forward: bool = False) -> Outgoing:
    return Outgoing(rid, pack(value), None, META, TRACE, None, ctx, forward)


def chunk(rid: str, cid: int, value: Any, token: SentToken | None = None) -> Outgoing:
    signal = mesh_pb2.StreamSignal(chunk_id=cid, modality="m")
    return Outgoing(rid, pack(value), signal, META, TRACE, token)


def done(rid: str, count: int) -> Outgoing:
    return Outgoing(rid, None, mesh_pb2.StreamSignal(chunk_id=count, done=True), META, TRACE)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


# ---- the inline decision -------------------------------------------------------------


def test_small_payloads_and_payloads_without_tensors_ride_inline() -> None:
    sender, relay, rec = make()
    assert sender.send_now(result("r", {"x": np.arange(4)}))
    assert sender.send_now(result("q", {"text": "x" * 100_000}))  # no tensors: inline
    for item, handle in rec.items:
        assert item.payload.WhichOneof("body") == "inline_data" and handle is None
        assert (item.from_stage, item.to_stage, item.traceparent) == ("s", "t", TRACE)
        assert not item.HasField("stream")
    assert decode_inline(rec.items[0][0].payload)["x"].tolist() == [0, 1, 2, 3]
    assert relay.live == [] and rec.puts == []


def test_large_payloads_go_through_the_relay_with_the_descriptor() -> None:
    sender, _, rec = make()
    req = object()
    assert sender.send_now(result("r", BIG, ctx=req))
    ((item, handle),) = rec.items
    assert item.payload.WhichOneof("body") == "relay"
    assert item.payload.relay == handle.descriptor and handle.how == "nowait"
    assert rec.puts == [(req, "t", "scripted", 8000, False)]


def test_forward_hands_on_received_bytes_else_copies() -> None:
    sender, relay, rec = make()
    out = result("r", BIG, forward=True)
    relay.forwardable.add(id(out.packed))
    assert sender.send_now(out)
    assert sender.send_now(result("q", BIG, forward=True))  # not received bytes: a put
    assert [h.how for h in rec.handles()] == ["forward", "nowait"]
    assert [p[-1] for p in rec.puts] == [True, False]


def test_inline_relay_refuses_an_oversize_payload() -> None:
    sender, _, rec = make(create_relay("inline"))
    with pytest.raises(RelayError, match="exceeds the inline bound 1024"):
        sender.send_now(result("r", BIG))
    assert rec.items == []


async def test_a_result_that_must_wait_is_put_later_then_sent() -> None:
    sender, relay, rec = make()
    relay.free = False
    out = result("r", BIG)
    assert not sender.send_now(out)
    assert rec.items == []
    fired: list[str] = []
    out.token = SentToken("r", 1, fired.append)
    sender.put_later(out)
    await settle()
    assert relay.waiting_puts == 1 and rec.items == [] and fired == []
    relay.gate.set()
    await settle()
    ((item, handle),) = rec.items
    assert handle.how == "put" and item.payload.relay == handle.descriptor
    assert fired == ["r"]


# ---- stream items: credit, order, fairness -------------------------------------------


def test_chunks_hold_stream_credit_until_acked() -> None:
    sender, relay, rec = make()
    sender.stream(chunk("r", 0, "small"))
    sender.stream(chunk("r", 1, BIG))
    sender.stream(done("r", 2))
    assert rec.sent() == [
        ("r", 0, False, "inline_data"),
        ("r", 1, False, "relay"),
        ("r", 2, True, ""),
    ]
    small, big, signal = (h for _, h in rec.items)
    assert isinstance(small, ChunkCredit) and small.handle is None
    assert isinstance(big, ChunkCredit) and big.handle is relay.live[0]
    assert signal is None  # signals take no credit
    assert sender.credits.outstanding("s->t") == (2, small.nbytes + 8000)
    big.release()
    assert relay.live == [] and sender.credits.outstanding("s->t") == (1, small.nbytes)
    small.release()
    small.release()  # idempotent
    assert sender.credits.outstanding("s->t") == (0, 0) and sender.credit.by_request == {}


def test_a_local_edge_hands_values_over_by_reference() -> None:
    """A stage in this process: no packing, no relay, the very object; chunks still hold
    stream credit (counted in chunks) until acked, signals keep their order."""
    sender, relay, rec = make(local=True)
    big = {"x": BIG}
    out = sender.prepare(big)
    assert isinstance(out, LocalValue) and out.value is big
    assert sender.send_now(Outgoing("r", out, None, META, TRACE))
    signal = mesh_pb2.StreamSignal(chunk_id=0, modality="m")
    sender.stream(Outgoing("q", sender.prepare(BIG), signal, META, TRACE))
    sender.stream(done("q", 1))
    assert [i.payload.WhichOneof("body") for i, _ in rec.items] == [None, None, None]
    assert rec.local[0].value is big and rec.local[1].value is BIG and rec.local[2] is None
    assert rec.sent() == [("q", 0, False, ""), ("q", 1, True, "")]
    assert relay.live == [] and rec.puts == []  # nothing went into the relay
    credit = rec.items[1][1]
    assert isinstance(credit, ChunkCredit)
    assert sender.credits.outstanding("s->t") == (1, 0)
    credit.release()
    assert sender.credits.outstanding("s->t") == (0, 0)
    # A remote edge packs, and its router is called without a local value.
    remote, _, rec2 = make()
    assert isinstance(remote.prepare(big), Packed)
    remote.send_now(result("r", {"x": 1}))
    assert rec2.local == ["unset"]


async def test_order_per_request_holds_behind_a_blocked_put() -> None:
    sender, relay, rec = make()
    relay.free = False
    sender.stream(chunk("r1", 0, BIG))  # its put waits
    sender.stream(chunk("r1", 1, "small"))
    sender.stream(done("r1", 2))
    sender.stream(chunk("r2", 0, "small"))  # another request goes on
    sender.stream(done("r2", 1))
    assert rec.sent() == [("r2", 0, False, "inline_data"), ("r2", 1, True, "")]
    assert "r1" in sender.busy and sender.queued() == 2
    await settle()
    relay.gate.set()
    await settle()
    assert rec.sent("r1") == [
        ("r1", 0, False, "relay"),
        ("r1", 1, False, "inline_data"),
        ("r1", 2, True, ""),
    ]
    assert sender.busy == set() and sender.queued() == 0 and sender.waiting == {}


def test_request_share_serves_waiting_requests_round_robin() -> None:
    sender, _, rec = make(slots=2, per_request=1)
    for rid in ("r1", "r2"):
        for cid in range(3):
            sender.stream(chunk(rid, cid, f"{rid}/{cid}"))
        sender.stream(done(rid, 3))
    assert rec.sent() == [("r1", 0, False, "inline_data"), ("r2", 0, False, "inline_data")]
    for released in range(6):
        rec.handles()[released].release()  # oldest first, as an in-order receiver acks
    assert [(r, c, d) for r, c, d, _ in rec.sent()] == [
        ("r1", 0, False),
        ("r2", 0, False),
        ("r1", 1, False),
        ("r2", 1, False),
        ("r1", 2, False),
        ("r1", 3, True),
        ("r2", 2, False),
        ("r2", 3, True),
    ]
    assert sender.credits.outstanding("s->t") == (0, 0)


def test_a_new_request_takes_credit_a_capped_one_cannot() -> None:
    sender, _, rec = make(slots=4, per_request=2)
    for cid in range(4):
        sender.stream(chunk("long", cid, cid))
    sender.stream(chunk("short", 0, 0))
    assert [(r, c) for r, c, _, _ in rec.sent()] == [("long", 0), ("long", 1), ("short", 0)]
    assert sender.credit.by_request == {"long": 2, "short": 1}


def test_byte_credit_blocks_until_released_and_an_oversize_chunk_goes_alone() -> None:
    sender, _, rec = make(nbytes=10_000, per_request=8)
    sender.stream(chunk("r", 0, BIG))
    sender.stream(chunk("r", 1, BIG))  # 16000 bytes > 10000: waits
    assert len(rec.items) == 1
    rec.handles()[0].release()
    assert len(rec.items) == 2
    sender.stream(chunk("q", 0, np.zeros(5000)))  # 40000 bytes: waits for an idle edge
    assert len(rec.items) == 2
    rec.handles()[1].release()
    assert [(r, c) for r, c, _, _ in rec.sent()] == [("r", 0), ("r", 1), ("q", 0)]


def test_tokens_count_sent_copies() -> None:
    sender, _, rec = make(slots=1)
    fired: list[str] = []
    token = SentToken("r", 2, fired.append)
    sender.stream(chunk("r", 0, "a", token))
    assert fired == []
    sender.stream(chunk("r", 1, "b", token))  # waits for credit
    assert fired == []
    rec.handles()[0].release()
    assert fired == ["r"]


# ---- failures and aborts ---------------------------------------------------------------


async def test_abort_drops_waiting_items_and_stops_puts_releasing_credit() -> None:
    sender, relay, rec = make(slots=8, per_request=8)
    relay.free = False
    fired: list[str] = []
    token = SentToken("r", 2, fired.append)
    sender.stream(chunk("r", 0, BIG, token))  # put waits
    sender.stream(chunk("r", 1, "small", token))  # queued behind it
    sender.stream(done("r", 2))
    res = result("r", BIG)
    assert not sender.send_now(res)
    res_fired: list[str] = []
    res.token = SentToken("r", 1, res_fired.append)
    sender.put_later(res)
    await settle()
    assert relay.waiting_puts == 2
    assert sender.credits.outstanding("s->t") == (1, 8000)
    rec.aborted.add("r")
    sender.forget("r")
    await settle()
    assert relay.cancelled_puts == 2 and relay.waiting_puts == 0
    assert sender.credits.outstanding("s->t") == (0, 0) and sender.credit.by_request == {}
    assert sender.busy == set() and sender.waiting == {}
    assert fired == ["r"]  # dropped chunks count as gone for the scheduler's outbox
    assert res_fired == []  # a result's token fires only on a send
    assert rec.items == [] and rec.failed == []


async def test_a_put_finishing_after_abort_is_released_unsent() -> None:
    sender, relay, rec = make()
    relay.free = False
    sender.stream(chunk("r", 0, BIG))
    await settle()
    relay.gate.set()
    rec.aborted.add("r")  # aborted, but the put is already done waiting
    await settle()
    assert rec.items == [] and relay.live == []
    assert sender.credits.outstanding("s->t") == (0, 0) and sender.busy == set()


async def test_abort_before_the_put_starts() -> None:
    sender, relay, rec = make()
    relay.free = False
    sender.stream(chunk("r", 0, BIG))
    sender.forget("r")  # before the task ever ran
    await settle()
    assert sender.credits.outstanding("s->t") == (0, 0) and sender.busy == set()
    assert relay.waiting_puts == 0 and rec.items == []


async def test_a_failed_put_fails_the_request_and_frees_the_edge() -> None:
    sender, relay, rec = make(slots=1)
    relay.free = False
    relay.fail = RelayError("pool gone")
    fired: list[str] = []
    sender.stream(chunk("r", 0, BIG, SentToken("r", 1, fired.append)))
    sender.stream(chunk("q", 0, "small"))  # waits for the edge's one slot
    relay.gate.set()
    await settle()
    assert [(rid, str(exc)) for rid, exc in rec.failed] == [("r", "pool gone")]
    assert fired == ["r"]
    assert rec.sent() == [("q", 0, False, "inline_data")]  # the slot came back


def test_a_chunk_that_cannot_be_sent_fails_its_request() -> None:
    sender, _, rec = make(create_relay("inline"))
    fired: list[str] = []
    sender.stream(chunk("r", 0, BIG, SentToken("r", 1, fired.append)))
    ((rid, exc),) = rec.failed
    assert rid == "r" and isinstance(exc, RelayError)
    assert fired == ["r"] and rec.items == []
    assert sender.credits.outstanding("s->t") == (0, 0)


async def test_close_drops_what_waits_and_stops_puts() -> None:
    sender, relay, rec = make(slots=1)
    relay.free = False
    fired: list[str] = []
    sender.stream(chunk("r", 0, BIG, SentToken("r", 1, fired.append)))
    sender.stream(chunk("q", 0, "x", SentToken("q", 1, fired.append)))
    await settle()
    await sender.close()
    assert sorted(fired) == ["q", "r"]
    assert relay.cancelled_puts == 1 and rec.items == []
    assert sender.credits.outstanding("s->t") == (0, 0)


# ---- one sender per edge --------------------------------------------------------------


def test_senders_are_made_per_target_with_the_edge_relay() -> None:
    relay = ScriptedRelay()
    rec = Recorder()
    senders = EdgeSenders(
        "s",
        EdgeRelays("s", relay, 4096),
        rec.deliver,
        aborted=rec.aborted,
        on_failed=rec.on_failed,
        stream=StreamConfig(credits=3, credit_mb=1, request_credits=2),
    )
    t, u = senders["t"], senders["u"]
    assert senders["t"] is t and t is not u
    assert (t.name, t.relay, t.inline_bytes) == ("s->t", relay, 4096)
    assert t.credits is u.credits and t.credit is not u.credit
    assert (t.credit.max_slots, t.credit.max_bytes, t.credit.max_request) == (3, 1 << 20, 2)
