"""Fuzzing of the payload codec (omnirail/wire/payload.py): encoding and decoding.

What a peer sends reaches `unpack` unchecked, and `pack` sees whatever a user passes. The
properties:

- decode: random bytes, structurally valid msgpack (random placeholders, versions, exts,
  nesting) and mutations of real headers give a value `pack` could have produced or a
  `PayloadError`: never another exception, and never tensors that claim more than the
  buffer holds (with copy=True each distinct one is a copy)
- round trip: random values (nested dicts, lists, tuples, str, bytes, ints, floats,
  complex, numpy arrays and torch tensors of every dtype, shared subvalues) come back
  equal, bit for bit and type for type; values past a limit get a `PayloadError`
- encode: random values, many unsupported (ints past 64 bits, lone surrogates, odd types
  and dtypes, bad keys, deep tuples), give a `Packed` that decodes or a `PayloadError`
  whose message prints
- determinism: decoding A, then B, then A again gives A's result both times, and B's is
  what a fresh process gets (the lone-tensor header cache is the decoder's only state)

Each property draws one byte string and builds its input from it (`Source`): hypothesis
draws cost about a millisecond each on a busy host, so inputs built from many small draws
made 10,000 examples take minutes. Built this way they take seconds, and hypothesis still
shrinks a failure, through its bytes (past their end every choice is the simplest one).
"""

from __future__ import annotations

import math
import struct
from typing import Any

import msgpack
import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from omnirail.v1 import common_pb2
from omnirail.wire import payload
from omnirail.wire.payload import (
    MAX_DEPTH,
    MAX_TUPLE_DEPTH,
    PayloadError,
    decode_inline,
    encode_inline,
    pack,
    unpack,
)

INT_MIN = -(1 << 63)
INT_MAX = (1 << 64) - 1
DTYPES = [
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
]
ITEMSIZE = {name: np.dtype(name).itemsize for name in DTYPES} | {"bfloat16": 2}
PLAIN = (str, int, float, bool, type(None), bytes, complex)
INTS = [0, 1, -1, 127, 128, 255, 256, 65535, 2**31, 2**32, 2**63 - 1, 2**63, INT_MAX, INT_MIN]
FLOATS = [0.0, -0.0, 1.5, math.inf, -math.inf, math.nan, 1e308, 5e-324, -2.5e-10]
# A few of each kind of character: ASCII, accented, CJK, emoji (4 bytes in UTF-8).
CHARS = "a\x00é中😀"
SURROGATES = "\ud800\udbff\udc00\udfff"

# At least 64 bytes: hypothesis draws most byte strings under 16 bytes long otherwise.
fuzz_bytes = st.binary(min_size=64, max_size=512)


class Source:
    """Choices read from fuzz bytes; past their end every choice is 0, the simplest."""

    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out.ljust(n, b"\0")

    def below(self, n: int) -> int:
        """0 <= choice < n (n <= 256)."""
        if self.pos >= len(self.data):
            return 0
        self.pos += 1
        return self.data[self.pos - 1] % n

    def choice(self, seq: Any) -> Any:
        return seq[self.below(len(seq))]

    def chance(self, one_in: int) -> bool:
        return self.below(one_in) == 1

    def uint(self, nbytes: int) -> int:
        return int.from_bytes(self.take(nbytes), "little")


# ----------------------------------------------------------------------------- comparing


def bits(value: Any) -> tuple[str, tuple[int, ...], bytes]:
    """(dtype, shape, raw bytes) of an array or tensor: exact, NaN payloads included."""
    if isinstance(value, torch.Tensor):
        if value.device.type == "meta":  # a stand-in for a GPU: no bytes to compare
            return str(value.dtype), tuple(value.shape), b""
        flat = value.contiguous()
        if flat.dtype == torch.bfloat16:
            return "bfloat16", tuple(flat.shape), flat.view(torch.int16).numpy().tobytes()
        return str(flat.dtype).removeprefix("torch."), tuple(flat.shape), flat.numpy().tobytes()
    arr = np.ascontiguousarray(value.astype(value.dtype.newbyteorder("=")))
    return arr.dtype.name, arr.shape, arr.tobytes()


