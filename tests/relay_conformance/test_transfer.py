"""Conformance: content arrives exactly, for every size, dtype, layout, concurrency, order."""

from __future__ import annotations

import asyncio
import zlib
from typing import Any

import numpy as np
import pytest

from omnirail.v1 import common_pb2
from omnirail.wire.payload import decode_inline
from tests.relay_conformance.conftest import MiB, OpenPeer
from tests.relay_conformance.harness import TIMEOUT, Peer, check, pattern, settled_outstanding

KiB = 1 << 10
SIZES = [
    0,
    1,
    3,
    63,
    65,
    4 * KiB - 1,
    4 * KiB,
    4 * KiB + 1,
    64 * KiB,
    MiB,
    MiB + 13,
    8 * MiB + 7,  # odd and past shm's threaded-copy bound
    16 * MiB,
    pytest.param(256 * MiB, marks=pytest.mark.slow),
]


def on_device(data: np.ndarray, device: str) -> Any:
    if device == "cpu":
        return data
    import torch

    return torch.from_numpy(data.copy()).to(device)


@pytest.mark.parametrize("nbytes", SIZES, ids=lambda n: f"{n}B")
async def test_sizes_arrive_byte_for_byte(device: str, peer: Peer, nbytes: int) -> None:
    data = pattern(nbytes, seed=nbytes)
    await peer.send(on_device(data, device), crc=zlib.crc32(data))


# ----------------------------------------------------------------------------- dtypes


def torch_cases(device: str) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(1)
    special = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, 65504.0, -1.5]
    floats = torch.cat([torch.randn(97, generator=g, dtype=torch.float64), torch.tensor(special)])

    def ints(dtype: torch.dtype) -> torch.Tensor:
        info = torch.iinfo(dtype)
        body = torch.randint(info.min, info.max, (99,), generator=g, dtype=dtype)
        return torch.cat([body, torch.tensor([info.min, info.max, 0], dtype=dtype)])

    cases = {
        "float32": floats.float(),
        "float16": floats.half(),
        "bfloat16": floats.bfloat16(),
        "float64": floats,
        "int8": ints(torch.int8),
        "int16": ints(torch.int16),
        "int32": ints(torch.int32),
        "int64": ints(torch.int64),
        "uint8": ints(torch.uint8),
        "bool": torch.randint(0, 2, (37,), generator=g).bool(),
        "complex64": torch.randn(33, generator=g, dtype=torch.complex64),
        "0-d": torch.tensor(3.25),
        "0-d-int": torch.tensor(-7),
        "empty": torch.empty(0, 5),
        "empty-inner": torch.empty(3, 0, dtype=torch.int32),
        "transposed": torch.randn(7, 5, generator=g).t(),
        "strided": torch.arange(60, dtype=torch.int16).reshape(6, 10)[::2, 1::3],
        "expanded": torch.randn(3, 1, generator=g).expand(3, 4),  # stride 0
        "conj-view": torch.randn(5, generator=g, dtype=torch.complex64).conj(),
        "requires-grad": torch.randn(4, generator=g, requires_grad=True),
        "bf16-strided": floats.bfloat16()[1::3],
    }
    return {f"torch-{k}": v.to(device) for k, v in cases.items()}


def numpy_cases() -> dict[str, Any]:
    rng = np.random.default_rng(2)
    cases: dict[str, Any] = {}
    for name in ("float16", "float32", "float64", "complex64", "complex128"):
        values = rng.standard_normal(41) + (
            1j * rng.standard_normal(41) if "complex" in name else 0
        )
        cases[name] = np.append(values, [np.nan, np.inf, -0.0]).astype(name)
    for name in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"):
        info = np.iinfo(name)
        cases[name] = np.append(rng.integers(info.min, info.max, 43, dtype=name), [info.max])
    cases["bool"] = rng.integers(0, 2, 29).astype(bool)
    cases["0-d"] = np.array(2.5, np.float32)
    cases["empty"] = np.empty((0, 4), np.int64)
    cases["fortran"] = np.asfortranarray(rng.standard_normal((5, 7)).astype(np.float32))
    cases["reversed"] = np.arange(11, dtype=np.int32)[::-1]
    cases["big-endian"] = np.arange(9, dtype=">f4")
    return {f"numpy-{k}": v for k, v in cases.items()}


def mixed_case(device: str) -> Any:
    """Several tensors in one buffer (aligned offsets, gaps), one of them referenced twice."""
    import torch

    shared = torch.arange(13, dtype=torch.float16, device=device)
    return {
        "a": np.arange(7, dtype=np.int8),
        "b": [torch.ones(3, 3, dtype=torch.bool, device=device), (shared, 3, "x")],
        "c": shared,
        "n": None,
        "z": 1 + 2j,
    }


