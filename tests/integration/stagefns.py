"""Stage functions for the integration pipelines (referenced by dotted path)."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import torch


def make_source() -> Any:
    def fn(inputs: dict[str, Any]) -> dict[str, Any]:
        n = int(inputs.get("n", 4))
        return {"x": torch.arange(n, dtype=torch.float32), "opts": inputs}

    return fn


def make_double() -> Any:
    def fn(payload: dict[str, Any]) -> dict[str, Any]:
        opts = payload["opts"]
        if opts.get("fail"):
            raise ValueError(f"asked to fail: {opts['fail']}")
        if opts.get("sleep"):
            time.sleep(float(opts["sleep"]))
        return {"x": payload["x"] * 2, "opts": opts, "double_pid": os.getpid()}

    return fn


def make_summarize() -> Any:
    def fn(payload: dict[str, Any]) -> dict[str, Any]:
        x = payload["x"]
        out = {"sum": float(x.sum()), "n": int(x.numel()), "pid": os.getpid()}
        if "double_pid" in payload:  # which replica of `double` did the work
            out["double_pid"] = payload["double_pid"]
        return out

    return fn


# ---- fan-out / fan-in ---------------------------------------------------------


def make_split() -> Any:
    def fn(inputs: dict[str, Any]) -> dict[str, Any]:
        n = int(inputs["n"])
        return {"a": np.arange(n, dtype=np.int64), "b": torch.ones(n, dtype=torch.bfloat16)}

    return fn


def only_a(payload: dict[str, Any]) -> dict[str, Any]:
    return {"a": payload["a"]}


def only_b(payload: dict[str, Any]) -> dict[str, Any]:
    return {"b": payload["b"]}


def make_left() -> Any:
    return lambda p: {"left": p["a"] + 1, "saw": sorted(p)}


def make_right() -> Any:
    return lambda p: {"right": p["b"].float() * 3, "saw": sorted(p)}


def merge_join(arrived: dict[str, Any]) -> dict[str, Any]:
    return {"order": list(arrived), **{k: v for part in arrived.values() for k, v in part.items()}}


def make_join() -> Any:
    def fn(p: dict[str, Any]) -> dict[str, Any]:
        return {
            "left_sum": int(p["left"].sum()),
            "right_sum": float(p["right"].sum()),
            "order": p["order"],
        }

    return fn


# ---- route_fn / wait_for_fn --------------------------------------------------


def make_pre() -> Any:
    def fn(inputs: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"text": inputs["text"]}
        if "image" in inputs:
            out["image"] = np.asarray(inputs["image"], dtype=np.float32)
        return out

    return fn


def route_pre(request_id: str, output: dict[str, Any]) -> list[str]:
    if output["text"] == "bad-route":
        return ["nowhere"]
    return ["encoder", "aggregate"] if "image" in output else ["aggregate"]


def make_encoder() -> Any:
    return lambda p: {"image_feature": float(p["image"].mean())}


def wait_for_aggregate(request_id: str, from_stage: str, payload: Any) -> list[str] | None:
    if from_stage == "pre":
        return ["pre", "encoder"] if "image" in payload else ["pre"]
    return None


def merge_aggregate(arrived: dict[str, Any]) -> dict[str, Any]:
    merged = dict(arrived["pre"])
    merged.pop("image", None)
    if "encoder" in arrived:
        merged.update(arrived["encoder"])
    merged["sources"] = sorted(arrived)
    return merged


def make_aggregate() -> Any:
    return lambda p: p


# ---- several terminals ---------------------------------------------------------


def make_echo() -> Any:
    return lambda inputs: {"value": inputs["value"], "want": inputs.get("want")}


def make_upper() -> Any:
    return lambda p: {"text": str(p["value"]).upper()}


def make_length() -> Any:
    return lambda p: {"length": len(str(p["value"]))}


def pick_terminals(request_id: str, inputs: dict[str, Any]) -> list[str] | None:
    return inputs.get("want")


def make_batch_square() -> Any:
    from omnirail.stage import SimpleScheduler

    def batch(payloads: list[Any]) -> list[Any]:
        return [{"value": p["value"] ** 2, "batch": len(payloads)} for p in payloads]

    return SimpleScheduler(batch_fn=batch, max_batch_size=8, max_wait_ms=20)


def make_join_pid() -> Any:
    inner = make_join()
    return lambda p: {**inner(p), "pid": os.getpid()}


# ---- forwarding (a stage passes on the tensor it received) -----------------------------


def make_stamp() -> Any:
    def fn(inputs: dict[str, Any]) -> dict[str, Any]:
        i = int(inputs["i"])
        return {"i": i, "x": torch.full((int(inputs.get("n", 1 << 16)),), i, dtype=torch.int32)}

    return fn


def make_pass_on() -> Any:
    return lambda payload: payload


def make_check_stamp() -> Any:
    def fn(payload: dict[str, Any]) -> dict[str, Any]:
        x = payload["x"]
        return {"i": payload["i"], "intact": bool((x == payload["i"]).all()), "n": x.numel()}

    return fn


# ---- placement ------------------------------------------------------------------------


def make_where(device: str = "?", gpu_id: int | None = -1) -> Any:
    """Says where its process placed it: the device and GPU id its factory was given, and
    the GPUs the process sees."""

    def fn(payload: Any) -> dict[str, Any]:
        x = torch.ones(4, device=device) * 2
        return {
            "device": device,
            "gpu_id": gpu_id,
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "sum": float(x.sum()),
        }

    return fn


def make_device_source(device: str = "cpu") -> Any:
    """A tensor made on the stage's device (past the inline bound: relayed)."""

    def fn(inputs: dict[str, Any]) -> dict[str, Any]:
        n = int(inputs.get("n", 20000))
        return {"x": torch.arange(n, dtype=torch.float32, device=device), "seen": []}

    return fn


def make_device_hop() -> Any:
    """Records the device its input tensor arrived on, and passes on twice the tensor."""

    def fn(p: dict[str, Any]) -> dict[str, Any]:
        x = p["x"]
        return {"x": x * 2, "seen": [*p["seen"], str(x.device)], "sum": float(x.sum())}

    return fn


def make_tp_input() -> Any:
    """{"rows", "seed", "sleep_s"} -> a batch of inputs for the tensor-parallel MLP."""

    def fn(inputs: dict[str, Any]) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(int(inputs.get("seed", 0)))
        x = torch.randn(int(inputs.get("rows", 4)), 32, generator=gen)
        return {"x": x, "sleep_s": float(inputs.get("sleep_s", 0))}

    return fn


def make_tp_output() -> Any:
    return lambda p: {"y": p["y"], "ranks": p["ranks"], "part": p["part"], "mlp_pid": p["pid"]}


def make_pid_after(sleep_s: float = 0.0) -> Any:
    """Answers its process id after `inputs["sleep"]` seconds (which replica served)."""

    def fn(inputs: dict[str, Any]) -> dict[str, Any]:
        time.sleep(float(inputs.get("sleep", sleep_s)))
        return {"pid": os.getpid()}

    return fn
