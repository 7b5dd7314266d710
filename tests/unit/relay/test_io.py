"""omnirail.relay.io: the inline/relay decision and decoding with release on every path.

Sending (the decision, then a put and the message) is the edge sender's and tested with
it (tests/unit/stage_service/test_edge_sender.py); here a relayed payload is made by hand.
"""

from __future__ import annotations

import os
import uuid

import msgpack
import numpy as np
import pytest
import torch

from omnirail.relay.base import Received, RelayError, RelaySettings, create_relay
from omnirail.relay.io import (
    ReceivedPayload,
    decode_inline,
    encode_inline,
    inline_if_small,
    receive_payload,
    relayed_payload,
)
from omnirail.relay.shm import ShmRelay, sweep_segments
from omnirail.relay.shm_pool import SHM_DIR
from omnirail.v1 import common_pb2
from omnirail.wire.payload import PayloadError, pack

INLINE = 64 << 10


async def relayed(value, relay, *, edge: str = "e"):
    """`value` put into `relay`: its Payload (with the descriptor) and the handle."""
    packed = pack(value)
    handle = await relay.put(packed, "r", edge)
    return relayed_payload(packed, handle), handle


@pytest.fixture
def shm():
    prefix = f"ortest{uuid.uuid4().hex[:10]}"
    relay = create_relay("shm", RelaySettings(name_prefix=prefix, pool_bytes=1 << 20))
    yield relay
    relay.close()
    left = [n for n in os.listdir(SHM_DIR) if n.startswith(prefix + "-")]
    sweep_segments(prefix)
    assert not left


async def test_small_payload_travels_inline(shm):
    value = {"ids": [1, 2, 3], "x": torch.arange(10)}
    pb = inline_if_small(pack(value), shm, INLINE)
    assert pb is not None and pb.WhichOneof("body") == "inline_data"
    assert shm.outstanding("a->b") == (0, 0)
    wire = common_pb2.Payload.FromString(pb.SerializeToString())
    received = await receive_payload(wire, {"shm": shm})
    assert received.value["ids"] == [1, 2, 3]
    assert received.value["x"].tolist() == list(range(10))
    received.release()


async def test_large_payload_goes_through_shm(shm):
    value = {"x": torch.arange(100_000, dtype=torch.float32), "meta": ("a", 1)}
    assert inline_if_small(pack(value), shm, INLINE) is None
    pb, handle = await relayed(value, shm, edge="a->b")
    assert pb.WhichOneof("body") == "relay"
    assert pb.relay == handle.descriptor and not pb.inline_data
    wire = common_pb2.Payload.FromString(pb.SerializeToString())
    received = await receive_payload(wire, {"shm": shm})
    assert received.value["meta"] == ("a", 1)
    assert torch.equal(received.value["x"], value["x"])
    received.release()
    received.release()  # idempotent
    handle.release()
    assert shm.outstanding("a->b") == (0, 0)


async def test_copy_true_outlives_release(shm):
    value = np.arange(50_000, dtype=np.int64)
    pb, handle = await relayed(value, shm)
    received = await receive_payload(pb, {"shm": shm}, copy=True)
    handle.release()
    received.release()
    # The extent may be reused now; the copy is unaffected.
    pb2, handle2 = await relayed(value * 0, shm)
    assert pb2.relay.offset == pb.relay.offset
    assert received.value.flags.writeable and received.value[-1] == 49_999
    handle2.release()


async def test_payload_without_tensors_is_always_inline(shm):
    value = {"text": "x" * 200_000}
    pb = inline_if_small(pack(value), shm, 0)
    assert pb is not None and pb.WhichOneof("body") == "inline_data"
    assert (await receive_payload(pb, {})).value == value


async def test_inline_backend_refuses_large_payloads():
    relay = create_relay("inline")
    small = inline_if_small(pack(np.ones(10)), relay, 1024)
    assert small is not None
    with pytest.raises(
        RelayError,
        match=r"payload of 8000 bytes exceeds the inline bound 1024; "
        r"configure a relay backend such as shm",
    ):
        inline_if_small(pack(np.ones(1000)), relay, 1024)
    with pytest.raises(RelayError):
        await relay.put(pack(np.ones(10)), "r", "e")
    with pytest.raises(RelayError):
        await relay.get(common_pb2.RelayDescriptor(backend="inline"))
    relay.cleanup("r")
    relay.close()
    assert (await receive_payload(small, {"inline": relay})).value.tolist() == [1.0] * 10


async def test_unknown_backend(shm):
    pb = common_pb2.Payload(
        header=pack(np.ones(4)).header, relay=common_pb2.RelayDescriptor(backend="nixl")
    )
    with pytest.raises(RelayError, match=r"'nixl'.*have: shm"):
        await receive_payload(pb, {"shm": shm})


class CountingRelay(ShmRelay):
    """Counts the views handed out and returned."""

    def __init__(self, inner: ShmRelay) -> None:
        self.inner = inner
        self.open_views = 0

    async def get(self, descriptor, owners=None):
        received = await self.inner.get(descriptor, owners)
        outer = self

        class Counted(Received):
            buffer = received.buffer

            def release(self) -> None:
                outer.open_views -= 1
                received.release()

        self.open_views += 1
        return Counted()


async def test_errors_release_the_view(shm):
    counting = CountingRelay(shm)
    relays = {"shm": counting}
    pb, handle = await relayed(np.ones(1000), shm)

    bad_header = common_pb2.Payload(header=b"\xc1garbage", relay=pb.relay)
    with pytest.raises(PayloadError):
        await receive_payload(bad_header, relays)
    assert counting.open_views == 0

    # A header whose tensor lies past the bytes the descriptor names.
    lying = msgpack.packb(
        [1, 8, msgpack.ExtType(1, msgpack.packb(["numpy", "float64", [1], 8000, 8]))]
    )
    with pytest.raises(PayloadError, match="outside the buffer"):
        await receive_payload(common_pb2.Payload(header=lying, relay=pb.relay), relays)
    assert counting.open_views == 0

    short = common_pb2.RelayDescriptor()
    short.CopyFrom(pb.relay)
    short.nbytes = 8
    with pytest.raises(PayloadError):
        await receive_payload(common_pb2.Payload(header=pb.header, relay=short), relays)
    assert counting.open_views == 0

    outside = common_pb2.RelayDescriptor()
    outside.CopyFrom(pb.relay)
    outside.offset = 1 << 30
    with pytest.raises(RelayError):
        await receive_payload(common_pb2.Payload(header=pb.header, relay=outside), relays)
    assert counting.open_views == 0

    ok = await receive_payload(pb, relays)
    assert counting.open_views == 1
    with ok:
        assert ok.value.sum() == 1000
    assert counting.open_views == 0
    handle.release()


def test_received_payload_without_relay():
    rp = ReceivedPayload(5)
    rp.release()
    rp.release()
    assert rp.value == 5


def test_inline_helpers_reexported():
    pb = encode_inline({"a": np.arange(3)})
    assert decode_inline(pb)["a"].tolist() == [0, 1, 2]
