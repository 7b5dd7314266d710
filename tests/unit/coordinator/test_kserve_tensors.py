"""KServe v2 tensors <-> pipeline values, as an `api:` section declares them."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import pytest

from omnirail.config.api import ApiConfig, OutputSpec
from omnirail.coordinator.kserve_tensors import (
    add_output,
    concat,
    raw_bytes,
    request_inputs,
    requested_outputs,
    tensor_metadata,
    to_array,
)
from omnirail.kserve import grpc_predict_v2_pb2 as pb
from omnirail.wire.errors import Code, OmniError

MAX = 1 << 20


def _o(name: str, datatype: str, shape: list[int], stage: str, **kw: Any) -> dict[str, Any]:
    return {"name": name, "datatype": datatype, "shape": shape, "stage": stage, **kw}


def _opt(name: str, datatype: str, shape: list[int], **kw: Any) -> dict[str, Any]:
    return {"name": name, "datatype": datatype, "shape": shape, "optional": True, **kw}


API = ApiConfig.model_validate(
    {
        "inputs": [
            {"name": "text", "datatype": "BYTES", "shape": [1]},
            _opt("n", "INT64", [1]), _opt("t", "FP32", [1]), _opt("flag", "BOOL", [1]),
            _opt("half", "FP16", [-1]), _opt("image", "UINT8", [-1, -1, 3]),
            _opt("meta", "BYTES", [1], format="json"), _opt("blob", "BYTES", [1], format="bytes"),
            _opt("words", "BYTES", [-1]), _opt("ids", "INT64", [2, -1]),
            _opt("small", "INT8", [-1]), _opt("u8", "UINT8", [-1]), _opt("audio", "FP32", [-1]),
        ],
        "outputs": [
            _o("text", "BYTES", [1], "d", result="."),
            _o("pcm", "FP32", [-1], "w", chunks="."),
            _o("meta", "BYTES", [1], "d", result="m", format="json"),
            _o("img", "UINT8", [-1, -1, 3], "d", result="i"),
            _o("half", "FP16", [-1], "w", result="h"),
            _o("flag", "BOOL", [1], "d", result="f"),
            _o("words", "BYTES", [-1], "d", result="w"),
        ],
    }
)  # fmt: skip


def _spec(name: str) -> OutputSpec:
    spec = API.output(name)
    assert spec is not None
    return spec


def _t(name: str, datatype: str, shape: list[int], **contents: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"name": name, "datatype": datatype, "shape": shape}
    if contents:
        out["contents"] = pb.InferTensorContents(**contents)
    return out


def _req(*tensors: dict[str, Any], raw: list[bytes] | None = None) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="m")
    for tensor in tensors:
        request.inputs.add(**tensor)
    request.raw_input_contents.extend(raw or [])
    return request


def _text(value: str = "hi") -> dict[str, Any]:
    return _t("text", "BYTES", [1], bytes_contents=[value.encode()])


def _lp(*items: bytes) -> bytes:
    """BYTES raw contents: each element a little-endian uint32 length and its bytes."""
    return b"".join(struct.pack("<I", len(b)) + b for b in items)


def _inputs(*tensors: dict[str, Any], raw: list[bytes] | None = None) -> dict[str, Any]:
    return request_inputs(API, _req(*tensors, raw=raw), MAX)


def _refused(*tensors: dict[str, Any], raw: list[bytes] | None = None, code: int = 0) -> str:
    with pytest.raises(OmniError) as ei:
        request_inputs(API, _req(*tensors, raw=raw), MAX)
    assert ei.value.code == (code or Code.INVALID_ARGUMENT)
    return ei.value.message


# -- inputs: typed contents ----------------------------------------------------------------------


def test_typed_scalars_become_plain_values() -> None:
    got = _inputs(
        _text("héllo"),
        _t("n", "INT64", [1], int64_contents=[7]),
        _t("t", "FP32", [1], fp32_contents=[0.5]),
        _t("flag", "BOOL", [1], bool_contents=[True]),
        _t("meta", "BYTES", [1], bytes_contents=[b'{"a": [1, 2]}']),
        _t("blob", "BYTES", [1], bytes_contents=[b"\xff\x00"]),
    )
    assert got == {"text": "héllo", "n": 7, "t": 0.5, "flag": True, "meta": {"a": [1, 2]},
                   "blob": b"\xff\x00"}  # fmt: skip
    assert [type(got[k]) for k in ("text", "n", "t", "flag")] == [str, int, float, bool]


def test_typed_arrays_keep_dtype_and_shape() -> None:
    got = _inputs(
        _text(),
        _t("ids", "INT64", [2, 3], int64_contents=[1, 2, 3, 4, 5, 6]),
        _t("small", "INT8", [2], int_contents=[-128, 127]),
        _t("image", "UINT8", [1, 2, 3], uint_contents=[0, 1, 2, 253, 254, 255]),
    )
    assert got["ids"].dtype == np.int64 and got["ids"].tolist() == [[1, 2, 3], [4, 5, 6]]
    assert got["small"].dtype == np.int8 and got["small"].tolist() == [-128, 127]
    assert got["image"].dtype == np.uint8 and got["image"].shape == (1, 2, 3)


def test_typed_bytes_array_is_a_list_of_str_and_empty_arrays_work() -> None:
    got = _inputs(
        _text(), _t("words", "BYTES", [2], bytes_contents=[b"a", b"b"]), _t("audio", "FP32", [0])
    )
    assert got["words"] == ["a", "b"]
    assert got["audio"].dtype == np.float32 and got["audio"].shape == (0,)


# -- inputs: raw contents ------------------------------------------------------------------------


def test_raw_contents_of_every_kind() -> None:
    image = np.arange(12, dtype=np.uint8).reshape(2, 2, 3)
    pairs = [
        (_t("text", "BYTES", [1]), _lp("héllo".encode())),
        (_t("n", "INT64", [1]), struct.pack("<q", -5)),
        (_t("t", "FP32", [1]), struct.pack("<f", 1.5)), (_t("flag", "BOOL", [1]), b"\x01"),
        (_t("half", "FP16", [2]), np.array([0.5, -1.0], dtype="<f2").tobytes()),
        (_t("image", "UINT8", [2, 2, 3]), image.tobytes()),
        (_t("words", "BYTES", [3]), _lp(b"a", b"", b"c")),
        (_t("meta", "BYTES", [1]), _lp(b"[1, 2]")), (_t("blob", "BYTES", [1]), _lp(b"\x00\xff")),
    ]  # fmt: skip
    got = _inputs(*(t for t, _ in pairs), raw=[r for _, r in pairs])
    assert (got["text"], got["n"], got["t"], got["flag"]) == ("héllo", -5, 1.5, True)
    assert got["half"].dtype == np.float16 and got["half"].tolist() == [0.5, -1.0]
    assert got["image"].dtype == np.uint8 and np.array_equal(got["image"], image)
    assert got["words"] == ["a", "", "c"]
    assert got["meta"] == [1, 2] and got["blob"] == b"\x00\xff"


# -- inputs: names, shapes, limits ---------------------------------------------------------------


_TEXT = _t("text", "BYTES", [1])
_X = _lp(b"x")
# (id, tensors, raw contents or None, what the message says)
REFUSALS = [
    ("fp16_typed", [_text(), _t("half", "FP16", [1], fp32_contents=[1.0])], None,
     "input 'half': FP16 travels as raw_input_contents only"),
    ("int8_over", [_text(), _t("small", "INT8", [1], int_contents=[128])], None,
     "input 'small': a value outside INT8's range"),
    ("int8_under", [_text(), _t("small", "INT8", [1], int_contents=[-129])], None,
     "input 'small': a value outside INT8's range"),
    ("uint8_over", [_text(), _t("u8", "UINT8", [1], uint_contents=[256])], None,
     "input 'u8': a value outside UINT8's range"),
    ("second_field", [_text(), _t("n", "INT64", [1], int64_contents=[1], fp32_contents=[1.0])],
     None, "input 'n': contents.fp32_contents does not hold INT64 data"),
    ("wrong_field", [_text(), _t("n", "INT64", [1], int_contents=[1])], None,
     "input 'n': contents.int_contents does not hold INT64 data (contents.int64_contents does)"),
    ("typed_count", [_text(), _t("audio", "FP32", [3], fp32_contents=[1.0, 2.0])], None,
     "input 'audio': 2 elements in contents.fp32_contents; the shape needs 3"),
    ("raw_and_typed", [_text(), _t("n", "INT64", [1])], [_X, struct.pack("<q", 1)],
     "inputs: use raw_input_contents or typed contents, not both"),
    ("raw_count", [_TEXT], [_X, _X], "raw_input_contents: 2 entries for 1 inputs"),
    ("raw_size", [_TEXT, _t("audio", "FP32", [2])], [_X, b"1234"],
     "input 'audio': raw contents hold 4 bytes; shape and datatype need 8"),
    ("bytes_in_prefix", [_TEXT], [b"\x05\x00"],
     "input 'text': raw BYTES contents end inside an element's length prefix"),
    ("bytes_truncated", [_TEXT], [struct.pack("<I", 9) + b"abc"],
     "input 'text': raw BYTES element 0 claims 9 bytes; fewer follow"),
    ("bytes_too_many", [_TEXT], [_lp(b"a", b"b")],
     "input 'text': 2 BYTES elements in raw contents; the shape needs 1"),
    ("bytes_none", [_TEXT], [b""],
     "input 'text': 0 BYTES elements in raw contents; the shape needs 1"),
    ("not_utf8", [_TEXT], [_lp(b"\xff")], "input 'text': not UTF-8 text"),
    ("bad_json", [_text(), _t("meta", "BYTES", [1], bytes_contents=[b"{nope"])], None,
     "input 'meta': not a JSON document"),
    ("unknown", [_text(), _t("ghost", "INT64", [1], int64_contents=[1])], None,
     "input 'ghost': unknown; the model takes ['text', 'n',"),
    ("duplicate", [_text(), _text()], None, "input 'text': given twice"),
    ("missing_required", [_t("n", "INT64", [1], int64_contents=[1])], None,
     "inputs ['text']: required by the model, missing from the request"),
    ("wrong_datatype", [_t("text", "STRING", [1], bytes_contents=[b"x"])], None,
     "input 'text': datatype 'STRING', expected BYTES"),
    ("wrong_rank", [_t("text", "BYTES", [1, 1], bytes_contents=[b"x"])], None,
     "input 'text': shape [1, 1], expected [1] (-1: any size)"),
    ("no_dims", [_t("text", "BYTES", [])], None, "input 'text': shape [], expected [1]"),
    ("wrong_dim", [_t("text", "BYTES", [2], bytes_contents=[b"x", b"y"])], None,
     "input 'text': shape [2], expected [1]"),
    ("fixed_dim", [_text(), _t("ids", "INT64", [3, 1], int64_contents=[1, 2, 3])], None,
     "input 'ids': shape [3, 1], expected [2, -1]"),
    ("negative_dim", [_text(), _t("audio", "FP32", [-3])], None,
     "input 'audio': shape [-3] has a negative dimension"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("tensors", "raw", "problem"), [pytest.param(*r[1:], id=r[0]) for r in REFUSALS]
)
def test_input_refused_as_invalid_argument(
    tensors: list[dict[str, Any]], raw: list[bytes] | None, problem: str
) -> None:
    assert problem in _refused(*tensors, raw=raw)


def test_unknown_input_name_is_clipped() -> None:
    message = _refused(_t("x" * 500, "INT64", [1]))
    assert "x" * 41 not in message and "..." in message


def test_optional_inputs_may_be_absent() -> None:
    assert _inputs(_text()) == {"text": "hi"}


def test_over_max_bytes_is_resource_exhausted() -> None:
    request = _req(_text(), _t("audio", "FP32", [1000]))
    with pytest.raises(OmniError) as ei:
        request_inputs(API, request, 3000)
    assert ei.value.code == Code.RESOURCE_EXHAUSTED
    assert "input 'audio': 4000 bytes exceed what the pipeline takes" in ei.value.message
    # A huge declared shape is refused before anything is decoded.
    message = _refused(_text(), _t("audio", "FP32", [1 << 40]), code=Code.RESOURCE_EXHAUSTED)
    assert "bytes exceed" in message


def test_budget_spans_all_inputs() -> None:
    audio = np.zeros(100, dtype="<f4").tobytes()
    request = _req(_t("text", "BYTES", [1]), _t("audio", "FP32", [100]), raw=[_lp(b"x"), audio])
    request_inputs(API, request, 405)
    with pytest.raises(OmniError) as ei:
        request_inputs(API, request, 404)
    assert ei.value.code == Code.RESOURCE_EXHAUSTED


def test_large_bytes_input_is_resource_exhausted() -> None:
    """BYTES elements count at their length against max_bytes, before any is decoded."""
    request = _req(_t("text", "BYTES", [1]), raw=[_lp(b"x" * 10_000)])
    with pytest.raises(OmniError) as ei:
        request_inputs(API, request, 1000)
    assert ei.value.code == Code.RESOURCE_EXHAUSTED


# -- outputs -------------------------------------------------------------------------------------


def test_requested_outputs_all_or_named_without_repeats() -> None:
    assert requested_outputs(API, pb.ModelInferRequest()) == API.outputs
    request = pb.ModelInferRequest()
    for name in ("pcm", "text", "pcm"):
        request.outputs.add(name=name)
    assert [o.name for o in requested_outputs(API, request)] == ["pcm", "text"]


def test_requested_unknown_output() -> None:
    request = pb.ModelInferRequest()
    request.outputs.add(name="ghost")
    with pytest.raises(OmniError) as ei:
        requested_outputs(API, request)
    assert ei.value.code == Code.INVALID_ARGUMENT
    assert "output 'ghost': unknown; the model makes ['text', 'pcm'," in ei.value.message


def test_to_array_scalar_gets_shape_one_and_the_declared_dtype() -> None:
    array = to_array(_spec("flag"), True)
    assert array.shape == (1,) and array.dtype == np.bool_
    array = to_array(_spec("pcm"), [0.5, 1])
    assert array.dtype == np.float32 and array.tolist() == [0.5, 1.0]


def test_to_array_bytes_from_str_bytes_and_json() -> None:
    assert to_array(_spec("text"), "hé").tolist() == ["hé".encode()]
    assert to_array(_spec("text"), b"\x00").tolist() == [b"\x00"]
    assert to_array(_spec("meta"), {"a": np.arange(2)}).tolist() == [b'{"a": [0, 1]}']
    assert to_array(_spec("meta"), "s").tolist() == [b'"s"']
    assert to_array(_spec("words"), ["a", "b"]).tolist() == [b"a", b"b"]


@pytest.mark.parametrize(
    ("name", "value", "problem"),
    [("img", np.zeros((2, 2, 4)), "output 'img' (stage 'd'): shape [2, 2, 4], declared [-1, -1"),
     ("pcm", "loud", "output 'pcm' (stage 'w'): str is not FP32"),
     ("meta", {"x": object()}, "output 'meta': not JSON-serializable")],
)  # fmt: skip
def test_to_array_broken_declaration_is_internal(name: str, value: Any, problem: str) -> None:
    with pytest.raises(OmniError) as ei:
        to_array(_spec(name), value)
    assert ei.value.code == Code.INTERNAL and problem in ei.value.message


def test_to_array_out_of_range_int_is_internal() -> None:
    """numpy 2 raises OverflowError for an out-of-range int: INTERNAL, not a bare error."""
    with pytest.raises(OmniError) as ei:
        to_array(_spec("img"), [[[0, 1, 300]]])
    assert ei.value.code == Code.INTERNAL


def test_concat_bytes_scalar_joins_text() -> None:
    assert concat(_spec("text"), ["a", b"b", "c"]).tolist() == [b"abc"]
    assert concat(_spec("text"), ["n=", 1]).tolist() == [b"n=1"]


def test_concat_arrays_along_axis_zero() -> None:
    array = concat(_spec("pcm"), [np.ones(2), [0.5], 0.25])
    assert array.dtype == np.float32 and array.tolist() == [1.0, 1.0, 0.5, 0.25]


def test_concat_nothing_is_zero_length() -> None:
    assert concat(_spec("pcm"), []).shape == (0,)
    empty_image = concat(_spec("img"), [])
    assert empty_image.shape == (0, 0, 3) and empty_image.dtype == np.uint8
    assert concat(_spec("text"), []).tolist() == [b""]


def _round_trip(name: str, value: Any) -> tuple[pb.ModelInferResponse, bytes]:
    response = pb.ModelInferResponse()
    add_output(response, _spec(name), to_array(_spec(name), value))
    assert len(response.outputs) == len(response.raw_output_contents) == 1
    return response, response.raw_output_contents[0]


def test_add_output_numeric_round_trip() -> None:
    image = np.arange(18, dtype=np.uint8).reshape(2, 3, 3)
    response, raw = _round_trip("img", image)
    out = response.outputs[0]
    assert (out.name, out.datatype, list(out.shape)) == ("img", "UINT8", [2, 3, 3])
    assert np.array_equal(np.frombuffer(raw, dtype=np.uint8).reshape(2, 3, 3), image)


def test_add_output_fp16_and_fp32_are_little_endian() -> None:
    _, raw = _round_trip("half", np.array([1.5, -2.0]))
    assert np.frombuffer(raw, dtype="<f2").tolist() == [1.5, -2.0]
    _, raw = _round_trip("pcm", np.array([0.25], dtype=">f4"))
    assert np.frombuffer(raw, dtype="<f4").tolist() == [0.25]


def test_add_output_bytes_are_length_prefixed() -> None:
    response, raw = _round_trip("words", ["ab", "", "c"])
    assert list(response.outputs[0].shape) == [3]
    assert raw == _lp(b"ab", b"", b"c")
    assert raw_bytes("BOOL", np.array([True, False])) == b"\x01\x00"


def test_tensor_metadata() -> None:
    meta = tensor_metadata(_spec("img"))
    assert (meta.name, meta.datatype, list(meta.shape)) == ("img", "UINT8", [-1, -1, 3])
    spec = API.input("text")
    assert spec is not None and tensor_metadata(spec).datatype == "BYTES"
