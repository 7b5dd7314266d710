"""What the encoder and decoder of `omnirail.wire.payload` share: its typed error, the wire
format's limits, the checks that need no msgpack state, and lazy torch access.

The format is documented at the top of payload.py; import these names from there. This
module only keeps that file to a readable size.
"""

from __future__ import annotations

import importlib
import math
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

MAX_DEPTH = 64
# Chosen so that a header at any one limit decodes in ~0.1 s on a busy core, and one at all
# of them in a few tenths: generous for payloads, whose bulk belongs in tensors, and far from
# the seconds a 32 MiB header of tiny containers used to hold an event loop.
MAX_TUPLE_DEPTH = 8  # a tuple's ext data repeats its contents: decode memory <= 9 x header
MAX_ITEMS = 1 << 18  # up to ~0.4 us each (a dict entry's key: build, hash, check)
MAX_CONTAINERS = 1 << 16  # ~0.5-1.5 us each (a tuple or complex: a nested msgpack call)
MAX_TENSORS = 1 << 13  # ~6 us each to check and build
MAX_SPEC_BYTES = 512  # a placeholder's ext data: ~60 bytes, plus up to 9 per dimension
MAX_COMPLEX_BYTES = 19  # a complex's ext data: fixarray and two float64
MAX_NDIM = 32
INT_MIN = -(1 << 63)
INT_MAX = (1 << 64) - 1

# Header dtype name -> numpy dtype used to view the bytes (bfloat16: raw uint16 bits).
NP_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name)
    for name in (
        "bool",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "int8",
        "int16",
        "int32",
        "int64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    )
}
NP_DTYPES["bfloat16"] = np.dtype("uint16")

CONTAINERS = (dict, list, tuple)
# Types a decoded tree may contain; load_torch adds torch.Tensor once torch is imported.
LEAVES: set[type] = {str, int, float, bool, type(None), bytes, complex, np.ndarray}
# Device types whose tensors are staged through host memory (their type is recorded).
STAGED_DEVICES = frozenset({"cuda", "xpu", "mps"})


_torch_mod: Any = None
_torch_missing = False
_torch_warned = False


def load_torch() -> Any:
    """torch if importable (imported on first use), else None."""
    global _torch_mod, _torch_missing
    if _torch_mod is None and not _torch_missing:
        try:
            _torch_mod = importlib.import_module("torch")
            LEAVES.add(_torch_mod.Tensor)
        except ImportError:
            _torch_missing = True
    return _torch_mod


def is_torch_tensor(obj: Any) -> bool:
    # A torch tensor can only exist if torch is already imported, so never import it here.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def from_numpy_ro(torch: Any, arr: np.ndarray) -> Any:
    global _torch_warned
    if _torch_warned:
        return torch.from_numpy(arr)
    # torch warns once per process about read-only arrays; the views are documented
    # read-only, so swallow that single warning instead of paying catch_warnings each time.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        out = torch.from_numpy(arr)
    _torch_warned = True
    return out


class PayloadError(ValueError):
    """Malformed header, unsupported value, or a tensor that points outside the buffer."""

    __module__ = "omnirail.wire.payload"  # where users import it from (and see it in traces)

    def __init__(self, message: str, path: list[str] | None = None) -> None:
        super().__init__(message)
        self.reason = message
        # Path segments innermost first; containers prepend theirs while the error unwinds,
        # so the success path builds no path strings at all.
        self._segments: list[str] = path if path is not None else []

    def _add(self, segment: str) -> PayloadError:
        self._segments.append(segment)
        return self

    def __str__(self) -> str:
        if not self._segments:
            return self.reason
        path = "".join(reversed(self._segments)).lstrip(".")
        return f"{path}: {self.reason}"


def seg(key: Any) -> str:
    """A path segment (error path only). A key with a lone surrogate is written escaped: the
    message must print, and the log line reporting it must not fail in turn."""
    if not isinstance(key, str):
        return f"[{key}]"
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        key = ascii(key)[1:-1]
    return f".{key}"


class Budget:
    """Counts a header's contents the way a decoder meets them and refuses past the limits.

    items: values inside arrays and maps (a map entry is two, its key and its value);
    containers: arrays, maps and ext values (a tuple is two: its ext and the array inside);
    tensors: tensor placeholders, repeats included. `pack` counts what it writes by the same
    rules, so it refuses exactly what `unpack` would, and names where.
    """

    __slots__ = ("containers", "items", "tensors")

    def __init__(self, items: int = 0, containers: int = 0) -> None:
        self.items = items
        self.containers = containers
        self.tensors = 0

    def add(self, items: int, containers: int) -> None:
        self.items += items
        self.containers += containers
        if self.items > MAX_ITEMS or self.containers > MAX_CONTAINERS:
            self.refuse()

    def add_tensor(self) -> None:
        self.tensors += 1
        self.containers += 1
        if self.tensors > MAX_TENSORS or self.containers > MAX_CONTAINERS:
            self.refuse()

    def refuse(self) -> None:
        """Raises the error for the limit the counts are past (hot paths count inline)."""
        if self.tensors > MAX_TENSORS:
            raise PayloadError(f"more than {MAX_TENSORS} tensors")
        if self.items > MAX_ITEMS:
            raise PayloadError(
                f"more than {MAX_ITEMS} items (values in lists, tuples and dicts; a dict "
                "entry is two); send large arrays as tensors"
            )
        raise PayloadError(
            f"more than {MAX_CONTAINERS} containers (lists, dicts, tuples, complex numbers "
            "and tensors)"
        )


