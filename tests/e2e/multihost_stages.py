"""Stages of the multi-host test: tensors large enough to travel through the relays."""

from __future__ import annotations

from typing import Any

import torch


def make_source(nbytes: int) -> Any:
    def source(inputs: dict[str, Any]) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(int(inputs["seed"]))
        data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
        return {"seed": int(inputs["seed"]), "data": data}

    return source


def make_middle() -> Any:
    def middle(payload: dict[str, Any]) -> dict[str, Any]:
        # A float tensor too, so more than one dtype crosses the second edge.
        data = payload["data"]
        return {"seed": payload["seed"], "data": data, "scaled": data.to(torch.float32) * 0.5}

    return middle


def make_sink() -> Any:
    def sink(payload: dict[str, Any]) -> dict[str, Any]:
        data, scaled = payload["data"], payload["scaled"]
        return {
            "seed": payload["seed"],
            "sum": int(data.to(torch.int64).sum()),
            "scaled_ok": bool(torch.equal(scaled, data.to(torch.float32) * 0.5)),
            "nbytes": data.numel(),
        }

    return sink


def expected(seed: int, nbytes: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    total = int(data.to(torch.int64).sum())
    return {"seed": seed, "sum": total, "scaled_ok": True, "nbytes": nbytes}
