"""JSON at the CLI boundary: inputs in, results out.

A JSON input object may hold tensors as ``{"__tensor__": [...], "dtype": "float32"}``;
results print tensors as dtype, shape and (for small ones) their values.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

_SMALL = 64


def parse_inputs(text: str, *, source: str = "--input") -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source}: invalid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{source}: expected a JSON object of inputs, got {type(value).__name__}")
    return _tensors_in(value, source)


def _tensors_in(value: Any, path: str) -> Any:
    if isinstance(value, dict):
        if "__tensor__" in value:
            extra = set(value) - {"__tensor__", "dtype"}
            if extra:
                raise ValueError(f"{path}: unexpected keys {sorted(extra)} in a tensor")
            try:
                return np.asarray(value["__tensor__"], dtype=value.get("dtype", "float32"))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{path}: bad tensor: {exc}") from None
        return {k: _tensors_in(v, f"{path}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [_tensors_in(v, f"{path}[{i}]") for i, v in enumerate(value)]
    return value


def to_jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, bytes):
        return {"bytes": len(value)}
    if isinstance(value, np.generic):  # before the array branch: scalars have .shape too
        return value.item()
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        arr = value
        if type(value).__module__.startswith("torch"):
            arr = value.float().numpy() if str(value.dtype) == "torch.bfloat16" else value.numpy()
        out: dict[str, Any] = {
            "dtype": str(value.dtype).removeprefix("torch."),
            "shape": list(arr.shape),
        }
        if arr.size <= _SMALL:
            out["data"] = arr.tolist()
        elif arr.dtype.kind in "fiub":
            out["mean"] = float(np.asarray(arr, dtype=np.float64).mean())
        return out
    return value


def dumps(value: Any) -> str:
    return json.dumps(to_jsonable(value), indent=2)
