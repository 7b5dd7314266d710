"""Named KServe v2 tensors <-> a pipeline's input and output values, as `api:` declares them.

Inputs: every tensor is checked against its declaration (name, datatype, shape, element
count, contents) and becomes a request field: a `[1]` tensor a plain value (str, int,
float, bool, or parsed JSON), any other shape a numpy array (BYTES: nested lists of str).
Outputs: a stage's result or chunk field becomes a tensor of the declared datatype, sent as
raw contents (what Triton sends, and the only form FP16 has). Errors are OmniErrors: the
caller's mistakes INVALID_ARGUMENT, a pipeline that breaks its own declaration INTERNAL.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from omnirail.config.api import DATATYPES, ApiConfig, InputSpec, OutputSpec
from omnirail.kserve import grpc_predict_v2_pb2 as pb
from omnirail.wire.errors import Code, OmniError, internal, invalid

_MAX_NAME_ECHO = 40
# Typed-contents field of each datatype (FP16 has none: raw contents only).
_CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
_LEN = struct.Struct("<I")


def _name(value: str) -> str:
    return repr(value[:_MAX_NAME_ECHO] + ("..." if len(value) > _MAX_NAME_ECHO else ""))


def request_inputs(api: ApiConfig, request: pb.ModelInferRequest, max_bytes: int) -> dict[str, Any]:
    """The pipeline inputs a ModelInferRequest carries; raises OmniError (INVALID_ARGUMENT)."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise invalid(
            f"raw_input_contents: {len(raw)} entries for {len(request.inputs)} inputs; "
            "send one per input, in order, or none"
        )
    if raw and any(t.HasField("contents") for t in request.inputs):
        raise invalid("inputs: use raw_input_contents or typed contents, not both")
    declared = [i.name for i in api.inputs]
    out: dict[str, Any] = {}
    total = 0
    for i, tensor in enumerate(request.inputs):
        spec = api.input(tensor.name)
        if spec is None:
            raise invalid(f"input {_name(tensor.name)}: unknown; the model takes {declared}")
        if spec.name in out:
            raise invalid(f"input {spec.name!r}: given twice")
        value, size = _input_value(spec, tensor, raw[i] if raw else None, max_bytes - total)
        total += size
        out[spec.name] = value
    missing = [i.name for i in api.inputs if not i.optional and i.name not in out]
    if missing:
        raise invalid(f"inputs {missing}: required by the model, missing from the request")
    return out


def _input_value(spec: InputSpec, tensor: Any, raw: bytes | None, budget: int) -> tuple[Any, int]:
    at = f"input {spec.name!r}"
    if tensor.datatype != spec.datatype:
        raise invalid(f"{at}: datatype {_name(tensor.datatype)}, expected {spec.datatype}")
    shape = list(tensor.shape)
    if len(shape) != len(spec.shape) or any(
        want not in (-1, got) for want, got in zip(spec.shape, shape, strict=False)
    ):
        raise invalid(f"{at}: shape {shape[:10]}, expected {spec.shape} (-1: any size)")
    if any(d < 0 for d in shape):
        raise invalid(f"{at}: shape {shape[:10]} has a negative dimension")
    count = math.prod(shape)
    if spec.datatype == "BYTES":  # what the elements really hold, before any is decoded
        size = len(raw) if raw is not None else sum(map(len, tensor.contents.bytes_contents))
    else:
        size = count * np.dtype(DATATYPES[spec.datatype]).itemsize
    if size > budget:
        raise OmniError(
            Code.RESOURCE_EXHAUSTED,
            f"{at}: {size} bytes exceed what the pipeline takes (max_input_mb)",
        )
    if raw is not None:
        array = _from_raw(spec, at, raw, count)
    else:
        array = _from_contents(spec, at, tensor.contents, count)
    array = array.reshape(shape)
    if spec.datatype == "BYTES":
        return _bytes_value(spec, at, array), size
    if spec.scalar:
        return array.reshape(()).item(), size
    return array, size


def _from_raw(spec: InputSpec, at: str, raw: bytes, count: int) -> np.ndarray:
    if spec.datatype == "BYTES":
        return np.array(_split_bytes(at, raw, count), dtype=object)
    dtype = np.dtype(DATATYPES[spec.datatype]).newbyteorder("<")
    if len(raw) != count * dtype.itemsize:
        raise invalid(
            f"{at}: raw contents hold {len(raw)} bytes; shape and datatype need "
            f"{count * dtype.itemsize}"
        )
    return np.frombuffer(raw, dtype=dtype).astype(dtype.newbyteorder("="), copy=True)


def _split_bytes(at: str, raw: bytes, count: int) -> list[bytes]:
    """BYTES raw contents: each element a little-endian uint32 length and its bytes."""
    out: list[bytes] = []
    pos = 0
    while pos < len(raw):
        if pos + 4 > len(raw):
            raise invalid(f"{at}: raw BYTES contents end inside an element's length prefix")
        (n,) = _LEN.unpack_from(raw, pos)
        pos += 4
        if pos + n > len(raw):
            raise invalid(f"{at}: raw BYTES element {len(out)} claims {n} bytes; fewer follow")
        out.append(raw[pos : pos + n])
        pos += n
        if len(out) > count:
            break
    if len(out) != count:
        raise invalid(f"{at}: {len(out)} BYTES elements in raw contents; the shape needs {count}")
    return out


