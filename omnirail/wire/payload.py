"""Payload codec: nested values with tensors -> (msgpack header, one aligned buffer).

No pickle: the header is msgpack of plain values with tensor placeholders; tensor bytes live
in one buffer at aligned offsets. A peer that sends garbage gets a `PayloadError`, never code
execution and never another exception type.

Header layout: msgpack array ``[1, nbytes, tree]`` where ``tree`` holds None, bool, int,
float, str, bytes, dicts (str or int keys), lists and these ExtTypes:

- 1 tensor placeholder: msgpack ``[kind, dtype, shape, offset, nbytes]``, kind "torch"|"numpy";
  a torch tensor that was on a device (a GPU) has a sixth item, the device type ("cuda"):
  its bytes were staged through host memory, and a receiver given a device (`unpack(...,
  device=)`, the receiving stage's) gets it there; other receivers get it on the CPU
- 2 tuple: msgpack array of the items
- 3 complex: msgpack ``[real, imag]``

Imports without torch; torch is imported lazily only when a torch tensor is met. Without
torch, "torch" placeholders decode as numpy arrays (bfloat16 as uint16 holding the raw bits).
"""

from __future__ import annotations

import importlib
import math
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from omnirail.v1 import common_pb2

__all__ = [
    "MAX_DEPTH",
    "Packed",
    "PayloadError",
    "decode_inline",
    "encode_inline",
    "pack",
    "unpack",
]

MAX_DEPTH = 64
_VERSION = 1
_EXT_TENSOR = 1
_EXT_TUPLE = 2
_EXT_COMPLEX = 3
_MAX_NDIM = 32
_INT_MIN = -(1 << 63)
_INT_MAX = (1 << 64) - 1

