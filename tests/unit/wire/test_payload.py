"""Payload codec: round trips, zero-copy views, and hostile headers."""

from __future__ import annotations

import random
import re
import subprocess
import sys
import textwrap
import time

import msgpack
import numpy as np
import pytest
import torch

from omnirail.v1 import common_pb2
from omnirail.wire.payload import (
    MAX_CONTAINERS,
    MAX_DEPTH,
    MAX_ITEMS,
    MAX_TENSORS,
    MAX_TUPLE_DEPTH,
    PayloadError,
    decode_inline,
    encode_inline,
    pack,
    unpack,
)

NP_DTYPES = [
    np.bool_,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.float16,
    np.float32,
    np.float64,
    np.complex64,
    np.complex128,
]
TORCH_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
]


def roundtrip(value, copy=False):
    packed = pack(value)
    return unpack(packed.header, packed.to_bytes(), copy=copy)


def np_sample(dtype, shape):
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 255, size=int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
    arr = raw.view(np.uint8).copy()
    if np.dtype(dtype) == np.bool_:
        return (arr[: int(np.prod(shape))] & 1).astype(np.bool_).reshape(shape)
    out = arr.view(dtype).reshape(shape)
    if np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.complexfloating):
        out = np.asarray(np.nan_to_num(out))  # NaN != NaN would break equality checks
    return out


def torch_sample(dtype, shape):
    if dtype == torch.bool:
        return torch.arange(int(np.prod(shape))).reshape(shape) % 3 == 0
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.arange(int(np.prod(shape)), dtype=torch.int64).reshape(shape).to(dtype)


def bits(t):
    flat = t.contiguous().reshape(-1)
    if flat.dtype == torch.bfloat16:
        flat = flat.view(torch.int16)
    return flat.numpy().tobytes()


def assert_torch_equal(a, b):
    assert isinstance(b, torch.Tensor)
    assert a.dtype == b.dtype and a.shape == b.shape
    # Compare bits: an exact round trip, and no need for comparison kernels per dtype.
    assert bits(a) == bits(b)


@pytest.mark.parametrize("dtype", NP_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (7,), (3, 5)])
def test_numpy_roundtrip(dtype, shape):
    arr = np_sample(dtype, shape)
    out = roundtrip({"x": arr})["x"]
    assert isinstance(out, np.ndarray)
    assert out.dtype == arr.dtype and out.shape == arr.shape
    np.testing.assert_array_equal(out, arr)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (2, 0), (5,), (4, 3)])
def test_torch_roundtrip(dtype, shape):
    t = torch_sample(dtype, shape)
    for copy in (False, True):
        assert_torch_equal(t, roundtrip([t], copy=copy)[0])


def test_non_contiguous_inputs():
    base = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5)
    values = {
        "t_transposed": base.transpose(0, 2),
        "t_strided": base[:, ::2, 1:],
        "t_expanded": torch.ones(3, 1).expand(3, 4),
        "t_conj": torch.randn(3, dtype=torch.complex64).conj(),
        "t_neg": torch.randn(3, dtype=torch.complex64).conj().imag,
        "bf16_slice": base.to(torch.bfloat16)[::2, 1],
        "n_transposed": np.arange(12).reshape(3, 4).T,
        "n_reversed": np.arange(10, dtype=np.int16)[::-3],
        "n_bigendian": np.arange(4, dtype=">i4"),
    }
    out = roundtrip(values)
    for key, value in values.items():
        if isinstance(value, torch.Tensor):
            expected = value.resolve_conj().resolve_neg()
            assert_torch_equal(expected, out[key])
        else:
            np.testing.assert_array_equal(out[key], value)
            assert out[key].dtype.isnative


LONE_TENSORS = {
    "contiguous": torch.arange(6, dtype=torch.float32),
    "0-d": torch.tensor(3.5),
    "empty": torch.zeros(2, 0),
    "transposed": torch.arange(12).reshape(3, 4).t(),
    "bfloat16": torch.ones(3, dtype=torch.bfloat16),
    "requires_grad": torch.ones(2, requires_grad=True),
    "conj": torch.ones(2, dtype=torch.complex64).conj(),
}