def same(a: Any, b: Any) -> bool:
    """Equal with types, float bits, dict order and tensor bytes (so NaN == NaN)."""
    if isinstance(a, torch.Tensor | np.ndarray):
        return type(b) is type(a) and bits(a) == bits(b)
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return struct.pack("<d", a) == struct.pack("<d", b)
    if type(a) is complex:
        return same(a.real, b.real) and same(a.imag, b.imag)
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if type(a) is dict:
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return a == b


def check_decoded(value: Any, buffer_len: int) -> None:
    """What a decode may return: what `pack` accepts, with tensors inside the buffer."""
    tensors: dict[int, int] = {}

    def walk(v: Any, depth: int) -> None:
        if type(v) in (list, tuple, dict):
            assert depth <= MAX_DEPTH
            if type(v) is dict:
                assert all(type(k) in (str, int) for k in v)
                v = v.values()
            for x in v:
                walk(x, depth + 1)
        elif isinstance(v, np.ndarray):
            tensors[id(v)] = v.nbytes
        elif isinstance(v, torch.Tensor):
            tensors[id(v)] = v.numel() * v.element_size()
        else:
            assert type(v) in PLAIN, type(v)

    walk(value, 1)
    # Distinct tensors claim at most the buffer: a copying decode allocates no more.
    claimed = sum(tensors.values())
    assert claimed <= buffer_len, f"tensors of {claimed} bytes from a {buffer_len}-byte buffer"


def outcome(header: bytes, buffer: bytes, **options: Any) -> tuple[str, Any]:
    try:
        return "ok", unpack(header, buffer, **options)
    except PayloadError as e:
        return "error", str(e)


def same_outcome(a: tuple[str, Any], b: tuple[str, Any]) -> bool:
    return a[0] == b[0] and (a[1] == b[1] if a[0] == "error" else same(a[1], b[1]))


def decodes_or_refuses(header: bytes, buffer: bytes, **options: Any) -> None:
    """The decoder's contract on any input; the input is in the message of any failure."""
    try:
        value = unpack(header, buffer, **options)
    except PayloadError as e:
        # A message with a lone surrogate would make the log line reporting it fail.
        assert str(e).encode("utf-8"), "empty message"
        return
    except Exception as e:
        raise AssertionError(f"{type(e).__name__} for {header!r}, {buffer!r}") from e
    check_decoded(value, len(buffer))


def options(src: Source) -> dict[str, Any]:
    # "meta" stands in for a receiving stage's GPU: device placeholders are moved there.
    flags = src.below(12)
    device = "meta" if flags >= 8 else None
    return {"copy": bool(flags & 1), "numpy_only": bool(flags & 2), "device": device}


# ----------------------------------------------------------------------------- values


def text(src: Source, surrogates: bool = False) -> str:
    chars = CHARS + SURROGATES if surrogates else CHARS
    out = []
    for _ in range(src.below(6)):
        if src.chance(4):  # any code point outside the surrogates (unless they're wanted)
            cp = src.uint(3) % 0x110000
            if not surrogates and 0xD800 <= cp <= 0xDFFF:
                cp -= 0x800
            out.append(chr(cp))
        else:
            out.append(src.choice(chars))
    return "".join(out)


def an_int(src: Source) -> int:
    if src.chance(2):
        return src.choice(INTS)
    return src.uint(8) - (1 << 63) if src.chance(2) else src.uint(8)


def a_float(src: Source) -> float:
    if src.chance(2):
        return src.choice(FLOATS)
    return struct.unpack("<d", src.take(8))[0]  # every bit pattern, NaN payloads too


def an_array(src: Source, native: bool = False) -> np.ndarray:
    dtype = np.dtype(src.choice(DTYPES))
    shape = tuple(src.below(4) for _ in range(src.below(4)))
    raw = src.take(math.prod(shape) * dtype.itemsize)
    if dtype.kind == "b":
        raw = bytes(x & 1 for x in raw)
    arr = np.frombuffer(raw, dtype).reshape(shape).copy()
    if not native and dtype.itemsize > 1 and src.chance(6):
        arr = arr.astype(dtype.newbyteorder(">"))  # pack converts to native order
    if arr.ndim >= 2 and src.chance(2):
        arr = arr.T  # not contiguous
    return arr


def a_tensor(src: Source) -> torch.Tensor:
    arr = an_array(src, native=True)
    t = torch.from_numpy(arr)
    if arr.dtype == np.uint16 and src.chance(2):
        t = t.view(torch.bfloat16)
    elif t.dtype.is_complex and src.chance(2):
        t = t.conj()  # a lazy conjugate bit: pack resolves it
    return t


