"""Per-edge credit bounds: `Credits.limit` and the relays' `set_edge_credits`."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from omnirail.relay.base import Relay, RelaySettings, create_relay
from omnirail.relay.credits import Credits
from omnirail.relay.shm import sweep_segments
from omnirail.wire.payload import pack


def test_limit_bounds_one_edge_and_leaves_the_others_at_the_default() -> None:
    credits = Credits(4, 1 << 20)
    credits.limit("a->b", 1, 100)
    one, other = credits.edge("a->b"), credits.edge("a->c")
    assert credits.try_take(one, 10)
    assert not credits.try_take(one, 10)  # 1 slot
    for _ in range(4):
        assert credits.try_take(other, 10)
    assert not credits.try_take(other, 10)  # the default: 4 slots
    with pytest.raises(ValueError, match="credits must be >= 1"):
        credits.limit("a->d", 0, 100)


async def test_raising_a_limit_admits_who_waits() -> None:
    credits = Credits(1, 1 << 20)
    edge = credits.edge("e")
    assert credits.try_take(edge, 1)
    waiter = asyncio.ensure_future(credits.take(edge, 1))
    await asyncio.sleep(0)
    assert not waiter.done()
    credits.limit("e", 2, 1 << 20)
    await asyncio.wait_for(waiter, 1)
    assert credits.outstanding("e") == (2, 2)


@pytest.fixture
def shm() -> Iterator[Relay]:
    prefix = f"edgecred{uuid.uuid4().hex[:8]}"
    relay = create_relay("shm", RelaySettings(name_prefix=prefix, pool_bytes=1 << 20))
    yield relay
    relay.close()
    sweep_segments(prefix)


@pytest.mark.parametrize("backend", ["shm", "inline"])
def test_every_relay_takes_edge_credits(backend: str) -> None:
    relay = create_relay(backend, RelaySettings(name_prefix=f"ec{uuid.uuid4().hex[:8]}"))
    relay.set_edge_credits("a->b", 2, 1 << 20)  # inline has no credit: a no-op
    relay.close()


async def test_shm_bounds_each_edge_by_its_own_credits(shm: Relay) -> None:
    shm.set_edge_credits("s->one", 1, 1 << 30)
    shm.set_edge_credits("s->four", 4, 1 << 30)
    payload = pack(np.ones(4096, np.uint8))
    held = {"s->one": [], "s->four": [], "s->other": []}
    for edge, handles in held.items():
        while (handle := shm.put_nowait(payload, "r", edge)) is not None and len(handles) < 80:
            handles.append(handle)
    assert [len(h) for h in held.values()] == [1, 4, 64]  # other: the settings' default
    assert shm.outstanding("s->four") == (4, 4 * 4096)  # type: ignore[attr-defined]
    blocked = asyncio.ensure_future(shm.put(payload, "r", "s->four"))
    await asyncio.sleep(0.01)
    assert not blocked.done()
    held["s->four"].pop(0).release()
    (await asyncio.wait_for(blocked, 1)).release()
    for handles in held.values():
        for handle in handles:
            handle.release()
    assert shm.outstanding("s->one") == (0, 0)  # type: ignore[attr-defined]