@pytest.mark.parametrize("name", list(LONE_TENSORS))
def test_lone_tensor_fast_path_matches_the_general_walk(name):
    # pack() of a bare tensor skips the tree walk; wrapping it in a list takes the walk.
    t = LONE_TENSORS[name]
    lone, wrapped = pack(t), pack([t])
    assert msgpack.unpackb(lone.header, raw=False)[:2] == [1, lone.nbytes]
    assert (
        msgpack.unpackb(lone.header, raw=False)[2]
        == msgpack.unpackb(wrapped.header, raw=False)[2][0]
    )
    assert lone.to_bytes() == wrapped.to_bytes()
    assert_torch_equal(t.detach().resolve_conj(), unpack(lone.header, lone.to_bytes()))


def test_lone_tensor_headers_stay_right_past_their_cache_bound():
    from omnirail.wire import payload as payload_mod

    for n in range(payload_mod._TENSOR_HEADERS_MAX + 40):
        for dtype in (torch.uint8, torch.float32):
            t = torch.zeros(n % 7, n, dtype=dtype)
            lone = msgpack.unpackb(pack(t).header, raw=False)
            walked = msgpack.unpackb(pack({"x": t}).header, raw=False)
            assert lone[:2] == walked[:2] and lone[2] == walked[2]["x"]
            assert len(payload_mod._TENSOR_HEADERS) <= payload_mod._TENSOR_HEADERS_MAX
    again = torch.ones(3, 5)
    assert_torch_equal(again, unpack(pack(again).header, pack(again).to_bytes()))


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (torch.zeros(2, dtype=torch.float8_e4m3fn), "unsupported torch dtype"),
        (torch.zeros(2).to_sparse(), "unsupported tensor layout"),
        (torch.zeros(2, device="meta"), "only CPU and GPU tensors can be sent"),
    ],
)
def test_lone_unsupported_tensors(value, message):
    with pytest.raises(PayloadError, match=message):
        pack(value)


def test_requires_grad_tensor():
    t = torch.ones(3, requires_grad=True)
    out = roundtrip(t)
    assert not out.requires_grad
    assert out.tolist() == [1.0, 1.0, 1.0]


def test_nested_plain_values_roundtrip():
    value = {
        "none": None,
        "flags": [True, False],
        "ints": [0, -1, 2**63 - 1, -(2**63), 2**64 - 1],
        "float": 1.5,
        "text": "héllo",
        "raw": b"\x00\xff",
        "complex": 1 - 2j,
        7: "int key",
        "tuple": (1, (2, (3, [4, (5,)])), ()),
        "list_of_tuples": [(1, "a"), ("b", 2.0)],
        "empty": {"d": {}, "l": [], "t": ()},
    }
    assert roundtrip(value) == value
    out = roundtrip(value)
    assert type(out["tuple"]) is tuple and type(out["tuple"][1][1]) is tuple
    assert type(out["tuple"][1][1][1]) is list


def test_numpy_scalars_become_python():
    out = roundtrip(
        [np.int64(3), np.float32(1.5), np.bool_(True), np.uint8(7), np.complex64(1 + 1j)]
    )
    assert out == [3, 1.5, True, 7, 1 + 1j]
    assert [type(v) for v in out] == [int, float, bool, int, complex]


def test_top_level_leaves():
    for value in [None, 3, "x", b"y", 2.0, (1, 2)]:
        assert roundtrip(value) == value


def test_layout_aligned_and_lazy():
    a = np.ones(3, np.uint8)
    b = torch.ones(5, dtype=torch.float64)
    packed = pack({"a": a, "b": b, "c": [a]}, align=64)
    # `a` appears twice but is stored once.
    assert packed.num_tensors == 2
    assert packed.nbytes == 64 + 40
    a[0] = 9  # not copied at pack time: the write shows up
    out = unpack(packed.header, packed.to_bytes())
    assert out["a"][0] == 9 and out["c"][0][0] == 9
    buf = bytearray(packed.nbytes + 10)
    packed.write_into(memoryview(buf))
    assert bytes(buf[: packed.nbytes]) == packed.to_bytes()
    with pytest.raises(PayloadError):
        packed.write_into(memoryview(bytearray(packed.nbytes - 1)))


