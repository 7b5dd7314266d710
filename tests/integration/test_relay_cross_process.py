"""shm relay across real processes: descriptors over a pipe, acks back, abort, cleanup."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import uuid

import numpy as np
import pytest

from omnirail.relay.base import RelaySettings, create_relay
from omnirail.relay.io import receive_payload, relayed_payload
from omnirail.relay.shm import sweep_segments
from omnirail.relay.shm_pool import SHM_DIR
from omnirail.v1 import common_pb2
from omnirail.wire.payload import pack

MiB = 1 << 20
TIMEOUT = 120  # generous: the machine running the tests may be busy


async def relayed(value, relay, request_id: str):
    """`value` put into `relay` on edge "e": its Payload (with the descriptor), the handle."""
    packed = pack(value)
    handle = await relay.put(packed, request_id, "e")
    return relayed_payload(packed, handle), handle


def pattern(n: int, seed: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.int64) * 7 + seed) % 251).astype(np.uint8)


def receiver_main(conn, prefix: str) -> None:
    """Child: decodes each descriptor, checks the bytes, acks (or holds, then acks)."""

    async def run() -> None:
        relay = create_relay("shm", RelaySettings(name_prefix=prefix))
        held = []
        try:
            while True:
                msg = conn.recv()
                if msg[0] == "stop":
                    return
                if msg[0] == "release-held":
                    # The sender aborted and may have closed: views must still be readable.
                    ok = all(
                        bool(np.array_equal(r.value["x"], pattern(len(r.value["x"]), s)))
                        for r, s in held
                    )
                    for r, _ in held:
                        r.release()
                    held.clear()
                    conn.send(("released", ok))
                    continue
                kind, raw = msg
                pb = common_pb2.Payload.FromString(raw)
                received = await receive_payload(pb, {"shm": relay})
                x, seed = received.value["x"], received.value["seed"]
                ok = bool(np.array_equal(x, pattern(len(x), seed))) and not x.flags.writeable
                if kind == "hold":
                    held.append((received, seed))
                else:
                    received.release()
                conn.send(("ack", pb.relay.transfer_id, ok))
        finally:
            relay.close()

    asyncio.run(run())


def crashing_sender(prefix: str) -> None:
    """Child: leaves its pool behind, as a killed process would."""

    async def run() -> None:
        relay = create_relay("shm", RelaySettings(name_prefix=prefix, pool_bytes=MiB))
        await relayed(np.ones(2 * MiB, np.uint8), relay, "r")

    asyncio.run(run())
    os._exit(0)  # skips atexit, like SIGKILL


def leftovers(prefix: str) -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if n.startswith(prefix + "-")]


@pytest.fixture
def prefix():
    name = f"ortestx{uuid.uuid4().hex[:10]}"
    yield name
    sweep_segments(name)


@pytest.fixture
def child(prefix):
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=receiver_main, args=(theirs, prefix), daemon=True)
    proc.start()
    theirs.close()
    yield ours
    if proc.is_alive():
        try:
            ours.send(("stop",))
        except OSError:
            pass
    proc.join(TIMEOUT)
    if proc.is_alive():
        proc.kill()
    assert proc.exitcode == 0


async def recv(conn):
    if not await asyncio.to_thread(conn.poll, TIMEOUT):
        raise TimeoutError("receiver process did not answer")
    return conn.recv()


async def test_stream_through_shm_to_another_process(prefix, child):
    relay = create_relay("shm", RelaySettings(name_prefix=prefix, pool_bytes=MiB, credit_slots=3))
    sizes = [100, 70_000, MiB - 64, 3 * MiB, 5_000, 2 * MiB, 1, 300_000] * 3
    handles = {}
    results = []

    async def read_acks() -> None:
        while len(results) < len(sizes):
            _, tid, ok = await recv(child)
            results.append(ok)
            handles.pop(tid).release()

    reader = asyncio.create_task(read_acks())
    for i, n in enumerate(sizes):
        value = {"x": pattern(n, i), "seed": i}
        pb, handle = await relayed(value, relay, f"r{i}")
        assert handle is not None
        handles[handle.descriptor.transfer_id] = handle
        child.send(("ack", pb.SerializeToString()))
        assert relay.outstanding("e")[0] <= 3
    await asyncio.wait_for(reader, TIMEOUT)
    assert results == [True] * len(sizes)
    assert relay.outstanding("e") == (0, 0)
    assert len([n for n in leftovers(prefix) if not n.endswith("-marks")]) >= 2  # pool grew
    relay.close()
    assert leftovers(prefix) == []


async def test_abort_cleanup_and_close_while_receiver_holds_views(prefix, child):
    relay = create_relay("shm", RelaySettings(name_prefix=prefix, pool_bytes=MiB))
    for i in range(4):
        value = {"x": pattern(200_000, i), "seed": i}
        pb, _ = await relayed(value, relay, "doomed")
        child.send(("hold", pb.SerializeToString()))
    for _ in range(4):
        assert (await recv(child))[2] is True
    assert relay.outstanding("e")[0] == 4
    relay.cleanup("doomed")  # the abort path: no acks will come
    assert relay.outstanding("e") == (0, 0)
    relay.close()
    assert leftovers(prefix) == []
    child.send(("release-held",))
    assert await recv(child) == ("released", True)


def test_killed_sender_leftovers_are_swept(prefix):
    proc = mp.get_context("spawn").Process(target=crashing_sender, args=(prefix,))
    proc.start()
    proc.join(TIMEOUT)
    assert proc.exitcode == 0
    assert len(leftovers(prefix)) >= 1
    assert sweep_segments(prefix) >= 1
    assert leftovers(prefix) == []


ROW_KEYS = {"bytes", "gbps", "memcpy_gbps", "ratio", "latency_us", "get_us", "transfers"}


@pytest.mark.parametrize("backend", ["shm", "torchdist"])
def test_relay_bench_smoke(backend: str):
    from omnirail.bench.relay_bench import run_relay_bench

    out = run_relay_bench(backend, sizes=[4096, 3 << 20], min_seconds=0.02, repeat=1)
    assert out["backend"] == backend
    assert set(out["sizes"]) == {"4096", str(3 << 20)}
    for row in out["sizes"].values():
        assert set(row) == ROW_KEYS
        assert row["gbps"] > 0 and row["memcpy_gbps"] > 0 and row["transfers"] >= 5
        # The receiver's own share is part of the round trip it answers.
        assert 0 < row["get_us"] <= row["latency_us"]
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(f"omnirail-bench{os.getpid()}-")]
