"""The Qwen3-Omni pipeline on real processes against transformers' own `generate()`.

The mesh runs the installed Qwen3-Omni pipeline on a tiny random checkpoint made here
(`omnirail.testing.tiny`; nothing is downloaded), each stage in its own process with
only its submodule's weights. Greedy thinker and talker: the text token ids and the codec
codes must equal the reference's exactly, and the streamed audio must match its waveform
within AUDIO_BOUND (code2wav is causal; the reference decodes these short requests in one
chunk, and the streamed chunks with left context reproduce it to float rounding).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("PIL")

from omnirail.bench.omni_bench import write_pipeline
from omnirail.client.sdk import Chunk, Client
from omnirail.models.qwen3_omni import weights
from omnirail.models.qwen3_omni.processor import load_processor
from omnirail.models.qwen3_omni.sizes import STAGE_SUBMODULES
from omnirail.ops.launcher import Mesh
from omnirail.testing.local_mesh import LocalMesh
from omnirail.testing.tiny import qwen3_omni as tiny_model
from omnirail.wire.errors import Code, OmniError
from tests.integration.conftest import collect_stream, read_openai_stream, shm_names

THINKER_TOKENS = 16
TALKER_TOKENS = 64
AUDIO_BOUND = 1e-5

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model.make_tiny_model(tmp_path_factory.mktemp("qwen3_omni") / "tiny")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Iterator[Mesh]:
    path = pipeline_copy(tmp_path_factory.mktemp("pipeline"), tiny_dir)
    # With the OpenAI gateway: the front doors are checked on the real architecture too.
    mesh = Mesh(path, env={"HF_HUB_OFFLINE": "1"}, http="127.0.0.1:0")
    mesh.start(timeout=300)
    yield mesh
    mesh.stop()
    assert shm_names(mesh.shm_prefix) == [], "shared memory left after shutdown"


@pytest.fixture(scope="module")
def reference(tiny_dir: Path) -> Any:
    model = tiny_model.load_reference(tiny_dir)
    processor = load_processor(tiny_dir)
    cache: dict[str, Any] = {}

    def get(kind: str) -> tuple[list[int], torch.Tensor, np.ndarray]:
        if kind not in cache:
            conv = tiny_model.sample_conversation(kind)
            prompt = tiny_model.processor_inputs(processor, conv)["input_ids"].shape[1]
            seq, codes, wav = tiny_model.reference_outputs(
                model,
                processor,
                conv,
                thinker_max_new_tokens=THINKER_TOKENS,
                talker_max_new_tokens=TALKER_TOKENS,
            )
            cache[kind] = (seq[0, prompt:].tolist(), codes, wav.numpy())
        return cache[kind]

    return get


def pipeline_copy(where: Path, model_dir: Path) -> Path:
    """The example's pipeline in `where`, on `model_dir`, with the reference's limits."""
    return write_pipeline(where, str(model_dir), THINKER_TOKENS, TALKER_TOKENS)


def request_for(kind: str) -> dict[str, Any]:
    """The mesh request for `tiny_model.sample_conversation(kind)`."""
    request: dict[str, Any] = {"text": "Describe this."}
    if "image" in kind:
        request["image"] = tiny_model.sample_image()
    if "audio" in kind:
        request["audio"] = tiny_model.sample_audio()
        request["sample_rate"] = tiny_model.SAMPLE_RATE
    return request


@pytest.mark.parametrize("kind", ["text", "image", "audio"])
def test_equal_to_transformers_generate(mesh: Mesh, reference: Any, kind: str) -> None:
    tokens, codes, wav = reference(kind)
    with Client(mesh.address or "", timeout=120, tensors="numpy") as client:
        chunks, result = collect_stream(client.stream(request_for(kind)))
    decode, code2wav = result.outputs["decode"], result.outputs["code2wav"]
    assert decode["token_ids"] == tokens
    assert torch.equal(torch.tensor(code2wav["codes"]).T, codes)
    text = "".join(c.data for c in chunks if c.modality == "text")
    assert text == decode["text"]
    pcm = np.concatenate([np.asarray(c.data["pcm"]) for c in chunks if c.modality == "audio"])
    assert pcm.shape == wav.shape and code2wav["samples"] == wav.size
    assert float(np.abs(pcm - wav).max()) <= AUDIO_BOUND


def test_local_mesh_answers_what_the_process_mesh_does(
    mesh: Mesh, reference: Any, tmp_path: Path, tiny_dir: Path
) -> None:
    """The same pipeline file in one process (LocalMesh): equal token ids and codec
    codes, and audio within the reference's bound (the processes' torch thread counts
    differ, so float sums may round differently)."""
    request = request_for("image")
    with Client(mesh.address or "", timeout=120, tensors="numpy") as client:
        processes = collect_stream(client.stream(request))
    with LocalMesh(pipeline_copy(tmp_path, tiny_dir), timeout=300) as local:
        with local.client(timeout=120, tensors="numpy") as client:
            in_process = collect_stream(client.stream(request))
    tokens, codes, _ = reference("image")
    for _, result in (processes, in_process):
        assert result.outputs["decode"]["token_ids"] == tokens
        assert torch.equal(torch.tensor(result.outputs["code2wav"]["codes"]).T, codes)
    assert in_process[1].outputs["decode"]["text"] == processes[1].outputs["decode"]["text"]
    pcm = [
        np.concatenate([np.asarray(c.data["pcm"]) for c in chunks if c.modality == "audio"])
        for chunks, _ in (processes, in_process)
    ]
    assert pcm[0].shape == pcm[1].shape
    assert float(np.abs(pcm[0] - pcm[1]).max()) <= AUDIO_BOUND


def test_concurrent_requests_each_get_what_they_get_alone(mesh: Mesh, tiny_dir: Path) -> None:
    """8 requests of different kinds, prompts and lengths at once (continuous batching in
    the thinker and the talker) each equal the reference run alone."""
    model = tiny_model.load_reference(tiny_dir)
    processor = load_processor(tiny_dir)
    kinds = ["text", "image", "audio", "text", "image", "audio", "text", "text"]
    cases = [(kind, f"Say {i} things about this.", 6 + 2 * i) for i, kind in enumerate(kinds)]

    def solo(case: tuple[str, str, int]) -> tuple[list[int], torch.Tensor]:
        kind, text, n = case
        conv = tiny_model.sample_conversation(kind, text)
        prompt = tiny_model.processor_inputs(processor, conv)["input_ids"].shape[1]
        seq, codes, _ = tiny_model.reference_outputs(
            model, processor, conv, thinker_max_new_tokens=n, talker_max_new_tokens=TALKER_TOKENS
        )
        return seq[0, prompt:].tolist(), codes

    def on_mesh(case: tuple[str, str, int]) -> tuple[list[int], torch.Tensor]:
        kind, text, n = case
        request = {**request_for(kind), "text": text, "max_new_tokens": n}
        with Client(mesh.address or "", timeout=180, tensors="numpy") as client:
            _, result = collect_stream(client.stream(request))
        codes = torch.tensor(result.outputs["code2wav"]["codes"]).T
        return result.outputs["decode"]["token_ids"], codes

    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        got = list(pool.map(on_mesh, cases))
    for case, (tokens, codes) in zip(cases, got, strict=True):
        want_tokens, want_codes = solo(case)
        assert tokens == want_tokens, case
        assert torch.equal(codes, want_codes), case


def test_front_doors_answer_what_the_sdk_does(mesh: Mesh) -> None:
    """A text+image turn through the OpenAI gateway (the chat passes through as `messages`,
    the image as a PNG data URL) and through KServe (the shorthand `text` + `image`
    tensors): the same text and audio as the native SDK's answer."""
    import base64
    import io

    from PIL import Image

    openai = pytest.importorskip("openai")
    tritonclient = pytest.importorskip("tritonclient.grpc")
    image = tiny_model.sample_image()
    with Client(mesh.address or "", timeout=120, tensors="numpy") as client:
        chunks, result = collect_stream(client.stream({"text": "Describe this.", "image": image}))
    text = result.outputs["decode"]["text"]
    pcm = np.concatenate([np.asarray(c.data["pcm"]) for c in chunks if c.modality == "audio"])

    png = io.BytesIO()
    Image.fromarray(image).save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    oai = openai.OpenAI(base_url=f"{mesh.http_address}/v1", api_key="-", max_retries=0)
    stream = oai.chat.completions.create(
        model="qwen3-omni",
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "Describe this."}]}],
        modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "pcm16"},
        stream=True,
    )  # fmt: skip
    said, audio = read_openai_stream(stream)
    assert said == text
    want = np.rint(np.clip(pcm, -1, 1) * 32767).astype(np.int16)
    np.testing.assert_array_equal(np.frombuffer(bytes(audio), "<i2"), want)

    triton = tritonclient.InferenceServerClient(mesh.address or "")
    inputs = [tritonclient.InferInput("text", [1], "BYTES"),
              tritonclient.InferInput("image", list(image.shape), "UINT8")]  # fmt: skip
    inputs[0].set_data_from_numpy(np.array([b"Describe this."], dtype=object))
    inputs[1].set_data_from_numpy(image)
    answer = triton.infer("qwen3-omni", inputs)
    assert answer.as_numpy("text")[0].decode() == text
    assert answer.as_numpy("token_ids").tolist() == result.outputs["decode"]["token_ids"]
    np.testing.assert_array_equal(answer.as_numpy("audio"), pcm)


