"""Fuzzing the KServe v2 front door of a real mesh (the quickstart over TCP).

Each example is a ModelInferRequest on the plain gRPC stub: model names and versions,
tensors with random names, datatypes, shapes, typed or raw contents (valid, truncated,
mislabelled), requested outputs and parameters, mostly near what the quickstart takes so
many reach the stages; sometimes bytes that are not a request at all. What may come back:
an answer, or INVALID_ARGUMENT / NOT_FOUND / RESOURCE_EXHAUSTED / DEADLINE_EXCEEDED
naming the problem; never INTERNAL or UNKNOWN, never a hang. Afterwards nothing is in
flight and the mesh serves on.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from omnirail.client.sdk import Client
from omnirail.kserve import grpc_predict_v2_pb2 as pb
from omnirail.kserve import grpc_predict_v2_pb2_grpc as pb_grpc
from omnirail.ops.launcher import Mesh
from tests.integration.conftest import REPO, wait_nothing_in_flight

pytestmark = pytest.mark.timeout(1200)

ALLOWED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}
DATATYPES = ["BYTES", "INT64", "INT32", "FP32", "FP16", "FP64", "BOOL", "UINT8", "int64", ""]
CONTENT_FIELDS = [
    "bool_contents", "int_contents", "int64_contents", "uint_contents", "uint64_contents",
    "fp32_contents", "fp64_contents", "bytes_contents",
]  # fmt: skip


@pytest.fixture(scope="module")
def mesh() -> Iterator[Mesh]:
    with Mesh(REPO / "examples" / "quickstart" / "pipeline.yaml", transport="tcp") as running:
        yield running


@pytest.fixture(scope="module")
def channel(mesh: Mesh) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(mesh.address or "") as chan:
        yield chan


def _length_prefixed(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(b)) + b for b in items)


@st.composite
def tensors(draw: st.DrawFn) -> tuple[pb.ModelInferRequest.InferInputTensor, bytes | None]:
    name = draw(st.sampled_from(["text", "image_size", "text", "extra", ""]) | st.text(max_size=8))
    if name == "text":
        datatype = draw(st.sampled_from(["BYTES", "BYTES", "BYTES", *DATATYPES]))
    elif name == "image_size":
        datatype = draw(st.sampled_from(["INT64", "INT64", *DATATYPES]))
    else:
        datatype = draw(st.sampled_from(DATATYPES))
    shape = draw(
        st.one_of(
            st.just([1]),
            st.lists(st.integers(-3, 4), max_size=3),
            st.lists(st.integers(0, 2**40), min_size=1, max_size=2),
        )
    )
    tensor = pb.ModelInferRequest.InferInputTensor(name=name, datatype=datatype, shape=shape)
    kind = draw(st.sampled_from(["good", "typed", "raw", "none"]))
    raw: bytes | None = None
    if kind == "good" and datatype == "BYTES":
        texts = draw(st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=2))
        raw = _length_prefixed([t.encode() for t in texts])
    elif kind == "good" and datatype == "INT64":
        raw = (
            np.array(draw(st.lists(st.integers(-5, 40), min_size=1, max_size=2)))
            .astype("<i8")
            .tobytes()
        )
    elif kind == "raw":
        raw = draw(st.binary(max_size=40))
    elif kind == "typed":
        field = draw(st.sampled_from(CONTENT_FIELDS))
        values = {
            "bool_contents": st.lists(st.booleans(), max_size=3),
            "int_contents": st.lists(st.integers(-(2**31), 2**31 - 1), max_size=3),
            "int64_contents": st.lists(st.integers(-(2**63), 2**63 - 1), max_size=3),
            "uint_contents": st.lists(st.integers(0, 2**32 - 1), max_size=3),
            "uint64_contents": st.lists(st.integers(0, 2**64 - 1), max_size=3),
            "fp32_contents": st.lists(st.floats(width=32), max_size=3),
            "fp64_contents": st.lists(st.floats(), max_size=3),
            "bytes_contents": st.lists(st.binary(max_size=12), max_size=3),
        }[field]
        getattr(tensor.contents, field).extend(draw(values))
    return tensor, raw


@st.composite
def requests(draw: st.DrawFn) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(
        model_name=draw(st.sampled_from(["quickstart"] * 6 + ["", "other"]) | st.text(max_size=8)),
        model_version=draw(st.sampled_from(["", "", "1", "2"])),
        id=draw(st.text(max_size=12)),
    )
    pairs = draw(st.lists(tensors(), max_size=3))
    raws = [raw for _, raw in pairs]
    for tensor, _ in pairs:
        request.inputs.append(tensor)
    if pairs and draw(st.booleans()):  # all raw (mostly the valid form), or as drawn
        request.raw_input_contents.extend(r if r is not None else b"" for r in raws)
    for name in draw(st.lists(st.sampled_from(["patches", "embedding", "nope"]), max_size=2)):
        request.outputs.add(name=name)
    if draw(st.booleans()):
        param = request.parameters[draw(st.sampled_from(["timeout", "priority", "x"]))]
        choice = draw(st.sampled_from(["int64", "double", "string", "bool"]))
        if choice == "int64":
            param.int64_param = draw(st.integers(-(2**63), 2**63 - 1))
        elif choice == "double":
            param.double_param = draw(st.floats())
        elif choice == "string":
            param.string_param = draw(st.text(max_size=8))
        else:
            param.bool_param = draw(st.booleans())
    return request


@given(st.one_of(requests(), st.binary(max_size=64)))
def test_model_infer_answers_only_with_typed_errors(
    channel: grpc.Channel, case: pb.ModelInferRequest | bytes
) -> None:
    if isinstance(case, bytes):
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        request: object = case
    else:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer
        request = case
    try:
        call(request, timeout=30)
    except grpc.RpcError as exc:
        code = exc.code()  # type: ignore[attr-defined]
        assert code in ALLOWED, f"{code}: {exc.details()} for {request!r:.400}"  # type: ignore[attr-defined]


def test_after_the_campaign_nothing_is_in_flight(mesh: Mesh) -> None:
    with Client(mesh.address or "", timeout=60) as client:
        wait_nothing_in_flight(client, timeout=60)
        assert client.generate({"text": "still serving"}).output["patches"] > 0