# Header dtype name -> numpy dtype used to view the bytes (bfloat16: raw uint16 bits).
_NP_DTYPES: dict[str, np.dtype] = {
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
_NP_DTYPES["bfloat16"] = np.dtype("uint16")

# Leaves that need no conversion on either side (ints are range-checked separately).
_SIMPLE = frozenset({str, float, bool, type(None), bytes})
_CONTAINERS = (dict, list, tuple)
# Types a decoded tree may contain; torch.Tensor is added once torch has been imported.
_LEAVES: set[type] = {str, int, float, bool, type(None), bytes, complex, np.ndarray}


class PayloadError(ValueError):
    """Malformed header, unsupported value, or a tensor that points outside the buffer."""

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


def _ext(code: int, data: bytes) -> msgpack.ExtType:
    # ExtType's own constructor re-validates its arguments in Python (~0.7 us, a tenth of a
    # small pack); ours are always an int code and bytes.
    return tuple.__new__(msgpack.ExtType, (code, data))


def _seg(key: Any) -> str:
    return f".{key}" if isinstance(key, str) else f"[{key}]"


# ----------------------------------------------------------------------------- torch access

_torch_mod: Any = None
_torch_missing = False
_torch_warned = False


def _torch() -> Any:
    """torch if importable (imported on first use), else None."""
    global _torch_mod, _torch_missing
    if _torch_mod is None and not _torch_missing:
        try:
            _torch_mod = importlib.import_module("torch")
            _LEAVES.add(_torch_mod.Tensor)
        except ImportError:
            _torch_missing = True
    return _torch_mod


def _is_torch_tensor(obj: Any) -> bool:
    # A torch tensor can only exist if torch is already imported, so never import it here.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _from_numpy_ro(torch: Any, arr: np.ndarray) -> Any:
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


# ----------------------------------------------------------------------------- packing


class Packed:
    """Result of `pack`: the header and a layout of tensor bytes, not yet copied.

    Holds references to the source tensors (not copies): they must not be mutated until
    `write_into`/`to_bytes` has run.
    """

    __slots__ = ("_chunks", "header", "nbytes", "num_tensors")

    def __init__(self, header: bytes, nbytes: int, chunks: list[tuple[int, np.ndarray]]) -> None:
        self.header = header
        self.nbytes = nbytes  # total size of the tensor buffer (0 when there are no tensors)
        self.num_tensors = len(chunks)
        self._chunks = chunks  # (offset, flat uint8 view of the source bytes)

    def write_into(
        self, buf: memoryview | bytearray | np.ndarray, start: int = 0, stop: int | None = None
    ) -> None:
        """Copies every tensor's bytes into `buf` (len >= nbytes) at its offset.

        `buf` may also be a flat uint8 numpy array (saves wrapping a memoryview per call).
        `start`/`stop`: copy only the buffer bytes in [start, stop), so several threads can
        each write one part of a large payload.
        """
        if not self._chunks:
            return
        dst = buf if type(buf) is np.ndarray else np.frombuffer(buf, dtype=np.uint8)
        if dst.size < self.nbytes:
            raise PayloadError(f"target buffer of {dst.size} bytes is smaller than {self.nbytes}")
        if start == 0 and stop is None:  # every put: no clipping per tensor
            for off, src in self._chunks:
                np.copyto(dst[off : off + src.size], src)
            return
        stop = self.nbytes if stop is None else stop
        if not 0 <= start <= stop <= self.nbytes:
            raise ValueError(f"byte range [{start}, {stop}) outside [0, {self.nbytes})")
        for off, src in self._chunks:
            lo, hi = max(start, off), min(stop, off + src.size)
            if lo < hi:
                np.copyto(dst[lo:hi], src[lo - off : hi - off])

    @property
    def chunks(self) -> list[tuple[int, np.ndarray]]:
        """(offset in the buffer, flat uint8 view of the source) of each tensor."""
        return self._chunks

    def to_bytes(self) -> bytes:
        """The tensor buffer as bytes (for inline transport)."""
        if len(self._chunks) == 1 and self._chunks[0][0] == 0:
            src = self._chunks[0][1]
            if src.size == self.nbytes:
                return src.tobytes()
        out = bytearray(self.nbytes)
        self.write_into(out)
        return bytes(out)

    def __repr__(self) -> str:
        return (
            f"Packed(header={len(self.header)}B, nbytes={self.nbytes}, tensors={self.num_tensors})"
        )


class _Encoder:
    def __init__(self, align: int) -> None:
        self.align = align
        self.cursor = 0
        self.chunks: list[tuple[int, np.ndarray]] = []
        # id(source) -> placeholder, so a tensor referenced twice is stored once.
        self.seen: dict[int, msgpack.ExtType] = {}
        self.keep: list[Any] = []  # keeps ids in `seen` valid
        self.packer = msgpack.Packer()

    def enc(self, obj: Any, depth: int) -> Any:
        t = type(obj)
        if t in _SIMPLE:
            return obj
        if t is int:
            if _INT_MIN <= obj <= _INT_MAX:
                return obj
            raise PayloadError("integer does not fit in 64 bits")
        if t in _CONTAINERS:
            if depth >= MAX_DEPTH:
                raise PayloadError(f"nesting deeper than {MAX_DEPTH}")
            if t is dict:
                return self.enc_dict(obj, depth + 1)
            items = self.enc_list(obj, depth + 1)
            if t is tuple:
                return _ext(_EXT_TUPLE, self.packer.pack(items))
            return items
        if isinstance(obj, np.ndarray):
            return self.tensor(obj, "numpy")
        if _is_torch_tensor(obj):
            return self.tensor(obj, "torch")
        if isinstance(obj, np.generic):
            value = obj.item()
            if type(value) in _SIMPLE or type(value) in (int, complex):
                return self.enc(value, depth)
            raise PayloadError(f"unsupported numpy scalar {obj.dtype}")
        if t is complex:
            return _ext(_EXT_COMPLEX, self.packer.pack([obj.real, obj.imag]))
        raise PayloadError(f"unsupported type {t.__name__}")

    def enc_dict(self, obj: dict, depth: int) -> dict:
        out = {}
        for k, v in obj.items():
            if type(k) is not str and type(k) is not int:
                raise PayloadError(f"dict key {k!r} must be str or int", [_seg(str(k))])
            if type(v) in _SIMPLE:
                out[k] = v
                continue
            try:
                out[k] = self.enc(v, depth)
            except PayloadError as e:
                raise e._add(_seg(k)) from None
        return out

    def enc_list(self, obj: list | tuple, depth: int) -> list:
        out = []
        append = out.append
        for i, v in enumerate(obj):
            tv = type(v)
            if tv in _SIMPLE or (tv is int and _INT_MIN <= v <= _INT_MAX):
                append(v)
                continue
            try:
                append(self.enc(v, depth))
            except PayloadError as e:
                raise e._add(f"[{i}]") from None
        return out

    def tensor(self, obj: Any, kind: str) -> msgpack.ExtType:
        known = self.seen.get(id(obj))
        if known is not None:
            return known
        device = ""
        if kind == "numpy":
            dtype_name, arr = _numpy_source(obj)
        else:
            dtype_name, arr, device = _torch_source(obj)
        flat = _flat_u8(arr)
        itemsize = _NP_DTYPES[dtype_name].itemsize
        step = self.align if self.align >= itemsize else itemsize
        nbytes = flat.size
        offset = 0
        if nbytes:
            offset = -(-self.cursor // step) * step
            self.chunks.append((offset, flat))
            self.cursor = offset + nbytes
        spec = [kind, dtype_name, list(obj.shape), offset, nbytes]
        if device:
            spec.append(device)
        ext = _ext(_EXT_TENSOR, self.packer.pack(spec))
        self.seen[id(obj)] = ext
        self.keep.append(obj)
        return ext


_U8 = np.dtype(np.uint8)


def _flat_u8(arr: np.ndarray) -> np.ndarray:
    """Flat uint8 view of a contiguous array's bytes; reshape/view are skipped when already
    flat bytes because they cost more than the rest of a small pack."""
    if arr.ndim != 1:
        arr = arr.reshape(-1)
    return arr if arr.dtype is _U8 else arr.view(np.uint8)


def _numpy_source(obj: np.ndarray) -> tuple[str, np.ndarray]:
    if isinstance(obj, np.ma.MaskedArray):
        raise PayloadError("masked arrays are not supported")
    arr = np.asarray(obj)
    dtype_name = arr.dtype.name
    if dtype_name not in _NP_DTYPES or dtype_name == "bfloat16":
        raise PayloadError(f"unsupported numpy dtype {arr.dtype}")
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    return dtype_name, np.ascontiguousarray(arr)


_TORCH_NAMES: dict[Any, str] = {}


def _torch_source(obj: Any) -> tuple[str, np.ndarray, str]:
    """(dtype name, host bytes, device type: "" on the CPU)."""
    if not _TORCH_NAMES:
        torch = sys.modules["torch"]
        for name in _NP_DTYPES:
            _TORCH_NAMES[getattr(torch, name)] = name
    dtype_name = _TORCH_NAMES.get(obj.dtype)
    if dtype_name is not None and dtype_name != "bfloat16" and obj.is_contiguous():
        # The common case in one call: numpy() refuses tensors on other devices, with a
        # gradient, conj or neg bits, or a non-strided layout; those take the path below.
        try:
            return dtype_name, obj.numpy(), ""
        except Exception:
            pass
    return _torch_source_slow(obj)


# Device types whose tensors are staged through host memory (their type is recorded).
_STAGED_DEVICES = frozenset({"cuda", "xpu", "mps"})


def _torch_source_slow(obj: Any) -> tuple[str, np.ndarray, str]:
    torch = sys.modules["torch"]
    device = ""
    if not obj.is_cpu:
        if obj.device.type not in _STAGED_DEVICES:
            raise PayloadError(f"tensor on {obj.device}: only CPU and GPU tensors can be sent")
        device = obj.device.type
        # Staged through host memory: one device-to-host copy (synchronous, so the bytes
        # are there before anything reads them).
        obj = obj.detach().to("cpu")
    if obj.layout is not torch.strided:
        raise PayloadError(f"unsupported tensor layout {obj.layout}")
    dtype_name = _TORCH_NAMES.get(obj.dtype)
    if dtype_name is None:
        raise PayloadError(f"unsupported torch dtype {obj.dtype}")
    # Each of these costs ~1 us even when it does nothing, so only call what applies.
    t = obj.detach() if obj.requires_grad else obj
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    if dtype_name == "bfloat16":  # numpy has no bfloat16: move its raw bits
        t = t.view(torch.int16)
    return dtype_name, t.numpy(), device


def pack(obj: Any, *, align: int = 64) -> Packed:
    """Splits `obj` into a msgpack header and a layout of tensor bytes (not copied yet).

    Raises PayloadError naming the path of anything it cannot encode.
    """
    if align < 1 or align & (align - 1):
        raise ValueError(f"align must be a power of two, got {align}")
    torch = sys.modules.get("torch")  # a torch tensor exists only if torch is imported
    if torch is not None and obj.__class__ is torch.Tensor:
        return _pack_tensor(obj)
    enc = _Encoder(align)
    tree = enc.enc(obj, 0)
    try:
        header = enc.packer.pack([_VERSION, enc.cursor, tree])
    except Exception as e:  # e.g. a str with lone surrogates
        raise PayloadError(f"cannot encode header: {e}") from None
    return Packed(header, enc.cursor, enc.chunks)


# Headers of lone tensors by (dtype name, shape): a stream sends the same shapes over and
# over, and the two msgpack calls cost more than the rest of the header. Bounded: cleared
# when full, so shapes that keep changing cost a rebuild, never memory.
_TENSOR_HEADERS: dict[tuple[str, tuple[int, ...], str], bytes] = {}
_TENSOR_HEADERS_MAX = 256


def _pack_tensor(obj: Any) -> Packed:
    """`pack` of a payload that is one torch tensor (the usual relayed payload): the same
    header as the general path (offset 0 suits every alignment), without its walk."""
    dtype_name, arr, device = _torch_source(obj)
    flat = _flat_u8(arr)
    nbytes = flat.size
    key = (dtype_name, obj.shape, device)
    header = _TENSOR_HEADERS.get(key)
    if header is None:
        fields = ["torch", dtype_name, list(obj.shape), 0, nbytes]
        spec = msgpack.packb([*fields, device] if device else fields)
        header = msgpack.packb([_VERSION, nbytes, _ext(_EXT_TENSOR, spec)])
        if len(_TENSOR_HEADERS) >= _TENSOR_HEADERS_MAX:
            _TENSOR_HEADERS.clear()
        _TENSOR_HEADERS[key] = header
    return Packed(header, nbytes, [(0, flat)] if nbytes else [])


# ----------------------------------------------------------------------------- unpacking


class _Decoder:
    def __init__(
        self, buf: memoryview, copy: bool, numpy_only: bool = False, device: str | None = None
    ) -> None:
        self.buf = buf
        self.copy = copy
        self.numpy_only = numpy_only
        self.device = device
        self.ext_depth = 0
        self.specs: list[_TensorSpec] = []

    def load(self, data: bytes) -> Any:
        return msgpack.unpackb(
            data, ext_hook=self.ext_hook, raw=False, strict_map_key=False, use_list=True
        )

    def ext_hook(self, code: int, data: bytes) -> Any:
        if code == _EXT_TENSOR:
            return self.tensor(msgpack.unpackb(data, raw=False, use_list=True))
        if code == _EXT_TUPLE:
            self.ext_depth += 1
            if self.ext_depth > MAX_DEPTH:
                raise PayloadError(f"nesting deeper than {MAX_DEPTH}")
            try:
                items = self.load(data)
            finally:
                self.ext_depth -= 1
            if type(items) is not list:
                raise PayloadError("tuple ext does not hold an array")
            return tuple(items)
        if code == _EXT_COMPLEX:
            parts = msgpack.unpackb(data, raw=False)
            if (
                type(parts) is not list
                or len(parts) != 2
                or not all(type(p) is float for p in parts)
            ):
                raise PayloadError("bad complex ext")
            return complex(parts[0], parts[1])
        raise PayloadError(f"unknown ext type {code}")

    def tensor(self, spec: Any) -> Any:
        if type(spec) is not list or len(spec) not in (5, 6):
            raise PayloadError("bad tensor placeholder")
        kind, dtype_name, shape, offset, nbytes = spec[:5]
        on = spec[5] if len(spec) == 6 else ""
        if kind not in ("torch", "numpy"):
            raise PayloadError(f"unknown tensor kind {kind!r}")
        if on and (on not in _STAGED_DEVICES or kind != "torch"):
            raise PayloadError(f"bad tensor device {on!r}")
        if type(dtype_name) is not str or dtype_name not in _NP_DTYPES:
            raise PayloadError(f"unknown dtype {dtype_name!r}")
        if kind == "numpy" and dtype_name == "bfloat16":
            raise PayloadError("numpy tensors cannot be bfloat16")
        if (
            type(shape) is not list
            or len(shape) > _MAX_NDIM
            or not all(type(d) is int and d >= 0 for d in shape)
        ):
            raise PayloadError(f"bad tensor shape {shape!r}")
        if type(offset) is not int or type(nbytes) is not int or offset < 0 or nbytes < 0:
            raise PayloadError("bad tensor offset or size")
        dtype = _NP_DTYPES[dtype_name]
        count = math.prod(shape)
        if count * dtype.itemsize != nbytes:
            raise PayloadError(
                f"tensor of shape {shape} and dtype {dtype_name} is not {nbytes} bytes"
            )
        if offset % dtype.itemsize:
            raise PayloadError(f"tensor offset {offset} is not aligned to its dtype")
        checked = _TensorSpec(kind, dtype_name, dtype, tuple(shape), offset, nbytes, count, on)
        self.specs.append(checked)
        return checked.build(self.buf, self.copy, self.numpy_only, self.device)


@dataclass(slots=True)
class _TensorSpec:
    """A tensor placeholder that passed every check; `build` only checks it fits `buf`."""

    kind: str
    dtype_name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    count: int
    on: str = ""  # the device type the sender had it on ("" for the CPU)

    def build(
        self, buf: memoryview, copy: bool, numpy_only: bool, device: str | None = None
    ) -> Any:
        offset, nbytes = self.offset, self.nbytes
        if offset + nbytes > len(buf):
            raise PayloadError(
                f"tensor at offset {offset} of {nbytes} bytes lies outside the buffer "
                f"of {len(buf)} bytes"
            )
        if self.count == 0:
            arr = np.empty(self.shape, self.dtype)
        else:
            arr = np.frombuffer(buf, self.dtype, self.count, offset).reshape(self.shape)
        if copy:
            arr = arr.copy()
        elif arr.flags.writeable:
            arr.flags.writeable = False
        if self.kind == "numpy" or numpy_only:
            return arr
        torch = _torch()
        if torch is None:
            return arr
        t = torch.from_numpy(arr) if copy else _from_numpy_ro(torch, arr)
        if self.dtype_name == "bfloat16":
            t = t.view(torch.bfloat16)
        if self.on and device is not None:
            # A device tensor at the sender goes onto the receiver's device (a copy: the
            # relay's view is released as usual).
            t = t.to(device)
        return t


# Headers that decoded to one tensor and nothing else, with its checked spec: a stream
# receives the same header over and over, and msgpack plus the checks cost more than
# building the view. Bounded like the sender's cache.
_LONE_SPECS: dict[bytes, _TensorSpec] = {}
_LONE_SPECS_MAX = 256


def _check_tree(obj: Any, depth: int) -> None:
    """Rejects nesting deeper than MAX_DEPTH and keys or leaves `pack` never produces."""
    if depth > MAX_DEPTH:
        raise PayloadError(f"nesting deeper than {MAX_DEPTH}")
    if type(obj) is dict:
        for k, v in obj.items():
            if type(k) is not str and type(k) is not int:
                raise PayloadError(f"dict key of type {type(k).__name__}")
            if type(v) in _CONTAINERS:
                _check_tree(v, depth + 1)
            elif type(v) not in _LEAVES:
                raise PayloadError(f"unexpected value of type {type(v).__name__}")
    else:
        for v in obj:
            if type(v) in _CONTAINERS:
                _check_tree(v, depth + 1)
            elif type(v) not in _LEAVES:
                raise PayloadError(f"unexpected value of type {type(v).__name__}")


def unpack(
    header: bytes,
    buffer: bytes | memoryview | None,
    *,
    copy: bool = False,
    numpy_only: bool = False,
    device: str | None = None,
) -> Any:
    """Rebuilds the value `pack` encoded.

    copy=False: tensors are zero-copy read-only views into `buffer` (which they keep alive);
    writing to them is undefined behaviour. copy=True: owned, writable copies.
    numpy_only: torch tensors come back as numpy arrays too, and torch is never imported
    (bfloat16 as uint16 holding the raw bits).
    device: where tensors the sender had on a GPU go (the receiving stage's device, e.g.
    "cuda:0"); None leaves them on the CPU. CPU tensors stay on the CPU either way.
    """
    try:
        buf = memoryview(buffer if buffer is not None else b"")
        if buf.ndim != 1 or buf.itemsize != 1:
            buf = buf.cast("B")
        lone = _LONE_SPECS.get(header) if type(header) is bytes else None
        if lone is not None:
            return lone.build(buf, copy, numpy_only, device)
        decoder = _Decoder(buf, copy, numpy_only, device)
        envelope = decoder.load(header)
        if type(envelope) is not list or len(envelope) != 3 or envelope[0] != _VERSION:
            raise PayloadError("header is not an omnirail payload header (version 1)")
        _, nbytes, tree = envelope
        if type(nbytes) is not int or nbytes < 0:
            raise PayloadError("bad buffer size in header")
        if nbytes > len(buf):
            raise PayloadError(f"header expects {nbytes} buffer bytes, got {len(buf)}")
        if type(tree) in _CONTAINERS:
            _check_tree(tree, 1)
        elif type(tree) not in _LEAVES:
            raise PayloadError(f"unexpected value of type {type(tree).__name__}")
        elif len(decoder.specs) == 1 and type(header) is bytes:
            # A leaf that needed one tensor spec is that tensor: the header is a lone one.
            if len(_LONE_SPECS) >= _LONE_SPECS_MAX:
                _LONE_SPECS.clear()
            _LONE_SPECS[header] = decoder.specs[0]
        return tree
    except PayloadError:
        raise
    except Exception as e:  # any msgpack/numpy/torch failure on hostile input
        raise PayloadError(f"malformed payload: {type(e).__name__}: {e}") from None


# ----------------------------------------------------------------------------- inline wire


def encode_inline(value: Any) -> common_pb2.Payload:
    """A Payload carrying its buffer inline (client I/O, terminal results)."""
    packed = pack(value)
    return common_pb2.Payload(header=packed.header, inline_data=packed.to_bytes())


def decode_inline(pb: common_pb2.Payload, copy: bool = True, numpy_only: bool = False) -> Any:
    """Decodes an inline Payload; raises PayloadError when it names a relay."""
    if pb.WhichOneof("body") == "relay":
        raise PayloadError(
            f"payload uses relay backend {pb.relay.backend!r}; only inline payloads decode here"
        )
    return unpack(pb.header, pb.inline_data, copy=copy, numpy_only=numpy_only)