def check_spec(spec: Any) -> TensorSpec:
    """A placeholder's decoded ext data, checked field by field."""
    if type(spec) is not list or len(spec) not in (5, 6):
        raise PayloadError("bad tensor placeholder")
    kind, dtype_name, shape, offset, nbytes = spec[:5]
    on = spec[5] if len(spec) == 6 else ""
    if kind not in ("torch", "numpy"):
        raise PayloadError(f"unknown tensor kind {kind!r}")
    if on and (on not in STAGED_DEVICES or kind != "torch"):
        raise PayloadError(f"bad tensor device {on!r}")
    if type(dtype_name) is not str or dtype_name not in NP_DTYPES:
        raise PayloadError(f"unknown dtype {dtype_name!r}")
    if kind == "numpy" and dtype_name == "bfloat16":
        raise PayloadError("numpy tensors cannot be bfloat16")
    if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
        raise PayloadError(f"bad tensor shape {shape!r}")
    if len(shape) > MAX_NDIM:
        raise PayloadError(f"tensor of {len(shape)} dimensions, more than {MAX_NDIM}")
    if type(offset) is not int or type(nbytes) is not int or offset < 0 or nbytes < 0:
        raise PayloadError("bad tensor offset or size")
    dtype = NP_DTYPES[dtype_name]
    count = math.prod(shape)
    if count * dtype.itemsize != nbytes:
        raise PayloadError(f"tensor of shape {shape} and dtype {dtype_name} is not {nbytes} bytes")
    # An empty tensor's other dimensions must still fit numpy's sizes (numpy raises past).
    if not count and math.prod(d for d in shape if d) * dtype.itemsize >= 1 << 63:
        raise PayloadError(f"tensor shape {shape} is too large")
    if offset % dtype.itemsize:
        raise PayloadError(f"tensor offset {offset} is not aligned to its dtype")
    return TensorSpec(kind, dtype_name, dtype, tuple(shape), offset, nbytes, count, on)


@dataclass(slots=True)
class TensorSpec:
    """A tensor placeholder that passed every check but the buffer's: `check_fits` that one,
    before `build` makes the tensor."""

    kind: str
    dtype_name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    count: int
    on: str = ""  # the device type the sender had it on ("" for the CPU)

    def check_fits(self, size: int) -> None:
        if self.offset + self.nbytes > size:
            raise PayloadError(
                f"tensor at offset {self.offset} of {self.nbytes} bytes lies outside the "
                f"buffer of {size} bytes"
            )

    def build(
        self, buf: memoryview, copy: bool, numpy_only: bool, device: str | None = None
    ) -> Any:
        """The tensor; the caller has made `check_fits` (first: errors come in one order)."""
        if self.count == 0:
            arr = np.empty(self.shape, self.dtype)
        else:
            arr = np.frombuffer(buf, self.dtype, self.count, self.offset).reshape(self.shape)
        if copy:
            arr = arr.copy()
        elif arr.flags.writeable:
            arr.flags.writeable = False
        if self.kind == "numpy" or numpy_only:
            return arr
        torch = load_torch()
        if torch is None:
            return arr
        t = torch.from_numpy(arr) if copy else from_numpy_ro(torch, arr)
        if self.dtype_name == "bfloat16":
            t = t.view(torch.bfloat16)
        if self.on and device is not None:
            # A device tensor at the sender goes onto the receiver's device (a copy: the
            # relay's view is released as usual).
            t = t.to(device)
        return t


def check_tree(obj: Any, depth: int) -> None:
    """Rejects nesting deeper than MAX_DEPTH and keys or leaves `pack` never produces."""
    if depth > MAX_DEPTH:
        raise PayloadError(f"nesting deeper than {MAX_DEPTH}")
    if type(obj) is dict:
        for k, v in obj.items():
            if type(k) is not str and type(k) is not int:
                raise PayloadError(f"dict key of type {type(k).__name__}")
            if type(v) in CONTAINERS:
                check_tree(v, depth + 1)
            elif type(v) not in LEAVES:
                raise PayloadError(f"unexpected value of type {type(v).__name__}")
    else:
        for v in obj:
            if type(v) in CONTAINERS:
                check_tree(v, depth + 1)
            elif type(v) not in LEAVES:
                raise PayloadError(f"unexpected value of type {type(v).__name__}")


def unencodable(obj: Any, error: Exception) -> PayloadError:
    """The error for a value msgpack refused to pack. Of what gets past the encoder's own
    checks only a str with lone surrogates fails, so this (error path only: it encodes every
    str again) names the str or key that has one; anything else keeps msgpack's message."""
    found = _find_bad_str(obj, 0)
    if found is None:
        return PayloadError(f"cannot encode header: {type(error).__name__}: {error}")
    what, e, segments = found
    reason = f"cannot encode {what} as UTF-8: {e.reason} (character {e.start})"
    return PayloadError(reason, segments)


def _find_bad_str(obj: Any, depth: int) -> tuple[str, UnicodeEncodeError, list[str]] | None:
    """(what, error, path segments innermost first) of the first str in `obj` that is not
    valid UTF-8, or None. Walks what the encoder walked, so its depth is already bounded."""
    t = type(obj)
    if t is str:
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError as e:
            return "str", e, []
        return None
    if depth >= MAX_DEPTH:
        return None
    if t is dict:
        for k, v in obj.items():
            if type(k) is str:
                found = _find_bad_str(k, depth + 1)
                if found is not None:
                    return "dict key", found[1], [seg(k)]
            found = _find_bad_str(v, depth + 1)
            if found is not None:
                found[2].append(seg(k))
                return found
    elif t is list or t is tuple:
        for i, v in enumerate(obj):
            found = _find_bad_str(v, depth + 1)
            if found is not None:
                found[2].append(f"[{i}]")
                return found
    return None