def _from_contents(spec: InputSpec, at: str, contents: Any, count: int) -> np.ndarray:
    field = _CONTENTS.get(spec.datatype)
    if field is None:
        raise invalid(f"{at}: {spec.datatype} travels as raw_input_contents only")
    others = [f.name for f, _ in contents.ListFields() if f.name != field]
    if others:
        raise invalid(
            f"{at}: contents.{others[0]} does not hold {spec.datatype} data (contents.{field} does)"
        )
    values = getattr(contents, field)
    if len(values) != count:
        raise invalid(f"{at}: {len(values)} elements in contents.{field}; the shape needs {count}")
    if spec.datatype == "BYTES":
        return np.array(list(values), dtype=object)
    dtype = np.dtype(DATATYPES[spec.datatype])
    array = np.asarray(values)
    if dtype.kind in "iu" and array.size:
        info = np.iinfo(dtype)
        if int(array.min()) < info.min or int(array.max()) > info.max:
            raise invalid(f"{at}: a value outside {spec.datatype}'s range")
    return array.astype(dtype) if array.size else np.zeros(0, dtype)


def _bytes_value(spec: InputSpec, at: str, array: np.ndarray) -> Any:
    def one(b: bytes) -> Any:
        if spec.format == "bytes":
            return bytes(b)
        try:
            text = bytes(b).decode("utf-8")
        except UnicodeDecodeError:
            raise invalid(f"{at}: not UTF-8 text") from None
        if spec.format == "text":
            return text
        try:
            return json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise invalid(f"{at}: not a JSON document ({str(exc)[:80]})") from None

    if spec.scalar:
        return one(array.reshape(())[()])
    return np.vectorize(one, otypes=[object])(array).tolist() if array.size else []


# ---- outputs ------------------------------------------------------------------------


def to_array(spec: OutputSpec, value: Any) -> np.ndarray:
    """A value as the output's tensor (scalars as shape [1]); raises INTERNAL."""
    at = f"output {spec.name!r} (stage {spec.stage!r})"
    if spec.datatype == "BYTES":
        items = value if isinstance(value, list | tuple) else [value]
        array = np.array([_as_bytes(spec, item) for item in items], dtype=object)
    else:
        try:
            array = np.asarray(value, dtype=DATATYPES[spec.datatype])
        except (TypeError, ValueError, OverflowError) as exc:
            raise internal(f"{at}: {type(value).__name__} is not {spec.datatype}: {exc}") from None
        if array.ndim == 0:
            array = array.reshape(1)
    if len(spec.shape) != array.ndim or any(
        want not in (-1, got) for want, got in zip(spec.shape, array.shape, strict=False)
    ):
        raise internal(f"{at}: shape {list(array.shape)}, declared {spec.shape}")
    return array


def _as_bytes(spec: OutputSpec, item: Any) -> bytes:
    if isinstance(item, bytes):
        return item
    if isinstance(item, str) and spec.format != "json":
        return item.encode("utf-8")
    try:
        return json.dumps(_plain(item)).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise internal(f"output {spec.name!r}: not JSON-serializable: {exc}") from None


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def concat(spec: OutputSpec, parts: Sequence[Any]) -> np.ndarray:
    """The chunks' fields of one output joined (strings joined, arrays along axis 0)."""
    if spec.datatype == "BYTES" and spec.scalar:
        texts = [p if isinstance(p, str | bytes) else json.dumps(_plain(p)) for p in parts]
        joined: Any = b"".join(t if isinstance(t, bytes) else t.encode() for t in texts)
        return to_array(spec, joined)
    arrays = [to_array(spec, p) for p in parts]
    if not arrays:
        shape = [0 if d == -1 else d for d in spec.shape]
        return np.zeros(shape, dtype=DATATYPES[spec.datatype])
    return np.concatenate(arrays, axis=0)


def raw_bytes(datatype: str, array: np.ndarray) -> bytes:
    if datatype == "BYTES":
        return b"".join(_LEN.pack(len(b)) + b for b in array.reshape(-1))
    return np.ascontiguousarray(
        array, dtype=np.dtype(DATATYPES[datatype]).newbyteorder("<")
    ).tobytes()


def add_output(response: pb.ModelInferResponse, spec: OutputSpec, array: np.ndarray) -> None:
    response.outputs.add(name=spec.name, datatype=spec.datatype, shape=list(array.shape))
    response.raw_output_contents.append(raw_bytes(spec.datatype, array))


def requested_outputs(api: ApiConfig, request: pb.ModelInferRequest) -> list[OutputSpec]:
    """The outputs a request asks for (all declared ones when it names none)."""
    if not request.outputs:
        return list(api.outputs)
    declared = [o.name for o in api.outputs]
    out: list[OutputSpec] = []
    for wanted in request.outputs:
        spec = api.output(wanted.name)
        if spec is None:
            raise invalid(f"output {_name(wanted.name)}: unknown; the model makes {declared}")
        if spec not in out:
            out.append(spec)
    return out


def tensor_metadata(spec: InputSpec | OutputSpec) -> pb.ModelMetadataResponse.TensorMetadata:
    return pb.ModelMetadataResponse.TensorMetadata(
        name=spec.name, datatype=spec.datatype, shape=spec.shape
    )
