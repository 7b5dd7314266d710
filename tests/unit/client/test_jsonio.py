"""omnirail.client.jsonio: CLI inputs (JSON with tensors) and printable results."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from omnirail.client.jsonio import dumps, parse_inputs, to_jsonable

# ---- parse_inputs ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "kind"), [("[1, 2]", "list"), ("3", "int"), ('"x"', "str"), ("null", "NoneType")]
)
def test_non_object_names_input_flag(text: str, kind: str) -> None:
    with pytest.raises(
        ValueError, match=f"^--input: expected a JSON object of inputs, got {kind}$"
    ):
        parse_inputs(text)


def test_non_object_names_given_source() -> None:
    with pytest.raises(ValueError, match=r"^in\.json: expected a JSON object"):
        parse_inputs("[]", source="in.json")


@pytest.mark.parametrize("text", ["{", "", "{'a': 1}", '{"a": }'])
def test_invalid_json(text: str) -> None:
    with pytest.raises(ValueError, match=r"^--input: invalid JSON: "):
        parse_inputs(text)


def test_plain_values_pass_through() -> None:
    value = {"text": "hi", "n": 3, "f": 1.5, "ok": True, "none": None, "xs": [1, {"a": "b"}]}
    assert parse_inputs(json.dumps(value)) == value


def test_tensor_becomes_numpy_array() -> None:
    out = parse_inputs('{"x": {"__tensor__": [[1, 2]], "dtype": "int64"}, "y": 2}')
    x = out["x"]
    assert isinstance(x, np.ndarray)
    assert x.dtype == np.int64
    assert x.shape == (1, 2)
    assert x.tolist() == [[1, 2]]
    assert out["y"] == 2


def test_tensor_default_dtype_is_float32() -> None:
    x = parse_inputs('{"x": {"__tensor__": [1, 2, 3]}}')["x"]
    assert x.dtype == np.float32
    assert x.tolist() == [1.0, 2.0, 3.0]


def test_nested_tensors() -> None:
    out = parse_inputs(
        '{"batch": [{"__tensor__": [1], "dtype": "uint8"}, {"m": {"__tensor__": 5}}]}'
    )
    first, second = out["batch"]
    assert isinstance(first, np.ndarray) and first.dtype == np.uint8
    assert isinstance(second["m"], np.ndarray) and second["m"].shape == ()


def test_tensor_with_unexpected_key_names_path_and_key() -> None:
    with pytest.raises(ValueError, match=r"^--input\.x: unexpected keys \['shape'\] in a tensor$"):
        parse_inputs('{"x": {"__tensor__": [1, 2], "shape": [2]}}')


def test_nested_bad_tensor_path() -> None:
    with pytest.raises(ValueError, match=r"^--input\.a\[1\]\.t: unexpected keys"):
        parse_inputs('{"a": [0, {"t": {"__tensor__": [1], "dtpye": "int8"}}]}')


@pytest.mark.parametrize(
    "tensor",
    [
        '{"__tensor__": [1, 2], "dtype": "no-such-dtype"}',
        '{"__tensor__": [[1], [1, 2]], "dtype": "int64"}',
        '{"__tensor__": ["a"], "dtype": "int64"}',
    ],
    ids=["bad-dtype", "ragged", "not-numbers"],
)
def test_bad_tensor(tensor: str) -> None:
    with pytest.raises(ValueError, match=r"^--input\.x: bad tensor: "):
        parse_inputs(f'{{"x": {tensor}}}')


# ---- to_jsonable ----------------------------------------------------------------


def test_small_numpy_array_has_values() -> None:
    out = to_jsonable(np.arange(6, dtype=np.int32).reshape(2, 3))
    assert out == {"dtype": "int32", "shape": [2, 3], "data": [[0, 1, 2], [3, 4, 5]]}


def test_big_numpy_array_is_summarised_with_mean() -> None:
    out = to_jsonable(np.arange(1000, dtype=np.float32))
    assert out == {"dtype": "float32", "shape": [1000], "mean": pytest.approx(499.5)}
    assert "data" not in out


def test_big_non_numeric_array_has_no_mean() -> None:
    out = to_jsonable(np.array(["ab"] * 100))
    assert out["shape"] == [100]
    assert "data" not in out and "mean" not in out


def test_torch_tensor() -> None:
    out = to_jsonable(torch.tensor([[1.0, 2.5]], dtype=torch.float32))
    assert out == {"dtype": "float32", "shape": [1, 2], "data": [[1.0, 2.5]]}


def test_torch_bfloat16_small_and_big() -> None:
    small = to_jsonable(torch.tensor([1.0, -2.0, 0.5], dtype=torch.bfloat16))
    assert small == {"dtype": "bfloat16", "shape": [3], "data": [1.0, -2.0, 0.5]}
    big = to_jsonable(torch.full((4, 50), 1.5, dtype=torch.bfloat16))
    assert big == {"dtype": "bfloat16", "shape": [4, 50], "mean": pytest.approx(1.5)}


def test_big_torch_tensor_mean() -> None:
    out = to_jsonable(torch.arange(200, dtype=torch.int64))
    assert out == {"dtype": "int64", "shape": [200], "mean": pytest.approx(99.5)}


def test_bytes_summarised_by_length() -> None:
    assert to_jsonable(b"\x00" * 10) == {"bytes": 10}


def test_numpy_scalars_become_python_values() -> None:
    out = to_jsonable({"f": np.float32(1.5), "i": np.int64(7), "b": np.bool_(True)})
    assert out == {"f": 1.5, "i": 7, "b": True}
    assert type(out["f"]) is float and type(out["i"]) is int and type(out["b"]) is bool


def test_nested_structures() -> None:
    value = {
        "stage": {
            "emb": torch.zeros(2),
            "items": (np.ones(1, dtype=np.uint8), b"ab", "s", 3, None),
            1: [{"x": 2.0}],
        }
    }
    out = to_jsonable(value)
    assert out == {
        "stage": {
            "emb": {"dtype": "float32", "shape": [2], "data": [0.0, 0.0]},
            "items": [{"dtype": "uint8", "shape": [1], "data": [1]}, {"bytes": 2}, "s", 3, None],
            "1": [{"x": 2.0}],
        }
    }
    json.dumps(out)  # plain JSON all the way down


def test_dumps_is_valid_json() -> None:
    text = dumps({"fuse": {"embedding": torch.ones(128), "similarity": 0.5}})
    parsed = json.loads(text)
    assert parsed["fuse"]["embedding"] == {
        "dtype": "float32",
        "shape": [128],
        "mean": pytest.approx(1.0),
    }
    assert parsed["fuse"]["similarity"] == 0.5
