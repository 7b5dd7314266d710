"""shm relay forwarding: a stage hands a received view on instead of copying it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnirail.relay.base import RelayError, RelaySettings, create_relay
from omnirail.relay.shm import ShmForward, ShmRelay
from omnirail.wire.payload import pack, unpack
from tests.unit.relay import test_shm as shm_tests

# The shm tests' fixtures: segments under a fresh prefix, relays closed and swept after.
prefix = shm_tests.prefix
make_relay = shm_tests.make_relay
MiB = shm_tests.MiB


async def _hop(sender: ShmRelay, middle: ShmRelay, value, rid: str = "r"):
    """`value` put by `sender` and read by `middle`: (sender handle, middle's view)."""
    packed = pack(value)
    handle = await sender.put(packed, rid, "a->b")
    received = await middle.get(handle.descriptor)
    return handle, received, unpack(packed.header, received.buffer)


async def test_a_received_tensor_is_forwarded_and_released_by_the_last_reader(make_relay):
    source, middle, sink = make_relay(), make_relay(), make_relay()
    data = torch.arange(MiB // 4, dtype=torch.int32)
    handle, held, value = await _hop(source, middle, data)
    forward = middle.forward_nowait(pack(value), "r", "b->c")
    assert isinstance(forward, ShmForward) and not forward.acked_in_band
    assert forward.descriptor.region == handle.descriptor.region
    assert forward.descriptor.offset == handle.descriptor.offset
    assert forward.descriptor.transfer_id == handle.descriptor.transfer_id
    assert middle.outstanding("b->c") == (0, 0)  # no credit: the original transfer's counts
    assert middle._pool is None  # nothing was copied: the middle has no pool at all
    final = await sink.get(forward.descriptor)
    assert torch.equal(unpack(pack(value).header, final.buffer), data)
    held.release()  # the middle is done: this no longer returns the bytes
    source.reclaim()
    assert not handle.released and source.outstanding("a->b")[0] == 1
    final.release()  # the last reader's mark goes to the source
    source.reclaim()
    assert handle.released and source.outstanding("a->b") == (0, 0)
    forward.release()  # too late to mark anything: a no-op


async def test_a_forward_released_before_the_view_hands_the_bytes_back(make_relay):
    source, middle = make_relay(), make_relay()
    handle, held, value = await _hop(source, middle, np.ones(8192, np.uint8))
    forward = middle.forward_nowait(pack(value), "r", "b->c")
    assert forward is not None
    forward.release()  # e.g. the delivery failed: nobody downstream will mark
    source.reclaim()
    assert handle.released
    held.release()  # idempotent: no second mark, no error


async def test_cleanup_of_the_request_returns_forwards_still_answered_for(make_relay):
    source, middle = make_relay(), make_relay()
    h1, held1, v1 = await _hop(source, middle, np.ones(8192, np.uint8), "r1")
    h2, held2, v2 = await _hop(source, middle, np.ones(8192, np.uint8), "r2")
    assert middle.forward_nowait(pack(v1), "r1", "b->c") is not None
    assert middle.forward_nowait(pack(v2), "r2", "b->c") is not None
    held2.release()  # r2 finished at the middle: its reader answers for it now
    middle.cleanup("r1")
    middle.cleanup("r2")
    source.reclaim()
    assert h1.released and not h2.released
    h2.release()
    held1.release()


@pytest.mark.parametrize(
    "make_value",
    [
        lambda t: t[1:],  # not 64-byte aligned
        lambda t: {"a": t, "b": t[64:]},  # two tensors
        lambda t: t.clone(),  # not the received bytes
        lambda t: t[::2],  # not contiguous: pack copies it
    ],
)
async def test_only_lone_aligned_received_bytes_are_forwarded(make_relay, make_value):
    source, middle = make_relay(), make_relay()
    handle, held, value = await _hop(source, middle, torch.zeros(8192, dtype=torch.uint8))
    assert middle.forward_nowait(pack(make_value(value)), "r", "b->c") is None
    held.release()
    handle.release()


async def test_an_aligned_slice_is_forwarded_with_its_offset(make_relay):
    source, middle, sink = make_relay(), make_relay(), make_relay()
    data = torch.arange(4096, dtype=torch.int64)
    handle, held, value = await _hop(source, middle, data)
    part = pack(value[64:128])  # 512 bytes in
    forward = middle.forward_nowait(part, "r", "b->c")
    assert forward is not None
    assert forward.descriptor.offset == handle.descriptor.offset + 512
    final = await sink.get(forward.descriptor)
    assert torch.equal(unpack(part.header, final.buffer), data[64:128])
    final.release()
    held.release()


async def test_a_received_payload_passed_on_whole_is_forwarded(make_relay):
    source, middle, sink = make_relay(), make_relay(), make_relay()
    sent = {"hidden": torch.randn(300, 7), "mask": torch.ones(33, dtype=torch.bool), "n": 3}
    handle, held, value = await _hop(source, middle, sent)
    packed = pack(value)
    forward = middle.forward_nowait(packed, "r", "b->c")
    assert forward is not None
    assert forward.descriptor.offset == handle.descriptor.offset
    final = await sink.get(forward.descriptor)
    out = unpack(packed.header, final.buffer)
    assert torch.equal(out["hidden"], sent["hidden"]) and torch.equal(out["mask"], sent["mask"])
    final.release()
    held.release()


@pytest.mark.parametrize(
    "make_value",
    [
        lambda v: {"hidden": v["hidden"], "mask": v["mask"]},  # another layout
        lambda v: {**v, "extra": torch.zeros(16)},  # bytes that are not in the view
    ],
)
async def test_payloads_not_laid_out_as_received_are_copied(make_relay, make_value):
    source, middle = make_relay(), make_relay()
    sent = {"mask": torch.ones(100, dtype=torch.bool), "hidden": torch.randn(300, 7)}
    handle, held, value = await _hop(source, middle, sent)
    assert middle.forward_nowait(pack(make_value(value)), "r", "b->c") is None
    held.release()
    handle.release()


async def test_a_view_is_forwarded_once(make_relay):
    source, middle = make_relay(), make_relay()
    handle, held, value = await _hop(source, middle, torch.zeros(8192, dtype=torch.uint8))
    assert middle.forward_nowait(pack(value), "r", "b->c") is not None
    assert middle.forward_nowait(pack(value), "r", "b->d") is None  # a copy goes there
    held.release()
    handle.release()


async def test_released_views_and_unrelated_tensors_are_not_forwarded(make_relay):
    source, middle = make_relay(), make_relay()
    handle, held, value = await _hop(source, middle, torch.zeros(8192, dtype=torch.uint8))
    assert middle.forward_nowait(pack(torch.zeros(8192, dtype=torch.uint8)), "r", "e") is None
    packed = pack(value)
    held.release()
    assert middle.forward_nowait(packed, "r", "e") is None
    handle.release()


async def test_forwarding_can_be_turned_off(make_relay):
    source, middle = make_relay(), make_relay(options={"forward_views": False})
    handle, held, value = await _hop(source, middle, torch.zeros(8192, dtype=torch.uint8))
    assert middle.forward_nowait(pack(value), "r", "e") is None
    held.release()
    handle.release()


def test_bad_forward_option_fails_at_creation(prefix):
    with pytest.raises(RelayError, match="forward_views: input should be a valid boolean"):
        create_relay("shm", RelaySettings(name_prefix=prefix, options={"forward_views": "yes"}))


async def test_a_forward_travels_on_through_a_chain(make_relay, prefix):
    # source -> a -> b -> sink: two forwards, one copy in all, one release mark.
    source, a, b, sink = make_relay(), make_relay(), make_relay(), make_relay()
    data = torch.arange(MiB, dtype=torch.uint8)
    handle, held_a, value_a = await _hop(source, a, data)
    f1 = a.forward_nowait(pack(value_a), "r", "a->b")
    at_b = await b.get(f1.descriptor)
    value_b = unpack(pack(value_a).header, at_b.buffer)
    f2 = b.forward_nowait(pack(value_b), "r", "b->sink")
    assert f2.descriptor.transfer_id == handle.descriptor.transfer_id
    held_a.release()
    at_b.release()
    final = await sink.get(f2.descriptor)
    assert torch.equal(unpack(pack(value_b).header, final.buffer), data)
    source.reclaim()
    assert not handle.released
    final.release()
    source.reclaim()
    assert handle.released
    assert len(shm_tests.data_segments(prefix)) == 1  # only the source ever made a pool