def a_value(src: Source, depth: int = 0) -> Any:
    """Any value pack accepts (tuples may nest past MAX_TUPLE_DEPTH, rarely)."""
    kind = src.below(16 if depth < 5 else 10)
    if kind == 0:
        return None
    if kind == 1:
        return src.chance(2)
    if kind == 2:
        return an_int(src)
    if kind == 3:
        return a_float(src)
    if kind == 4:
        return text(src)
    if kind == 5:
        return src.take(src.below(8))
    if kind == 6:
        return complex(a_float(src), a_float(src))
    if kind == 7:
        return an_array(src)
    if kind in (8, 9):
        return a_tensor(src) if kind == 8 else src.choice([None, 0, "", 1.5])
    items = [a_value(src, depth + 1) for _ in range(src.below(4))]
    if kind in (10, 11):
        return items
    if kind in (12, 13):
        return tuple(items)
    return {text(src) if src.chance(2) else an_int(src): item for item in items}


def tuple_depth(value: Any) -> int:
    if type(value) is tuple:
        return 1 + max(map(tuple_depth, value), default=0)
    if type(value) is list:
        return max(map(tuple_depth, value), default=0)
    if type(value) is dict:
        return max(map(tuple_depth, value.values()), default=0)
    return 0


def resolved(value: Any) -> Any:
    """What a round trip of `value` gives back: conjugate bits resolved."""
    if isinstance(value, torch.Tensor):
        return value.resolve_conj()
    if type(value) in (list, tuple):
        return type(value)(resolved(v) for v in value)
    if type(value) is dict:
        return {k: resolved(v) for k, v in value.items()}
    return value


@given(fuzz_bytes)
def test_round_trip_gives_back_what_was_packed(data):
    src = Source(data)
    how = src.below(16)
    value = a_value(src)
    if how & 1:
        value = {"a": value, "b": [value]}  # the same objects twice: stored once
    if tuple_depth(value) > MAX_TUPLE_DEPTH:
        try:
            pack(value)
        except PayloadError as e:
            assert "tuple nesting deeper" in str(e)
            return
        raise AssertionError(f"pack accepted tuples nested past the limit: {value!r}")
    copy = bool(how & 2)
    if how & 4:
        wire = common_pb2.Payload.FromString(encode_inline(value).SerializeToString())
        out = decode_inline(wire, copy=copy)
    else:
        packed = pack(value, align=(1, 8, 64, 64)[how >> 2 & 3])
        out = unpack(packed.header, packed.to_bytes(), copy=copy)
    assert same(resolved(value), out), (value, out)


# ----------------------------------------------------------------------------- encoding

CYCLE: list = []
CYCLE.append(CYCLE)
ODD_VALUES = [
    object(),
    {1, 2},
    bytearray(b"x"),
    memoryview(b"x"),
    CYCLE,
    len,
    np.float16(1.5),
    np.int64(-3),
    np.uint64(INT_MAX),
    np.complex64(1 + 2j),
    np.longdouble(1.5),
    np.str_("x"),
    np.bytes_(b"x"),
    np.datetime64("2020-01-01"),
    np.array(["x"]),
    np.zeros(2, dtype=object),
    np.zeros(2, dtype=[("a", "i4")]),
    np.zeros(2, dtype=np.longdouble),
    np.zeros((1,) * 33),
    np.ma.masked_array([1, 2], mask=[0, 1]),
    torch.zeros(2, dtype=torch.float8_e4m3fn),
    torch.zeros(2).to_sparse(),
    torch.zeros(2, device="meta"),
    torch.zeros(2, requires_grad=True),
    torch.zeros(1, 0, 3)[:, :, ::2],
    torch.nn.Parameter(torch.ones(2)),
]


def an_odd_key(src: Source) -> Any:
    return src.choice(
        [
            lambda: text(src, surrogates=True),
            lambda: an_int(src) << src.below(80),  # past 64 bits too
            lambda: a_float(src),
            lambda: src.chance(2),
            lambda: None,
            lambda: src.take(2),
            lambda: (1, "x"),
        ]
    )()