def test_no_tensors_means_empty_buffer():
    packed = pack({"a": [1, 2]})
    assert packed.nbytes == 0 and packed.num_tensors == 0 and packed.to_bytes() == b""
    assert unpack(packed.header, None) == {"a": [1, 2]}


def test_zero_copy_views_are_read_only_and_shared():
    arr = np.arange(16, dtype=np.int32)
    t = torch.arange(8, dtype=torch.float32)
    packed = pack({"n": arr, "t": t})
    buf = bytearray(packed.nbytes)
    packed.write_into(buf)
    out = unpack(packed.header, memoryview(buf))
    assert not out["n"].flags.writeable
    with pytest.raises(ValueError):
        out["n"][0] = 1
    # Views alias the buffer: a change in the buffer shows through.
    np.frombuffer(buf, np.int32)[0] = 42
    assert out["n"][0] == 42
    lo = np.frombuffer(buf, np.uint8).ctypes.data
    assert lo <= out["t"].data_ptr() < lo + len(buf)


def test_copy_true_gives_owned_writable_values():
    packed = pack({"n": np.arange(4), "t": torch.arange(4)})
    buf = bytearray(packed.to_bytes())
    out = unpack(packed.header, memoryview(buf), copy=True)
    out["n"][0] = 5
    out["t"][0] = 5
    assert out["n"].flags.writeable and out["n"].flags.owndata
    np.frombuffer(buf, np.uint8)[:] = 0
    assert out["n"].tolist() == [5, 1, 2, 3] and out["t"].tolist() == [5, 1, 2, 3]


def test_views_keep_buffer_alive():
    packed = pack(torch.arange(1000, dtype=torch.int64))
    out = unpack(packed.header, packed.to_bytes())  # the bytes object has no other owner
    import gc

    gc.collect()
    assert out.sum().item() == sum(range(1000))


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"inputs": {"images": [1, 2, {3}]}}, "inputs.images[2]: unsupported type set"),
        ({"a": [(1, object())]}, "a[0][1]: unsupported type object"),
        ({"a": {1.5: 2}}, "must be str or int"),
        ({"a": bytearray(b"x")}, "a: unsupported type bytearray"),
        ({"a": [2**64]}, "a[0]: integer does not fit"),
        ({"a": np.array(["x"])}, "unsupported numpy dtype"),
        ({"a": np.zeros(2, dtype=object)}, "unsupported numpy dtype"),
        ({"a": np.datetime64("2020-01-01")}, "unsupported numpy scalar"),
        ({"a": torch.zeros(2, dtype=torch.float8_e4m3fn)}, "unsupported torch dtype"),
        ({"a": torch.zeros(2).to_sparse()}, "unsupported tensor layout"),
        ({"a": torch.zeros(2, device="meta")}, "only CPU and GPU tensors can be sent"),
        ({"s": "\ud800"}, "s: cannot encode str as UTF-8: surrogates not allowed"),
    ],
)
def test_unsupported_values(value, message):
    with pytest.raises(PayloadError, match=message.replace("[", r"\[").replace("]", r"\]")):
        pack(value)


def nested_tuples(depth: int) -> tuple:
    value: tuple = (1,)
    for _ in range(depth - 1):
        value = (value,)
    return value


@pytest.mark.parametrize(
    ("value", "message"),
    [
        # Fuzz findings: these escaped pack() as UnicodeEncodeError / OverflowError.
        (
            ("ok", "x\udc80"),
            "[1]: cannot encode str as UTF-8: surrogates not allowed (character 1)",
        ),
        ({"a": [{"\ud800k": 1}]}, "a[0].\\ud800k: cannot encode dict key as UTF-8"),
        ([({"\udfff": 1},)], "[0][0].\\udfff: cannot encode dict key as UTF-8"),
        ({"a": {2**64: 1}}, "a[18446744073709551616]: dict key 18446744073709551616 does not fit"),
        (({-(2**63) - 1: 1},), "[0][-9223372036854775809]: dict key -9223372036854775809 does not"),
        # What a decoder would refuse is refused when packing, naming where.
        ({"t": np.zeros((1,) * 33)}, "t: tensor of 33 dimensions, more than 32"),
        (nested_tuples(MAX_TUPLE_DEPTH + 1), "[0]" * MAX_TUPLE_DEPTH + ": tuple nesting deeper"),
        ({"ids": list(range(MAX_ITEMS))}, f"ids: more than {MAX_ITEMS} items"),
        ([[]] * MAX_CONTAINERS, f"[{MAX_CONTAINERS - 2}]: more than {MAX_CONTAINERS} containers"),
        ([np.zeros(1)] * (MAX_TENSORS + 1), f"[{MAX_TENSORS}]: more than {MAX_TENSORS} tensors"),
    ],
)
def test_unencodable_values_raise_payload_error_naming_where(value, message):
    with pytest.raises(PayloadError) as info:
        pack(value)
    assert str(info.value).startswith(message)


