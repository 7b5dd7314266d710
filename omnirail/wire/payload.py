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

Tensor bytes: each distinct tensor has its own range of the buffer; a tensor referenced
twice repeats its placeholder byte for byte, and identical placeholders decode to one shared
object. Distinct placeholders so claim at most ``nbytes`` bytes in all, and a decoder refuses
more (overlapping ranges would make a copying decode allocate many times the buffer).

Limits (payload_common.py says why each is where it is): `pack` refuses values past them,
and `unpack` refuses headers past them before doing the work they bound, in milliseconds:

- nesting at most MAX_DEPTH deep, tuples at most MAX_TUPLE_DEPTH (a tuple's ext data
  repeats its contents: tuple depth multiplies the bytes a decoder copies)
- per header: MAX_ITEMS values in arrays and maps (a map entry is two), MAX_CONTAINERS
  arrays, maps and exts (a tuple is two), MAX_TENSORS placeholders (repeats included)
- ints (dict keys too) in [-2**63, 2**64 - 1]; strs valid UTF-8; a placeholder's ext data
  at most 512 bytes, a complex's 19; a shape at most 32 dims, describing < 2**63 bytes

The header's byte size is the transport's to bound (``max_message_mb``): what a decode
costs grows with its number of objects, which the limits bound.

Imports without torch; torch is imported lazily only when a torch tensor is met. Without
torch, "torch" placeholders decode as numpy arrays (bfloat16 as uint16 holding the raw bits).
"""

from __future__ import annotations

import sys
from typing import Any

import msgpack
import numpy as np

from omnirail.v1 import common_pb2
from omnirail.wire.payload_common import (
    CONTAINERS,
    INT_MAX,
    INT_MIN,
    LEAVES,
    MAX_COMPLEX_BYTES,
    MAX_CONTAINERS,
    MAX_DEPTH,
    MAX_ITEMS,
    MAX_NDIM,
    MAX_SPEC_BYTES,
    MAX_TENSORS,
    MAX_TUPLE_DEPTH,
    NP_DTYPES,
    STAGED_DEVICES,
    Budget,
    PayloadError,
    TensorSpec,
    check_spec,
    check_tree,
    is_torch_tensor,
    seg,
    unencodable,
)

__all__ = [
    "MAX_CONTAINERS",
    "MAX_DEPTH",
    "MAX_ITEMS",
    "MAX_TENSORS",
    "MAX_TUPLE_DEPTH",
    "Packed",
    "PayloadError",
    "decode_inline",
    "encode_inline",
    "pack",
    "unpack",
]

_VERSION = 1
_EXT_TENSOR = 1
_EXT_TUPLE = 2
_EXT_COMPLEX = 3

# Leaves that need no conversion on either side (ints are range-checked separately).
_SIMPLE = frozenset({str, float, bool, type(None), bytes})


def _ext(code: int, data: bytes) -> msgpack.ExtType:
    # ExtType's own constructor re-validates its arguments in Python (~0.7 us, a tenth of a
    # small pack); ours are always an int code and bytes.
    return tuple.__new__(msgpack.ExtType, (code, data))


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


class _Encoder(Budget):
    def __init__(self, align: int) -> None:
        # What a decoder will count, starting with the envelope (an array of three items).
        super().__init__(3, 1)
        self.align = align
        self.cursor = 0
        self.chunks: list[tuple[int, np.ndarray]] = []
        # id(source) -> placeholder, so a tensor referenced twice is stored once.
        self.seen: dict[int, msgpack.ExtType] = {}
        self.keep: list[Any] = []  # keeps ids in `seen` valid
        self.packer = msgpack.Packer()
        self.tuple_depth = 0

    def enc(self, obj: Any, depth: int) -> Any:
        t = type(obj)
        if t in _SIMPLE:
            return obj
        if t is int:
            if INT_MIN <= obj <= INT_MAX:
                return obj
            raise PayloadError("integer does not fit in 64 bits")
        if t in CONTAINERS:
            if depth >= MAX_DEPTH:
                raise PayloadError(f"nesting deeper than {MAX_DEPTH}")
            if t is tuple:
                return self.enc_tuple(obj, depth + 1)
            # Budget.add inline: a call would cost more than the rest of a small container.
            self.items += 2 * len(obj) if t is dict else len(obj)
            self.containers += 1
            if self.items > MAX_ITEMS or self.containers > MAX_CONTAINERS:
                self.refuse()
            if t is dict:
                return self.enc_dict(obj, depth + 1)
            return self.enc_list(obj, depth + 1)
        if isinstance(obj, np.ndarray):
            return self.tensor(obj, "numpy")
        if is_torch_tensor(obj):
            return self.tensor(obj, "torch")
        if isinstance(obj, np.generic):
            value = obj.item()
            if type(value) in _SIMPLE or type(value) in (int, complex):
                return self.enc(value, depth)
            raise PayloadError(f"unsupported numpy scalar {obj.dtype}")
        if t is complex:
            self.add(0, 1)
            return _ext(_EXT_COMPLEX, self.packer.pack([obj.real, obj.imag]))
        raise PayloadError(f"unsupported type {t.__name__}")

    def enc_tuple(self, obj: tuple, depth: int) -> msgpack.ExtType:
        if self.tuple_depth >= MAX_TUPLE_DEPTH:
            raise PayloadError(f"tuple nesting deeper than {MAX_TUPLE_DEPTH}")
        self.add(len(obj), 2)  # a decoder meets its ext, then its array
        self.tuple_depth += 1
        try:
            items = self.enc_list(obj, depth)
        finally:
            self.tuple_depth -= 1
        try:
            return _ext(_EXT_TUPLE, self.packer.pack(items))
        except Exception as e:  # e.g. a str with lone surrogates
            raise unencodable(obj, e) from None

    def enc_dict(self, obj: dict, depth: int) -> dict:
        out = {}
        for k, v in obj.items():
            tk = type(k)
            if tk is not str and (tk is not int or not INT_MIN <= k <= INT_MAX):
                reason = "does not fit in 64 bits" if tk is int else "must be str or int"
                raise PayloadError(f"dict key {k!r} {reason}", [seg(k if tk is int else str(k))])
            if type(v) in _SIMPLE:
                out[k] = v
                continue
            try:
                out[k] = self.enc(v, depth)
            except PayloadError as e:
                raise e._add(seg(k)) from None
        return out

    def enc_list(self, obj: list | tuple, depth: int) -> list:
        out = []
        append = out.append
        for i, v in enumerate(obj):
            tv = type(v)
            if tv in _SIMPLE or (tv is int and INT_MIN <= v <= INT_MAX):
                append(v)
                continue
            try:
                append(self.enc(v, depth))
            except PayloadError as e:
                raise e._add(f"[{i}]") from None
        return out

    def tensor(self, obj: Any, kind: str) -> msgpack.ExtType:
        self.add_tensor()
        known = self.seen.get(id(obj))
        if known is not None:
            return known
        device = ""
        if kind == "numpy":
            dtype_name, arr = _numpy_source(obj)
        else:
            dtype_name, arr, device = _torch_source(obj)
        flat = _flat_u8(arr)
        itemsize = NP_DTYPES[dtype_name].itemsize
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
        if not nbytes or len(spec[2]) > MAX_NDIM:  # the only shapes a decoder could refuse
            check_spec(spec)
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
    if dtype_name not in NP_DTYPES or dtype_name == "bfloat16":
        raise PayloadError(f"unsupported numpy dtype {arr.dtype}")
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    return dtype_name, np.ascontiguousarray(arr)


_TORCH_NAMES: dict[Any, str] = {}


def _torch_source(obj: Any) -> tuple[str, np.ndarray, str]:
    """(dtype name, host bytes, device type: "" on the CPU)."""
    if not _TORCH_NAMES:
        torch = sys.modules["torch"]
        for name in NP_DTYPES:
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


def _torch_source_slow(obj: Any) -> tuple[str, np.ndarray, str]:
    torch = sys.modules["torch"]
    device = ""
    if not obj.is_cpu:
        if obj.device.type not in STAGED_DEVICES:
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
    if type(align) is not int or align < 1 or align & (align - 1):
        raise PayloadError(f"align must be a power of two, got {align!r}")
    try:
        torch = sys.modules.get("torch")  # a torch tensor exists only if torch is imported
        if torch is not None and obj.__class__ is torch.Tensor:
            return _pack_tensor(obj)
        enc = _Encoder(align)
        tree = enc.enc(obj, 0)
        try:
            header = enc.packer.pack([_VERSION, enc.cursor, tree])
        except Exception as e:  # e.g. a str with lone surrogates
            raise unencodable(obj, e) from None
        return Packed(header, enc.cursor, enc.chunks)
    except PayloadError:
        raise
    except Exception as e:  # torch or numpy refusing an odd value: still the typed error
        raise PayloadError(f"cannot encode value: {type(e).__name__}: {e}") from None


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
        if not nbytes or len(fields[2]) > MAX_NDIM:  # the only shapes a decoder could refuse
            check_spec(fields)
        spec = msgpack.packb([*fields, device] if device else fields)
        header = msgpack.packb([_VERSION, nbytes, _ext(_EXT_TENSOR, spec)])
        if len(_TENSOR_HEADERS) >= _TENSOR_HEADERS_MAX:
            _TENSOR_HEADERS.clear()
        _TENSOR_HEADERS[key] = header
    return Packed(header, nbytes, [(0, flat)] if nbytes else [])


# ----------------------------------------------------------------------------- unpacking


class _Decoder(Budget):
    """One decode: msgpack with hooks that count what it builds and refuse past the limits
    (so a hostile header costs at most the limits' worth of work), and the tensors built."""

    __slots__ = (
        "buf",
        "built",
        "copy",
        "counted",
        "device",
        "last",
        "numpy_only",
        "tensor_bytes",
        "tuple_depth",
    )

    def __init__(
        self, buf: memoryview, copy: bool, numpy_only: bool, device: str | None, counted: bool
    ) -> None:
        self.items = self.containers = self.tensors = 0  # Budget's counts, inline
        self.buf = buf
        self.copy = copy
        self.numpy_only = numpy_only
        self.device = device
        self.counted = counted  # whether arrays and maps are counted too (exts always are)
        self.tuple_depth = 0
        # Placeholder ext data -> its tensor: identical placeholders (a tensor the sender
        # referenced twice) decode to one object, so a header that repeats one 16 KiB times
        # costs one copy, not 16 Ki of them.
        self.built: dict[bytes, Any] = {}
        self.last: tuple[TensorSpec | None, Any] = (None, None)  # (spec, tensor) last built
        self.tensor_bytes = 0  # sum of the distinct placeholders' sizes

    def load(self, data: bytes) -> Any:
        try:
            if not self.counted:
                return msgpack.unpackb(
                    data, ext_hook=self.ext_hook, raw=False, strict_map_key=False
                )
            # Lengths are checked by msgpack as it reads them, before the items; the hooks
            # count what was built. object_pairs_hook, not object_hook: a map's entries are
            # counted as read, even those a repeated key then overwrites in the dict.
            return msgpack.unpackb(
                data,
                ext_hook=self.ext_hook,
                list_hook=self.list_hook,
                object_pairs_hook=self.pairs_hook,
                raw=False,
                strict_map_key=False,
                max_array_len=MAX_ITEMS,
                max_map_len=MAX_ITEMS // 2,
            )
        except ValueError as e:
            if isinstance(e, PayloadError) or "exceeds max_" not in str(e):
                raise
            raise PayloadError(f"header exceeds a decode limit: {e}") from None

    def list_hook(self, obj: list) -> list:
        self.add(len(obj), 1)
        return obj

    def pairs_hook(self, pairs: list[tuple[Any, Any]]) -> dict:
        self.add(2 * len(pairs), 1)
        return dict(pairs)

    def ext_hook(self, code: int, data: bytes) -> Any:
        # Exts are counted whether or not the other hooks are on: each costs a Python call.
        if code == _EXT_TENSOR:
            self.add_tensor()
            return self.tensor(data)
        self.add(0, 1)
        if code == _EXT_TUPLE:
            if self.tuple_depth >= MAX_TUPLE_DEPTH:
                raise PayloadError(f"tuple nesting deeper than {MAX_TUPLE_DEPTH}")
            self.tuple_depth += 1
            try:
                items = self.load(data)
            finally:
                self.tuple_depth -= 1
            if type(items) is not list:
                raise PayloadError("tuple ext does not hold an array")
            return tuple(items)
        if code == _EXT_COMPLEX:
            if len(data) > MAX_COMPLEX_BYTES:
                raise PayloadError(f"complex ext of {len(data)} bytes")
            parts = msgpack.unpackb(data, raw=False)
            if (
                type(parts) is not list
                or len(parts) != 2
                or not all(type(p) is float for p in parts)
            ):
                raise PayloadError("bad complex ext")
            return complex(parts[0], parts[1])
        raise PayloadError(f"unknown ext type {code}")

    def tensor(self, data: bytes) -> Any:
        if len(data) > MAX_SPEC_BYTES:  # first: not even hashed past this
            raise PayloadError(f"tensor placeholder of {len(data)} bytes")
        known = self.built.get(data)
        if known is not None:
            return known
        spec = check_spec(msgpack.unpackb(data, raw=False, use_list=True))
        spec.check_fits(len(self.buf))
        # Bounds what copy=True (or a move to a device) allocates: an honest header's distinct
        # tensors lie in disjoint ranges of the buffer, so their sizes sum to at most its
        # length. Overlapping placeholders past that would each be a separate copy.
        self.tensor_bytes += spec.nbytes
        if self.tensor_bytes > len(self.buf):
            raise PayloadError(
                f"tensor placeholders claim over {self.tensor_bytes} bytes of a "
                f"{len(self.buf)}-byte buffer (overlapping ranges)"
            )
        out = spec.build(self.buf, self.copy, self.numpy_only, self.device)
        self.built[data] = out
        self.last = (spec, out)
        return out


# Headers that decoded to one tensor and nothing else -> (its checked spec, the header's
# nbytes): a stream receives the same header over and over, and msgpack plus the checks cost
# more than building the view (a 4 KiB tensor: 1.9 us a hit, 5.0 us a miss). A hit redoes
# every check that depends on more than the header's bytes, in the full decode's order, so
# a decode never depends on what was decoded before. Bounded: cleared when full.
_LONE_SPECS: dict[bytes, tuple[TensorSpec, int]] = {}
_LONE_SPECS_MAX = 256


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
    writing to them is undefined behaviour. copy=True: owned, writable copies. Either way,
    identical placeholders (a tensor the sender referenced twice) give one shared object.
    numpy_only: torch tensors come back as numpy arrays too, and torch is never imported
    (bfloat16 as uint16 holding the raw bits).
    device: where tensors the sender had on a GPU go (the receiving stage's device, e.g.
    "cuda:0"); None leaves them on the CPU. CPU tensors stay on the CPU either way.
    Raises PayloadError, and nothing else, for any header or buffer it cannot decode.
    """
    try:
        buf = memoryview(buffer if buffer is not None else b"")
        if buf.ndim != 1 or buf.itemsize != 1:
            buf = buf.cast("B")
        cacheable = type(header) is bytes
        lone = _LONE_SPECS.get(header) if cacheable else None
        if lone is not None:
            spec, nbytes = lone
            spec.check_fits(len(buf))  # the checks a full decode makes, in its order
            if nbytes > len(buf):
                raise PayloadError(f"header expects {nbytes} buffer bytes, got {len(buf)}")
            return spec.build(buf, copy, numpy_only, device)
        # A msgpack object takes at least one byte, so a header this short cannot hold
        # more objects than the limits: it skips the counting hooks (~0.5 us a decode).
        counted = len(header) > MAX_CONTAINERS
        decoder = _Decoder(buf, copy, numpy_only, device, counted)
        envelope = decoder.load(header)
        if (
            type(envelope) is not list
            or len(envelope) != 3
            or type(envelope[0]) is not int
            or envelope[0] != _VERSION
        ):
            raise PayloadError("header is not an omnirail payload header (version 1)")
        _, nbytes, tree = envelope
        if type(nbytes) is not int or nbytes < 0:
            raise PayloadError("bad buffer size in header")
        if nbytes > len(buf):
            raise PayloadError(f"header expects {nbytes} buffer bytes, got {len(buf)}")
        if decoder.tensor_bytes > nbytes:
            raise PayloadError(
                f"tensor placeholders claim {decoder.tensor_bytes} bytes, more than the "
                f"header's {nbytes} (overlapping ranges)"
            )
        if type(tree) in CONTAINERS:
            check_tree(tree, 1)
        elif type(tree) not in LEAVES:
            raise PayloadError(f"unexpected value of type {type(tree).__name__}")
        elif cacheable and decoder.tensors == 1 and (last := decoder.last)[1] is tree:
            # The tree is that tensor and nothing else (a tensor hiding in the version slot
            # once made a str's header cache as a tensor's).
            if len(_LONE_SPECS) >= _LONE_SPECS_MAX:
                _LONE_SPECS.clear()
            _LONE_SPECS[header] = (last[0], nbytes)
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