def test_first_audio_arrives_before_the_last_text(mesh: Mesh) -> None:
    with Client(mesh.address or "", timeout=120, tensors="numpy") as client:
        chunks, result = collect_stream(
            client.stream({"text": "Tell me a long story.", "max_new_tokens": 48})
        )
    assert len(result.outputs["decode"]["token_ids"]) >= 32
    order = [c.modality for c in chunks]
    last_text = len(order) - 1 - order[::-1].index("text")
    assert order.index("audio") < last_text, order


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "video", "video": 1}]}]}, "type"),
        ({"text": "x", "image": np.zeros((8, 8), np.uint8)}, "inputs.image"),
        ({"text": "x", "audio": np.zeros(800, np.float32), "sample_rate": 8000}, "sample_rate"),
        ({"text": "x", "max_new_tokens": 100_000}, "inputs.max_new_tokens"),
    ],
)
def test_bad_input_fails_that_request_and_the_mesh_serves_on(
    mesh: Mesh, request_: dict[str, Any], field: str
) -> None:
    with Client(mesh.address or "", timeout=60, tensors="numpy") as client:
        with pytest.raises(OmniError) as info:
            client.generate(request_)
        assert info.value.code == Code.INVALID_ARGUMENT and field in info.value.message
        assert info.value.stage == "preprocessing"
        result = client.generate({"text": "Hi", "max_new_tokens": 2, "speak": False})
    assert len(result.outputs["decode"]["token_ids"]) <= 2