def canonical(value: Any) -> Any:
    """A comparable form: kind, dtype, shape and raw bytes (so NaN and -0.0 compare)."""
    import torch

    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().resolve_conj().resolve_neg().contiguous()
        dtype = str(t.dtype)
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        return ("torch", dtype, tuple(value.shape), t.numpy().tobytes())
    if isinstance(value, np.ndarray):
        arr = np.array(value, order="C", dtype=value.dtype.newbyteorder("="))
        return ("numpy", arr.dtype.name, value.shape, arr.tobytes())
    if isinstance(value, dict):
        return {k: canonical(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return (type(value).__name__, [canonical(v) for v in value])
    return (type(value).__name__, value)


async def test_dtypes_and_layouts_roundtrip_exactly(device: str, peer: Peer) -> None:
    """pack -> put -> (other process) get -> unpack -> echoed back: equal to the last bit."""
    cases = torch_cases(device)
    if device == "cpu":
        cases.update(numpy_cases())
    cases["mixed"] = mixed_case(device)
    transfers = {name: await peer.put(value, echo=True) for name, value in cases.items()}
    mismatches = []
    for name, transfer in transfers.items():
        reply = await transfer.result()
        check(transfer, reply)
        assert reply.echo is not None
        echoed = decode_inline(common_pb2.Payload.FromString(reply.echo))
        if canonical(echoed) != canonical(cases[name]):
            mismatches.append(name)
    assert mismatches == []


# ----------------------------------------------------------------------------- concurrency


async def test_concurrent_puts_all_arrive_intact(open_peer: OpenPeer) -> None:
    peer = await open_peer(credit_slots=4, credit_bytes=8 * MiB)
    sizes = [0, 1, 100, 4097, 64 * KiB, 300_001, MiB + 1]
    edges = ["shared0", "shared1", "shared0", "shared1", "own4", "own5", "own6", "own7"]

    async def worker(w: int) -> int:
        values = []
        for j in range(12):
            # Two payloads over the byte credit, copied in threads while others go on.
            n = 9 * MiB + w if j == 3 and w < 2 else sizes[(w + j) % len(sizes)]
            values.append(pattern(n, seed=w * 1000 + j))
        # Distinct request ids: many requests in flight, several per edge.
        replies = await peer.send_many(values, request_id=f"req{w}", edge=edges[w])
        return len(replies)

    done = await asyncio.wait_for(asyncio.gather(*(worker(w) for w in range(8))), TIMEOUT)
    assert done == [12] * 8
    if hasattr(peer.relay, "outstanding"):
        for edge in set(edges):
            assert await settled_outstanding(peer.relay, edge, (0, 0)) == (0, 0)


# ----------------------------------------------------------------------------- ordering


async def test_one_edge_keeps_put_order_and_content(open_peer: OpenPeer) -> None:
    """Puts queued on a tight edge get credit in put order; each reads its own bytes."""
    peer = await open_peer(credit_slots=3, credit_bytes=MiB)
    sizes = [1000, 70_000, 300_000, 5, 600_000, 4096, 2 * MiB]  # 2 MiB: over the credit
    values = [pattern(sizes[i % len(sizes)], seed=i) for i in range(42)]
    granted: list[int] = []

    async def one(i: int) -> Any:
        transfer = await peer.put(values[i], request_id=f"r{i}")
        granted.append(i)
        return transfer

    tasks = [asyncio.create_task(one(i)) for i in range(len(values))]
    transfers = [await asyncio.wait_for(t, TIMEOUT) for t in tasks]
    for transfer in transfers:
        check(transfer, await transfer.result())
    assert granted == list(range(len(values)))


async def test_held_views_are_not_overwritten(open_peer: OpenPeer) -> None:
    """Extents the receiver still reads are never handed to later transfers."""
    peer = await open_peer(credit_slots=8)
    sizes = [100, 70_000, MiB + 5, 300_000]
    held = [
        await peer.put(pattern(n, seed=i), request_id="held", edge="held", hold=True)
        for i, n in enumerate(sizes)
    ]
    for transfer in held:
        check(transfer, await transfer.result())
    # Churn on another edge reuses every extent that is free, and grows the pool.
    churn = [pattern(n, seed=100 + i) for i, n in enumerate(sizes * 6 + [5 * MiB])]
    await peer.send_many(churn, request_id="churn", edge="churn")
    assert await peer.release(held) == {t.seq: t.crc for t in held}