def test_pack_failures_are_payload_errors():
    with pytest.raises(PayloadError, match="align must be a power of two"):
        pack(1, align=3)
    # torch refusing an odd tensor (too large to view as numpy) is still the typed error.
    with pytest.raises(PayloadError, match="cannot encode value: ValueError"):
        pack(torch.empty(0, 2**61))


def test_nesting_limit():
    deep = leaf = []
    for _ in range(MAX_DEPTH):
        leaf.append([])
        leaf = leaf[0]
    with pytest.raises(PayloadError, match="nesting deeper"):
        pack(deep)
    ok = leaf = []
    for _ in range(MAX_DEPTH - 1):
        leaf.append(())
        leaf = [leaf]
    pack(ok)


# ----------------------------------------------------------------------------- hostile input


def header_with(tree, nbytes=0):
    return msgpack.packb([1, nbytes, tree])


def placeholder(kind="numpy", dtype="float32", shape=(2,), offset=0, nbytes=8):
    return msgpack.ExtType(1, msgpack.packb([kind, dtype, list(shape), offset, nbytes]))


@pytest.mark.parametrize(
    "ph",
    [
        placeholder(offset=8),  # ends past the 8-byte buffer
        placeholder(offset=2**63),
        placeholder(nbytes=12),  # shape/dtype disagree with nbytes
        placeholder(shape=(-1,), nbytes=-4),
        placeholder(shape=(2**40, 2**40), nbytes=8),
        placeholder(dtype="object"),
        placeholder(dtype="bfloat16", nbytes=4),  # numpy kind cannot be bf16
        placeholder(kind="pickle"),
        placeholder(offset=2, shape=(1,), nbytes=4),  # misaligned for float32
        msgpack.ExtType(1, msgpack.packb(["numpy", "float32", [2], 0])),
        msgpack.ExtType(1, msgpack.packb({"kind": "numpy"})),
        msgpack.ExtType(1, b"\xc1"),
        msgpack.ExtType(9, b""),
        msgpack.ExtType(2, msgpack.packb({"a": 1})),
        msgpack.ExtType(3, msgpack.packb(["x", 1.0])),
    ],
)
def test_bad_placeholders_rejected(ph):
    with pytest.raises(PayloadError):
        unpack(header_with({"x": ph}, 8), bytes(8))


def test_in_bounds_placeholder_accepted():
    out = unpack(header_with({"x": placeholder()}, 8), bytes(8))
    assert out["x"].tolist() == [0.0, 0.0]


@pytest.mark.parametrize(
    "header",
    [
        b"",
        b"\xc1",
        msgpack.packb({"a": 1}),
        msgpack.packb([2, 0, None]),
        msgpack.packb([1, -1, None]),
        msgpack.packb([1, 100, None]),  # needs 100 buffer bytes
        msgpack.packb([1, 0, None]) + b"\x00",  # trailing data
        msgpack.packb([1, 0, {b"k": 1}]),
        msgpack.packb([1, 0, {True: 1}]),
        msgpack.packb([1, 0, msgpack.Timestamp(1)]),
        msgpack.packb([1, 0, [msgpack.Timestamp(1)]]),
    ],
)
def test_bad_headers_rejected(header):
    with pytest.raises(PayloadError):
        unpack(header, b"")