def test_aborted_streams_leave_nothing_behind(mesh: Mesh) -> None:
    """50 requests left mid-stream (the SDK aborts them on every stage) leave no request
    on any stage: no KV cache, stream state or relay extent stays behind."""

    def abandon(i: int) -> None:
        with Client(mesh.address or "", timeout=120, tensors="numpy") as client:
            for event in client.stream(
                {**request_for(["text", "image"][i % 2]), "max_new_tokens": 24}
            ):
                if isinstance(event, Chunk) and event.modality == "audio":
                    break  # leaving the loop aborts the request everywhere

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        list(pool.map(abandon, range(50)))
    with Client(mesh.address or "", timeout=60) as client:
        deadline = time.monotonic() + 30
        while True:
            busy = {
                (s.name, r.replica_id): (r.inflight, r.queue_depth)
                for s in client.describe().stages
                for r in s.replicas
                if r.inflight or r.queue_depth
            }
            if not busy or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert busy == {}
        # And it still answers exactly.
        result = client.generate({"text": "Hi", "max_new_tokens": 2, "speak": False})
    assert 1 <= len(result.outputs["decode"]["token_ids"]) <= 2


def test_each_stage_process_holds_only_its_submodule(mesh: Mesh, tiny_dir: Path) -> None:
    """Every model stage logs the parameters it holds at start-up; each count equals the
    reference model's submodule, far below the whole model."""
    model = tiny_model.load_reference(tiny_dir)
    total = sum(p.numel() for p in model.parameters())
    for stage, part in STAGE_SUBMODULES.items():
        log = (mesh.run_dir / "logs" / f"stage-{stage}.log").read_text()
        found = re.findall(rf"holds (\d+) parameters: {re.escape(part)}$", log, re.M)
        want = sum(p.numel() for p in weights.reference_parameters(model, part).values())
        assert found == [str(want)], (stage, found, want)
        assert want < total / 2
    for stage in ("preprocessing", "decode"):
        assert "holds" not in (mesh.run_dir / "logs" / f"stage-{stage}.log").read_text()


def _start_fails(where: Path, model_dir: Path) -> str:
    mesh = Mesh(pipeline_copy(where, model_dir), env={"HF_HUB_OFFLINE": "1"})
    try:
        with pytest.raises(OmniError) as info:
            mesh.start(timeout=300)
    finally:
        mesh.stop()
    return info.value.message


def test_a_missing_shard_stops_start_up_naming_the_file(tmp_path: Path, tiny_dir: Path) -> None:
    broken = tmp_path / "model"
    shutil.copytree(tiny_dir, broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["code2wav.code_embedding.weight"]
    (broken / shard).unlink()
    message = _start_fails(tmp_path / "pipeline", broken)
    assert f"{broken}/{shard}: no such file" in message


def test_a_model_of_another_architecture_stops_start_up(tmp_path: Path, tiny_dir: Path) -> None:
    other = tmp_path / "model"
    shutil.copytree(tiny_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["model_type"] = "qwen2"
    (other / "config.json").write_text(json.dumps(config))
    message = _start_fails(tmp_path / "pipeline", other)
    assert "model_type is 'qwen2', not 'qwen3_omni_moe'" in message