def an_odd_value(src: Source, depth: int = 0) -> Any:
    """Values pack may refuse: all of a_value's, and past its limits and types."""
    kind = src.below(12 if depth < 5 else 6)
    if kind == 0:
        return a_value(src, 5)
    if kind == 1:
        return an_int(src) << src.below(80)  # past 64 bits too
    if kind == 2:
        return text(src, surrogates=True)
    if kind == 3:
        return src.choice(ODD_VALUES)
    if kind in (4, 5):
        return a_value(src, depth)
    items = [an_odd_value(src, depth + 1) for _ in range(src.below(4))]
    if kind in (6, 7):
        return items
    if kind == 8:
        return tuple(items)
    if kind == 9:
        value: Any = items
        for _ in range(MAX_TUPLE_DEPTH + 1):
            value = (value,)
        return value
    return {an_odd_key(src): item for item in items}


@given(fuzz_bytes)
def test_encoder_raises_only_payload_error(data):
    src = Source(data)
    align = src.choice([64, 64, 64, 64, 64, 1, 8, 3])
    value = an_odd_value(src)
    try:
        packed = pack(value, align=align)
    except PayloadError as e:
        assert str(e).encode("utf-8"), "empty message"  # and it prints
        return
    except Exception as e:
        raise AssertionError(f"{type(e).__name__} packing {value!r}") from e
    # Whatever pack accepts, unpack accepts.
    check_decoded(unpack(packed.header, packed.to_bytes(), copy=True), packed.nbytes)


# ----------------------------------------------------------------------------- decoding


class Placeholders:
    """Tensor placeholders for one header: mostly well formed and inside its buffer (so that
    they decode), each field sometimes not; often overlapping, or repeating an earlier one
    byte for byte (as pack does for a tensor referenced twice)."""

    def __init__(self, src: Source, buffer_len: int) -> None:
        self.src = src
        self.buffer_len = buffer_len
        self.made: list[msgpack.ExtType] = []

    def __call__(self) -> msgpack.ExtType:
        src = self.src
        if self.made and src.chance(4):
            return src.choice(self.made)
        # Each field is bent about once in 30: a header holds several placeholders.
        kind = src.choice(["torch", "numpy"]) if src.below(32) else src.choice(["pickle", 1, ""])
        dtype = src.choice([*DTYPES, "bfloat16"]) if src.below(32) else src.choice(["object", 2])
        huge = [2**31, 2**62, INT_MAX, -1]
        dims = [src.below(4) if src.below(48) else src.choice(huge) for _ in range(src.below(3))]
        itemsize = ITEMSIZE.get(dtype, 1)
        size = math.prod(dims) * itemsize
        nbytes = size if src.below(32) and 0 <= size <= INT_MAX else src.below(64)
        offset = src.below(self.buffer_len + 1) // itemsize * itemsize
        if not src.below(32):
            offset = src.choice([0, 1, 3, self.buffer_len, INT_MAX, src.uint(8)])
        extra = [] if src.below(24) else src.choice([["cuda"], ["tpu"], [1], ["cuda", "x"]])
        fields: list[Any] = [kind, dtype, dims, offset, nbytes, *extra]
        if not src.below(32):  # a field of any type, or the fields cut short
            at = src.below(len(fields) + 1)
            fields = fields[:at] if src.chance(2) else [*fields[:at], a_msgpack_leaf(src)]
        self.made.append(msgpack.ExtType(1, msgpack.packb(fields)))
        return self.made[-1]


def a_msgpack_leaf(src: Source) -> Any:
    return src.choice(
        [
            lambda: None,
            lambda: src.chance(2),
            lambda: an_int(src),
            lambda: a_float(src),
            lambda: text(src),
            lambda: src.take(src.below(6)),
        ]
    )()


def a_msgpack_tree(src: Source, placeholder: Placeholders, depth: int = 0) -> Any:
    """msgpack of the payload's vocabulary, placeholders and exts included, sometimes bent
    (each node rarely: a tree of many nodes is bent somewhere often enough)."""
    kind = src.below(16 if depth < 5 else 7)
    if kind < 2:
        return a_msgpack_leaf(src)
    if kind < 7:
        return placeholder()
    if kind == 15:
        return src.choice(
            [
                lambda: msgpack.Timestamp(src.uint(4)),  # ext -1: never a payload's
                lambda: msgpack.ExtType(src.below(128), src.take(src.below(10))),
                lambda: msgpack.ExtType(3, msgpack.packb([a_msgpack_leaf(src), 1.5])),
                lambda: {a_msgpack_leaf(src): 1},  # keys of any type
            ]
        )()
    items = [a_msgpack_tree(src, placeholder, depth + 1) for _ in range(src.below(5))]
    if kind < 10:
        return items
    if kind < 12:
        return {text(src) if src.below(4) else an_int(src): item for item in items}
    if kind < 14:
        return msgpack.ExtType(2, msgpack.packb(items))  # tuple
    return msgpack.ExtType(3, msgpack.packb([a_float(src), a_float(src)]))  # complex


