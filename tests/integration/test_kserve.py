"""The KServe v2 (Open Inference Protocol) gRPC front door, driven by tritonclient.

tritonclient.grpc is a client nobody here wrote: it runs ModelInfer and a ModelStreamInfer
stream against the quickstart and the omni demo, and its answers must equal what the
native SDK gets for the same inputs. Bad requests get gRPC status codes with messages
that name the problem; a stream's failed request comes back as its error_message.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from omnirail.client.sdk import Client
from omnirail.kserve import grpc_predict_v2_pb2 as pb
from omnirail.kserve import grpc_predict_v2_pb2_grpc as pb_grpc
from omnirail.models.omni_demo import pipeline_file
from omnirail.ops.launcher import Mesh
from omnirail.telemetry.export import read_span_files
from tests.integration.conftest import REPO, omni_demo_answer
from tests.integration.test_metrics import scrape, value

tritonclient = pytest.importorskip("tritonclient.grpc")
InferInput = tritonclient.InferInput
InferenceServerException = pytest.importorskip("tritonclient.utils").InferenceServerException

pytestmark = pytest.mark.timeout(300)


def _tcp(path: Path) -> Iterator[Mesh]:
    with Mesh(path, transport="tcp") as mesh:
        yield mesh


@pytest.fixture(scope="module")
def quickstart() -> Iterator[Mesh]:
    yield from _tcp(REPO / "examples" / "quickstart" / "pipeline.yaml")


@pytest.fixture(scope="module")
def demo() -> Iterator[Mesh]:
    yield from _tcp(pipeline_file())


def _triton(mesh: Mesh) -> Any:
    return tritonclient.InferenceServerClient(mesh.address or "")


def _tensor(name: str, value: np.ndarray, datatype: str) -> Any:
    tensor = InferInput(name, list(value.shape), datatype)
    tensor.set_data_from_numpy(value)
    return tensor


def _text(name: str, text: str) -> Any:
    return _tensor(name, np.array([text.encode()], dtype=object), "BYTES")


def _int(name: str, value: int) -> Any:
    return _tensor(name, np.array([value], dtype=np.int64), "INT64")


def test_health_and_metadata(quickstart: Mesh) -> None:
    client = _triton(quickstart)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("quickstart")
    meta = client.get_model_metadata("quickstart", as_json=True)
    assert meta["name"] == "quickstart" and meta["versions"] == ["1"]
    assert [(i["name"], i["datatype"], i["shape"]) for i in meta["inputs"]] == [
        ("text", "BYTES", ["1"]),
        ("image_size", "INT64", ["1"]),
    ]
    assert {o["name"] for o in meta["outputs"]} == {"embedding", "similarity", "patches"}
    server = client.get_server_metadata(as_json=True)
    assert server["name"] == "omnirail"
    with pytest.raises(InferenceServerException, match="unknown model 'nope'") as info:
        client.get_model_metadata("nope")
    assert info.value.status() == "StatusCode.NOT_FOUND"


def test_model_infer_equals_the_native_api(quickstart: Mesh) -> None:
    client = _triton(quickstart)
    result = client.infer(
        "quickstart", [_text("text", "hello omnirail"), _int("image_size", 64)], request_id="q1"
    )
    with Client(quickstart.address or "", timeout=60, tensors="numpy") as sdk:
        want = sdk.generate({"text": "hello omnirail", "image_size": 64}).outputs["fuse"]
    assert result.get_response().id == "q1"
    np.testing.assert_array_equal(result.as_numpy("embedding"), want["embedding"])
    assert result.as_numpy("embedding").dtype == np.float32
    assert result.as_numpy("similarity").tolist() == [want["similarity"]]
    assert result.as_numpy("patches").tolist() == [want["patches"]]
    # Asking for one output returns just that one.
    only = client.infer(
        "quickstart",
        [_text("text", "hello omnirail")],
        outputs=[tritonclient.InferRequestedOutput("patches")],
    )
    assert [o.name for o in only.get_response().outputs] == ["patches"]


def _stream(client: Any, requests: list[tuple[str, list[Any]]], model: str) -> dict[str, Any]:
    """Sends each (id, inputs) on one stream; returns id -> list of results or an error."""
    answers: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    for rid, inputs in requests:
        client.async_stream_infer(model, inputs, request_id=rid, enable_empty_final_response=True)
    out: dict[str, Any] = {rid: [] for rid, _ in requests}
    done: set[str] = set()
    while len(done) < len(requests):
        result, error = answers.get(timeout=60)
        if error is not None:
            # tritonclient hands a failed request over as an exception naming nothing else;
            # its message is our error_message.
            out.setdefault("errors", []).append(str(error))
            done.add(f"error-{len(out['errors'])}")
            continue
        response = result.get_response()
        out[response.id].append(result)
        if response.parameters["triton_final_response"].bool_param:
            done.add(response.id)
    client.stop_stream()
    return out


def test_model_infer_and_stream_on_the_omni_demo(demo: Mesh) -> None:
    inputs = {"text": "Tell me about rivers", "max_new_tokens": 10}
    want_text, want_audio = omni_demo_answer(demo.address or "", inputs)
    assert want_text and want_audio.size
    client = _triton(demo)
    tensors = [_text("text", inputs["text"]), _int("max_new_tokens", 10)]

    result = client.infer("omni-demo", tensors)
    assert result.as_numpy("text")[0].decode() == want_text
    np.testing.assert_array_equal(result.as_numpy("audio"), want_audio)

    # Streamed: text pieces and audio chunks as they come, then an empty final response.
    text_only = [_text("text", "only words please"), _tensor("speak", np.array([False]), "BOOL")]
    answers = _stream(client, [("s1", tensors), ("s2", text_only)], "omni-demo")
    assert "errors" not in answers, answers.get("errors")
    pieces = [r.as_numpy("text") for r in answers["s1"] if r.as_numpy("text") is not None]
    audio = [r.as_numpy("audio") for r in answers["s1"] if r.as_numpy("audio") is not None]
    assert len(pieces) > 1 and len(audio) > 1, "chunks should arrive one by one"
    assert "".join(p[0].decode() for p in pieces) == want_text
    np.testing.assert_array_equal(np.concatenate(audio), want_audio)
    final = answers["s1"][-1].get_response()
    assert not final.outputs and final.parameters["triton_final_response"].bool_param
    # speak=False: text only, no audio output at all.
    assert all(r.as_numpy("audio") is None for r in answers["s2"])
    assert any(r.as_numpy("text") is not None for r in answers["s2"])


def test_bad_requests_get_precise_errors(demo: Mesh) -> None:
    client = _triton(demo)
    text = _text("text", "hi")
    cases: list[tuple[list[Any], str, str]] = [
        ([_text("prompt", "hi")], "INVALID_ARGUMENT", "input 'prompt': unknown"),
        ([_int("max_new_tokens", 3)], "INVALID_ARGUMENT", "inputs ['text']: required"),
        (
            [_tensor("text", np.array([b"a", b"b"], dtype=object), "BYTES")],
            "INVALID_ARGUMENT",
            "input 'text': shape [2], expected [1]",
        ),
        (
            [text, _tensor("max_new_tokens", np.array([3.0], np.float32), "FP32")],
            "INVALID_ARGUMENT",
            "input 'max_new_tokens': datatype 'FP32', expected INT64",
        ),
        (
            [text, _tensor("image", np.zeros((4, 4, 4), np.uint8), "UINT8")],
            "INVALID_ARGUMENT",
            "input 'image': shape [4, 4, 4], expected [-1, -1, 3]",
        ),
        # The pipeline's own check, reached through the front door.
        ([text, _int("max_new_tokens", 100000)], "INVALID_ARGUMENT", "inputs.max_new_tokens"),
        ([text, _text("speak", "yes")], "INVALID_ARGUMENT", "input 'speak': datatype 'BYTES'"),
    ]
    for tensors, code, message in cases:
        with pytest.raises(InferenceServerException) as info:
            client.infer("omni-demo", tensors)
        assert info.value.status() == f"StatusCode.{code}", info.value
        assert message in info.value.message(), info.value
    with pytest.raises(InferenceServerException, match="unknown; the model makes") as info:
        client.infer("omni-demo", [text], outputs=[tritonclient.InferRequestedOutput("pictures")])
    with pytest.raises(InferenceServerException, match="has no version '7'"):
        client.infer("omni-demo", [text], model_version="7")
    # On a stream, a bad request fails alone: the good one beside it completes.
    answers = _stream(client, [("good", [text, _int("max_new_tokens", 3)])], "omni-demo")
    assert answers["good"]
    answers = _stream(
        client, [("bad", [_text("prompt", "x")]), ("ok", [text, _int("max_new_tokens", 3)])],
        "omni-demo",
    )  # fmt: skip
    assert any("input 'prompt': unknown" in e for e in answers["errors"]), answers
    assert answers["ok"][-1].get_response().parameters["triton_final_response"].bool_param


def test_raw_contents_are_checked(demo: Mesh) -> None:
    """What tritonclient never sends wrong, sent wrong on a plain stub."""
    with grpc.insecure_channel(demo.address or "") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)

        def infer(**fields: Any) -> grpc.RpcError:
            request = pb.ModelInferRequest(model_name="omni-demo", **fields)
            with pytest.raises(grpc.RpcError) as info:
                stub.ModelInfer(request, timeout=30)
            return info.value

        text = pb.ModelInferRequest.InferInputTensor(name="text", datatype="BYTES", shape=[1])
        err = infer(inputs=[text], raw_input_contents=[b"\x09\x00\x00\x00abc"])
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "claims 9 bytes; fewer follow" in err.details()
        err = infer(inputs=[text], raw_input_contents=[b"\x01\x00\x00\x00\xff"])
        assert "not UTF-8 text" in err.details()
        err = infer(inputs=[text, text], raw_input_contents=[b"\x00\x00\x00\x00"])
        assert "1 entries for 2 inputs" in err.details()
        n = pb.ModelInferRequest.InferInputTensor(
            name="max_new_tokens", datatype="INT64", shape=[1]
        )
        err = infer(inputs=[text, n], raw_input_contents=[b"\x02\x00\x00\x00hi", b"\x01\x02"])
        assert "raw contents hold 2 bytes; shape and datatype need 8" in err.details()
        typed = pb.ModelInferRequest.InferInputTensor(
            name="text",
            datatype="BYTES",
            shape=[1],
            contents=pb.InferTensorContents(fp32_contents=[1.0]),
        )
        err = infer(inputs=[typed])
        assert "contents.fp32_contents does not hold BYTES data" in err.details()
        # Not a ModelInferRequest at all.
        raw = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as info:
            raw(b"\xff\xff\xff", timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # The mesh serves on.
    result = _triton(demo).infer(
        "omni-demo", [_text("text", "still here"), _int("max_new_tokens", 2)]
    )
    assert result.as_numpy("text")[0]


def test_traced_and_counted_like_the_native_api(quickstart: Mesh) -> None:
    """The caller's traceparent parents the mesh's spans; the coordinator counts the request."""
    with Client(quickstart.address or "", timeout=30) as sdk:
        metrics = sdk.describe().metrics_address
    before = value(scrape(metrics), "omnirail_requests_total", state="completed")
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    _triton(quickstart).infer(
        "quickstart",
        [_text("text", "trace me")],
        headers={"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"},
    )
    assert value(scrape(metrics), "omnirail_requests_total", state="completed") == before + 1
    deadline = time.monotonic() + 20
    while True:
        files = sorted(quickstart.span_dir.glob("*.otlp"))
        spans = [s for s in read_span_files(files) if s["trace_id"] == trace_id]
        services = {s["service"] for s in spans}
        if {"omnirail-coordinator", "omnirail-stage-fuse"} <= services:
            break
        assert time.monotonic() < deadline, services
        time.sleep(0.3)
    root = next(s for s in spans if s["name"] == "omnirail.request")
    assert root["parent_span_id"] == "b7ad6b7169203331"
