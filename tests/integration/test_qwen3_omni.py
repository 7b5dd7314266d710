"""The Qwen3-Omni pipeline on real processes against transformers' own `generate()`.

The mesh runs examples/qwen3_omni/pipeline.yaml on a tiny random checkpoint made here
(`tiny_model.make_tiny_model`; nothing is downloaded), each stage in its own process with
only its submodule's weights. Greedy thinker and talker: the text token ids and the codec
codes must equal the reference's exactly, and the streamed audio must match its waveform
within AUDIO_BOUND (code2wav is causal; the reference decodes these short requests in one
chunk, and the streamed chunks with left context reproduce it to float rounding).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
import yaml

pytest.importorskip("transformers")
pytest.importorskip("PIL")

from examples.qwen3_omni import tiny_model
from examples.qwen3_omni.processor import load_processor
from omnirail.client.sdk import Chunk, Client
from omnirail.ops.launcher import Mesh
from tests.integration.conftest import shm_names

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "qwen3_omni"
THINKER_TOKENS = 16
TALKER_TOKENS = 64
AUDIO_BOUND = 1e-5

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model.make_tiny_model(tmp_path_factory.mktemp("qwen3_omni") / "tiny")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Iterator[Mesh]:
    # A copy of the example directory (its modules sit next to the pipeline file), with the
    # tiny checkpoint as model_path and the reference's token limits.
    where = tmp_path_factory.mktemp("pipeline")
    shutil.copytree(
        EXAMPLE, where, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__")
    )
    cfg = yaml.safe_load((EXAMPLE / "pipeline.yaml").read_text())
    cfg["model_path"] = str(tiny_dir)
    for stage in cfg["stages"]:
        args = stage.setdefault("factory_args", {})
        if stage["name"] == "preprocessing":
            args["max_new_tokens"] = THINKER_TOKENS
        if stage["name"] == "talker":
            args["max_new_tokens"] = TALKER_TOKENS
    path = where / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    mesh = Mesh(path, env={"HF_HUB_OFFLINE": "1"})
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


def request_for(kind: str) -> dict[str, Any]:
    """The mesh request for `tiny_model.sample_conversation(kind)`."""
    request: dict[str, Any] = {"text": "Describe this."}
    if "image" in kind:
        request["image"] = tiny_model.sample_image()
    if "audio" in kind:
        request["audio"] = tiny_model.sample_audio()
        request["sample_rate"] = tiny_model.SAMPLE_RATE
    return request


def collect(events: Iterator[Any]) -> tuple[list[Chunk], Any]:
    chunks: list[Chunk] = []
    for event in events:
        if isinstance(event, Chunk):
            chunks.append(event)
        else:
            return chunks, event
    raise AssertionError("the stream ended without a result")


@pytest.mark.parametrize("kind", ["text", "image", "audio"])
def test_equal_to_transformers_generate(mesh: Mesh, reference: Any, kind: str) -> None:
    tokens, codes, wav = reference(kind)
    with Client(mesh.address or "", timeout=120, tensors="numpy") as client:
        chunks, result = collect(client.stream(request_for(kind)))
    decode, code2wav = result.outputs["decode"], result.outputs["code2wav"]
    assert decode["token_ids"] == tokens
    assert torch.equal(torch.tensor(code2wav["codes"]).T, codes)
    text = "".join(c.data for c in chunks if c.modality == "text")
    assert text == decode["text"]
    pcm = np.concatenate([np.asarray(c.data["pcm"]) for c in chunks if c.modality == "audio"])
    assert pcm.shape == wav.shape and code2wav["samples"] == wav.size
    assert float(np.abs(pcm - wav).max()) <= AUDIO_BOUND