def test_deep_headers_rejected():
    deep = msgpack.packb([1, 0, [[[[]]]]])
    unpack(deep, None)
    raw = [1, 0]
    nested: list = []
    cur = nested
    for _ in range(MAX_DEPTH + 5):
        cur.append([])
        cur = cur[0]
    raw.append(nested)
    with pytest.raises(PayloadError, match="nesting"):
        unpack(msgpack.packb(raw), None)
    # Tuples nest through ext data, a separate path.
    data = msgpack.packb([])
    for _ in range(MAX_DEPTH + 5):
        data = msgpack.packb([msgpack.ExtType(2, data)])
    with pytest.raises(PayloadError, match="nesting"):
        unpack(msgpack.packb([1, 0, msgpack.ExtType(2, data)]), None)


def test_fuzz_random_and_mutated_headers():
    rng = random.Random(1234)
    packed = pack(
        {
            "a": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
            "b": (1, [np.arange(3)], "x"),
            "c": {"d": 1.5, 3: b"raw"},
        }
    )
    buffer = packed.to_bytes()
    header = packed.header
    for i in range(4000):
        if i % 2:
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        else:
            data = bytearray(header)
            for _ in range(rng.randrange(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            data = bytes(data)
        try:
            unpack(data, buffer)
        except PayloadError:
            pass


# ---- fuzz findings (tests/fuzz/test_payload_fuzz.py covers each class) ------------------


def ext_tuple(items: list) -> msgpack.ExtType:
    return msgpack.ExtType(2, msgpack.packb(items))


@pytest.mark.parametrize("version", [placeholder("numpy", "int64", (1,), 0, 8), True, 1.0])
def test_only_the_int_1_is_a_version_and_nothing_caches_from_a_bad_one(version):
    # A tensor in the version slot compared equal to 1 (array([True]) is truthy), and the
    # header was then cached as a lone tensor's: 'hello' once, array([1]) after.
    header = msgpack.packb([version, 8, "hello"])
    buf = np.array([1]).tobytes()
    for _ in range(3):
        with pytest.raises(PayloadError, match="not an omnirail payload header"):
            unpack(header, buf)
    assert unpack(msgpack.packb([1, 8, "hello"]), buf) == "hello"


def test_a_leaf_beside_one_tensor_is_not_cached_as_that_tensor():
    # One placeholder (in the nbytes slot, refused) and a str tree: nothing to cache.
    header = msgpack.packb([1, placeholder(), "hello"])
    for _ in range(2):
        with pytest.raises(PayloadError, match="bad buffer size"):
            unpack(header, bytes(8))


def test_a_cached_lone_tensor_header_still_checks_the_buffer_it_is_given():
    # The header asks for 16 buffer bytes, its tensor uses 8: a cache hit must still refuse
    # an 8-byte buffer as the first decode would have, then decode 16 bytes again.
    header = msgpack.packb([1, 16, placeholder("numpy", "int64", (1,), 0, 8)])
    for buf in (bytes(16), bytes(8), bytes(16)):
        if len(buf) == 8:
            with pytest.raises(PayloadError, match="header expects 16 buffer bytes, got 8"):
                unpack(header, buf)
        else:
            assert unpack(header, buf).tolist() == [0]
    short = msgpack.packb([1, 8, placeholder("numpy", "int64", (1,), 8, 8)])
    assert unpack(short, bytes(16)).tolist() == [0]
    with pytest.raises(PayloadError, match="lies outside the buffer"):
        unpack(short, bytes(8))


def test_repeated_placeholders_decode_to_one_shared_copy():
    # 16.8 KB of one placeholder over a 1 MiB buffer used to make 629 MB of copies.
    mib = 1 << 20
    ph = placeholder("numpy", "uint8", (mib,), 0, mib)
    header = msgpack.packb([1, mib, [ph] * 600])
    assert len(header) < 17_000
    out = unpack(header, bytes(mib), copy=True)
    assert len(out) == 600 and all(a is out[0] for a in out)
    assert out[0].flags.owndata and out[0].flags.writeable
    # What pack writes for a tensor referenced twice decodes shared, as the sender had it.
    a = np.arange(3)
    packed = pack({"a": a, "c": [a]})
    for copy in (False, True):
        back = unpack(packed.header, packed.to_bytes(), copy=copy)
        assert back["a"] is back["c"][0]


@pytest.mark.parametrize("copy", [False, True])
def test_overlapping_placeholders_past_the_buffer_are_refused(copy):
    mib = 1 << 20
    phs = [
        placeholder("numpy", "uint8", (mib - 64 * i,), 64 * i, mib - 64 * i) for i in range(1500)
    ]
    with pytest.raises(PayloadError, match="claim over 2097088 bytes of a 1048576-byte buffer"):
        unpack(msgpack.packb([1, mib, phs]), bytes(mib), copy=copy)
    # Within the buffer but past the header's nbytes: refused too (pack never writes it).
    two = [placeholder("numpy", "uint8", (8,), 0, 8), placeholder("numpy", "uint8", (4,), 4, 4)]
    with pytest.raises(PayloadError, match="claim 12 bytes, more than the header's 8"):
        unpack(msgpack.packb([1, 8, two]), bytes(16), copy=copy)


def raw_map_of_repeats(entries: int) -> bytes:
    # map32 whose every entry is 0: 0 (a dict of one entry, after all of them are read)
    return b"\xdf" + entries.to_bytes(4, "big") + b"\x00\x00" * entries


@pytest.mark.parametrize(
    ("tree_bytes", "message"),
    [
        # 32 MiB of empty tuples: ~10 s of an event loop before.
        (msgpack.packb([[ext_tuple([])] * 1000] * 11_000), "more than 65536 containers"),
        (msgpack.packb([ext_tuple([])] * (3 << 20)), "exceeds max_array_len"),
        (msgpack.packb([[0] * 100_000] * 300), f"more than {MAX_ITEMS} items"),
        (msgpack.packb([[[]] * 1000] * 30_000), "more than 65536 containers"),
        (msgpack.packb([[{}] * 1000] * 30_000), "more than 65536 containers"),
        (b"\xdc\x00\x03" + raw_map_of_repeats(MAX_ITEMS // 2) * 3, f"more than {MAX_ITEMS} items"),
        (
            msgpack.packb([placeholder("numpy", "uint8", (0, i), 0, 0) for i in range(20_000)]),
            f"more than {MAX_TENSORS} tensors",
        ),
    ],
    ids=["tuples", "one-long-array", "ints", "lists", "dicts", "repeated-keys", "tensors"],
)
def test_huge_headers_are_refused_before_the_work(tree_bytes, message):
    header = b"\x93\x01\x00" + tree_bytes  # [1, 0, tree]
    start = time.perf_counter()
    with pytest.raises(PayloadError, match=re.escape(message)):
        unpack(header, b"")
    # ~0.05 s here; the bound only catches a return to the old seconds on a busy host.
    assert time.perf_counter() - start < 2.0


def test_tuple_nesting_is_bounded_by_both_sides():
    # A tuple's ext data repeats its contents: 20 levels around 4 MiB were 80 MiB of copies.
    data = msgpack.packb(["x" * (4 << 20)])
    for _ in range(20):
        data = msgpack.packb([msgpack.ExtType(2, data)])
    with pytest.raises(PayloadError, match=f"tuple nesting deeper than {MAX_TUPLE_DEPTH}"):
        unpack(msgpack.packb([1, 0, msgpack.ExtType(2, data)]), None)
    deepest = nested_tuples(MAX_TUPLE_DEPTH)
    assert roundtrip(deepest) == deepest


@pytest.mark.parametrize(
    ("value", "n"),
    [
        # The envelope is one array of three items; the list is one more container.
        (lambda n: [0] * n, MAX_ITEMS - 3),
        (lambda n: [[]] * n, MAX_CONTAINERS - 2),
        (lambda n: [np.zeros(0)] * n, MAX_TENSORS),
    ],
    ids=["items", "containers", "tensors"],
)
def test_pack_refuses_exactly_what_unpack_refuses(value, n):
    ok = value(n)
    assert len(roundtrip(ok)) == n
    with pytest.raises(PayloadError) as packing:
        pack(value(n + 1))
    # The header pack would have written, made by msgpack: refused for the same reason.
    first = msgpack.unpackb(pack(ok).header, raw=False)[2][0]  # 0, [] or a placeholder
    with pytest.raises(PayloadError) as unpacking:
        unpack(msgpack.packb([1, 0, [first] * (n + 1)]), b"")
    assert packing.value.reason == unpacking.value.reason


@pytest.mark.parametrize(
    ("ext", "message"),
    [
        (
            msgpack.ExtType(1, msgpack.packb(["numpy", "uint8", [0], 0, 0, "x" * 600])),
            "tensor placeholder of 620 bytes",
        ),
        (
            msgpack.ExtType(1, msgpack.packb(["numpy", "uint8", [1] * 33, 0, 1])),
            "tensor of 33 dimensions, more than 32",
        ),
        (
            msgpack.ExtType(1, msgpack.packb(["numpy", "float32", [0, 2**62, 2**62], 0, 0])),
            "is too large",
        ),
        (msgpack.ExtType(3, msgpack.packb([1.0, 2.0, [0] * 100])), "complex ext of"),
    ],
)
def test_placeholders_and_exts_past_their_limits_are_refused(ext, message):
    with pytest.raises(PayloadError, match=re.escape(message)):
        unpack(msgpack.packb([1, 0, [ext]]), b"")


def test_unpack_raises_only_payload_error():
    for header, buffer in [
        (None, b""),
        ("text", b""),
        (b"\x93\x01\x00\xc0", 5),
        (memoryview(b"\x93"), b""),
    ]:
        with pytest.raises(PayloadError):
            unpack(header, buffer)  # type: ignore[arg-type]


def test_unpack_accepts_memoryview_of_other_formats():
    packed = pack(np.arange(4, dtype=np.int32))
    mv = memoryview(np.frombuffer(packed.to_bytes(), np.int32))
    assert unpack(packed.header, mv).tolist() == [0, 1, 2, 3]


# ----------------------------------------------------------------------------- inline wire


def test_encode_decode_inline():
    value = {"ids": [1, 2, 3], "x": torch.ones(2, 2)}
    pb = encode_inline(value)
    assert pb.WhichOneof("body") == "inline_data"
    wire = common_pb2.Payload.FromString(pb.SerializeToString())
    out = decode_inline(wire)
    assert out["ids"] == [1, 2, 3] and out["x"].tolist() == [[1.0, 1.0], [1.0, 1.0]]
    out["x"][0, 0] = 5  # copy=True by default: writable


def test_decode_inline_rejects_relay():
    pb = common_pb2.Payload(header=pack(1).header, relay=common_pb2.RelayDescriptor(backend="shm"))
    with pytest.raises(PayloadError, match="relay"):
        decode_inline(pb)


# ----------------------------------------------------------------------------- without torch


def run_python(code: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_import_does_not_import_torch():
    run_python(
        """
        import sys
        import numpy as np
        import omnirail.wire.payload as p
        out = p.unpack(*(lambda k: (k.header, k.to_bytes()))(p.pack({"a": np.arange(3)})))
        assert out["a"].tolist() == [0, 1, 2]
        p.decode_inline(p.encode_inline([1, (2,)]))
        assert "torch" not in sys.modules, "omnirail.wire.payload imported torch"
        """
    )


def test_torch_placeholders_decode_as_numpy_without_torch():
    packed = pack({"f": torch.arange(3, dtype=torch.float32), "b": torch.ones(2).bfloat16()})
    out = run_python(
        f"""
        import sys
        sys.modules["torch"] = None  # makes `import torch` fail
        import omnirail.wire.payload as p
        out = p.unpack({packed.header!r}, {packed.to_bytes()!r})
        print(out["f"].dtype, out["f"].tolist(), out["b"].dtype, out["b"].tolist())
        """
    )
    # bfloat16 1.0 is 0x3f80: its raw bits come back as uint16.
    assert out.split() == ["float32", "[0.0,", "1.0,", "2.0]", "uint16", "[16256,", "16256]"]


def test_zero_copy_torch_views_do_not_warn():
    import warnings

    packed = pack(torch.arange(4))
    data = packed.to_bytes()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            unpack(packed.header, data)
    assert not [w for w in caught if "not writable" in str(w.message)]


def test_numpy_only_decodes_torch_tensors_as_numpy() -> None:
    packed = pack({"t": torch.arange(6, dtype=torch.float32).reshape(2, 3), "n": np.ones(2)})
    out = unpack(packed.header, packed.to_bytes(), numpy_only=True)
    assert type(out["t"]) is np.ndarray and out["t"].shape == (2, 3)
    np.testing.assert_array_equal(out["t"], np.arange(6, dtype=np.float32).reshape(2, 3))
    assert type(unpack(packed.header, packed.to_bytes())["t"]) is torch.Tensor


def test_client_tensors_option_is_checked() -> None:
    from omnirail.client.sdk import Client

    with pytest.raises(ValueError, match="tensors must be 'auto' or 'numpy'"):
        Client("localhost:1", tensors="torch")


def test_write_into_a_byte_range_writes_only_that_range():
    a = np.arange(100, dtype=np.uint8)
    b = np.arange(50, dtype=np.int32)
    packed = pack({"a": a, "b": b}, align=64)
    whole = packed.to_bytes()
    # Ranges that start and end inside tensors, inside padding and on boundaries.
    for cut in (1, 64, 99, 100, 128, 200, packed.nbytes - 1):
        buf = bytearray(packed.nbytes)
        packed.write_into(buf, 0, cut)
        packed.write_into(buf, cut, None)
        assert bytes(buf) == whole, cut
    buf = bytearray(b"\xff" * packed.nbytes)
    packed.write_into(buf, 10, 20)
    assert buf[10:20] == whole[10:20] and buf[:10] == b"\xff" * 10 and buf[20:25] == b"\xff" * 5
    for start, stop in ((-1, 5), (5, 4), (0, packed.nbytes + 1)):
        with pytest.raises(ValueError, match="byte range"):
            packed.write_into(bytearray(packed.nbytes), start, stop)


# ---- tensors a sender had on a GPU ------------------------------------------------------


def _spec_header(spec: list) -> bytes:
    return msgpack.packb([1, 16, msgpack.ExtType(1, msgpack.packb(spec))])


def test_a_staged_device_tensor_lands_on_the_receivers_device() -> None:
    """A placeholder with a device type (what `pack` writes for a GPU tensor) decodes on
    the CPU for a receiver without a device, and onto the receiver's device otherwise
    ("meta" stands in for a GPU on a host without one)."""
    data = np.arange(4, dtype=np.float32).tobytes()
    header = _spec_header(["torch", "float32", [4], 0, 16, "cuda"])
    on_cpu = unpack(header, data)
    assert on_cpu.device.type == "cpu" and on_cpu.tolist() == [0.0, 1.0, 2.0, 3.0]
    moved = unpack(header, data, device="meta")
    assert moved.device.type == "meta" and moved.shape == (4,)
    # The lone-tensor fast path (second decode of the same header) moves it too.
    assert unpack(header, data, device="meta").device.type == "meta"
    # A CPU tensor stays on the CPU whatever the receiver's device.
    plain = pack(torch.arange(4, dtype=torch.float32))
    assert unpack(plain.header, plain.to_bytes(), device="meta").device.type == "cpu"
    assert len(msgpack.unpackb(msgpack.unpackb(plain.header)[2].data)) == 5


@pytest.mark.parametrize(
    "spec",
    [
        ["torch", "float32", [4], 0, 16, "tpu"],
        ["torch", "float32", [4], 0, 16, 1],
        ["numpy", "float32", [4], 0, 16, "cuda"],
        ["torch", "float32", [4], 0, 16, "cuda", "x"],
    ],
)
def test_bad_device_placeholders_are_refused(spec: list) -> None:
    with pytest.raises(PayloadError):
        unpack(_spec_header(spec), bytes(16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_are_staged_through_host_memory() -> None:
    value = {"x": torch.arange(6, dtype=torch.bfloat16, device="cuda").reshape(2, 3), "n": 1}
    packed = pack(value)
    back = unpack(packed.header, packed.to_bytes())
    assert back["x"].device.type == "cpu" and torch.equal(back["x"], value["x"].cpu())
    on_gpu = unpack(packed.header, packed.to_bytes(), device="cuda:0")
    assert on_gpu["x"].device == torch.device("cuda:0") and torch.equal(on_gpu["x"], value["x"])
    lone = pack(value["x"])
    assert torch.equal(unpack(lone.header, lone.to_bytes(), device="cuda:0"), value["x"])