# Buffers are slices of one fixed pattern: their bytes matter less than their length, and
# they need not come out of the fuzz bytes.
PATTERN = bytes(range(256)) * 16


def a_structured_input(src: Source) -> tuple[bytes, bytes]:
    """[version, nbytes, tree] in msgpack, each part sometimes bent, and a buffer."""
    buffer = PATTERN[: src.choice([0, 8, 16, 64, 256, 4096, src.below(256)])]
    placeholder = Placeholders(src, len(buffer))
    version: Any = 1 if src.below(8) else src.choice([0, 2, True, 1.0, "1", None])
    if not src.below(16):
        version = placeholder()  # once made 'hello' decode as a tensor, on a rerun
    nbytes: Any = len(buffer) if src.below(8) else src.choice([-1, INT_MAX, 0, 7])
    if not src.below(16):
        nbytes = placeholder()
    # A lone placeholder often: the shape the decoder caches.
    tree = placeholder() if src.chance(3) else a_msgpack_tree(src, placeholder)
    form = src.below(16)
    if form == 14:
        return msgpack.packb(tree), buffer
    if form == 15:
        return msgpack.packb([version, nbytes, tree, None][: src.choice([2, 4])]), buffer
    return msgpack.packb([version, nbytes, tree]), buffer


def a_packed_input(src: Source) -> tuple[bytes, bytes]:
    """A real header and buffer, then perhaps bytes set, cut or inserted; buffer cut."""
    value = a_tensor(src) if src.chance(3) else a_value(src)
    try:
        packed = pack(value)
    except PayloadError:  # tuples nested too deep
        packed = pack(None)
    header, buffer = bytearray(packed.header), packed.to_bytes()
    for _ in range(src.below(4)):
        at = src.below(256) % (len(header) + 1)
        op = src.below(3)
        if op == 0 and at < len(header):
            header[at] = src.below(256)
        elif op == 1:
            header[at:at] = src.take(1 + src.below(3))
        else:
            del header[at:]
    if src.chance(4):
        buffer = buffer[: src.below(256) % (len(buffer) + 1)]
    return bytes(header), buffer


def a_decode_input(src: Source) -> tuple[bytes, bytes]:
    kind = src.below(3)
    if kind == 0:
        return src.take(src.below(64)), src.take(src.below(64))
    if kind == 1:
        return a_structured_input(src)
    return a_packed_input(src)


@given(fuzz_bytes)
def test_decoder_on_random_bytes(data):
    # The first bytes pick the options and split the rest into header and buffer.
    src = Source(data)
    opts = options(src)
    cut = src.below(256) % (len(data) + 1)
    decodes_or_refuses(data[src.pos : src.pos + cut], data[src.pos + cut :], **opts)


@given(fuzz_bytes)
def test_decoder_on_structured_headers(data):
    src = Source(data)
    opts = options(src)
    decodes_or_refuses(*a_structured_input(src), **opts)


@given(fuzz_bytes)
def test_decoder_on_mutated_real_headers(data):
    src = Source(data)
    opts = options(src)
    decodes_or_refuses(*a_packed_input(src), **opts)


@given(fuzz_bytes)
def test_decoding_never_depends_on_what_was_decoded_before(data):
    src = Source(data)
    opts = options(src)
    a = a_decode_input(src)
    b = a_decode_input(src)
    if src.chance(2):
        b = (a[0], b[1])  # the header cache is keyed on the header's bytes alone
    # The lone-tensor header cache is the decoder's only state; emptied, it is a fresh one.
    payload._LONE_SPECS.clear()
    first = outcome(*a, **opts)
    after_a = outcome(*b, **opts)
    again = outcome(*a, **opts)
    assert same_outcome(first, again), (a, first, again)
    payload._LONE_SPECS.clear()
    fresh = outcome(*b, **opts)
    assert same_outcome(after_a, fresh), (b, after_a, fresh)
