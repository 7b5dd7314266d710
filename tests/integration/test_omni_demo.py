"""The omni demo pipeline on a real mesh: eight stage processes, streams, tracing.

The module's mesh runs the installed omni demo's pipeline.yaml (omnirail.models.omni_demo)
with one change: the thinker takes at least 5 ms a step (as a bigger model would), so an
abort lands while it generates. The command-line and SDK tests run examples/omni_demo, as
docs/models/omni-demo.md does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from omnirail import Chunk, Client, OmniError
from omnirail.models.omni_demo import pipeline_file
from omnirail.ops.launcher import Mesh
from omnirail.wire.errors import Code
from tests.integration.conftest import shm_names
from tests.otlp_receiver import OtlpReceiver

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "omni_demo"
ENCODERS = {"stage image_encoder", "stage audio_encoder"}


def _pipeline_copy(tmp: Path, source: str = "pipeline.yaml", **thinker_args: Any) -> Path:
    """The installed demo's pipeline file `source`, written into `tmp` with `thinker_args`
    passed to the thinker (its stages name the installed modules: nothing else is copied)."""
    cfg = yaml.safe_load(pipeline_file(source).read_text())
    for stage in cfg["stages"]:
        if stage["name"] == "thinker":
            stage.setdefault("factory_args", {}).update(thinker_args)
    cfg["abort_ack_timeout_s"] = 5  # every stage's ack is asserted: room for a busy host
    path = tmp / source
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _python_m(
    *args: str, cwd: Path = ROOT, timeout: float = 300, mesh: Mesh | None = None
) -> subprocess.CompletedProcess:
    """`python -m ARGS` with this checkout importable; fails the test on a non-zero exit,
    showing its stderr and the last log lines of `mesh`'s processes."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr + ("\n" + mesh.log_tails() if mesh else "")
    return proc


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as rx:
        yield rx


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory, receiver: OtlpReceiver) -> Iterator[Mesh]:
    path = _pipeline_copy(tmp_path_factory.mktemp("demo"), step_ms=5)
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_TRACES_SAMPLER": "always_on"}
    mesh = Mesh(path, env=env)
    mesh.start(timeout=240)
    yield mesh
    mesh.stop()
    assert shm_names(mesh.shm_prefix) == [], "shared memory left after shutdown"


def _collect(events: Iterator[Any]) -> tuple[dict[str, list[Chunk]], Any]:
    chunks: dict[str, list[Chunk]] = {}
    for event in events:
        if isinstance(event, Chunk):
            chunks.setdefault(event.modality, []).append(event)
        else:
            return chunks, event
    raise AssertionError("no result")


def _stage_spans(rx: OtlpReceiver, request_id: str) -> set[str]:
    def done(spans: list[dict[str, Any]]) -> bool:
        return any(
            s["name"] == "omnirail.request"
            and s["attributes"].get("omnirail.request_id") == request_id
            for s in spans
        )

    spans = rx.wait_for(done, timeout=30)
    [root] = [
        s
        for s in spans
        if s["name"] == "omnirail.request"
        and s["attributes"].get("omnirail.request_id") == request_id
    ]
    time.sleep(1.0)  # stage spans are exported on their own schedule
    return {s["name"] for s in rx.spans() if s["trace_id"] == root["trace_id"]}


def _check_stream(chunks: dict[str, list[Chunk]], outputs: dict[str, Any]) -> np.ndarray:
    text = chunks["text"]
    assert "".join(c.data for c in text) == outputs["decode"]["text"]
    assert [c.chunk_id for c in text] == list(range(len(text)))
    assert len(outputs["decode"]["text"].split()) == outputs["decode"]["tokens"]
    audio = chunks["audio"]
    assert [c.chunk_id for c in audio] == list(range(len(audio))) and len(audio) >= 2
    assert {c.stage for c in audio} == {"code2wav"} and {c.stage for c in text} == {"decode"}
    pcm = np.concatenate([np.asarray(c.data["pcm"]) for c in audio])
    assert pcm.dtype == np.float32 and pcm.size == outputs["code2wav"]["samples"]
    # 4 frames of 20 ms per token at 16 kHz.
    assert pcm.size == outputs["decode"]["tokens"] * 4 * 320
    assert 0.0 < float(np.abs(pcm).max()) <= 0.2 + 1e-6
    return pcm


def test_text_only_request_streams_text_and_audio_and_skips_the_encoders(
    demo: Mesh, receiver: OtlpReceiver
) -> None:
    with Client(demo.address or "", timeout=60) as client:
        inputs = {"text": "Tell me about the river", "max_new_tokens": 12, "seed": 3}
        chunks, result = _collect(client.stream(inputs, request_id="demo-text"))
    assert set(result.outputs) == {"decode", "code2wav"}
    assert result.outputs["decode"]["tokens"] == 12
    _check_stream(chunks, result.outputs)
    names = _stage_spans(receiver, "demo-text")
    expected = {"preprocessing", "mm_aggregate", "thinker", "decode", "talker", "code2wav"}
    assert {f"stage {n}" for n in expected} <= names
    assert not names & ENCODERS


def test_multimodal_request_goes_through_both_encoders(demo: Mesh, receiver: OtlpReceiver) -> None:
    image = (np.arange(48 * 64 * 3) % 251).astype(np.uint8).reshape(48, 64, 3)
    audio = (0.2 * np.sin(np.arange(8000) / 5.0)).astype(np.float32)
    text = {"text": "What is this", "max_new_tokens": 10, "seed": 4}
    with Client(demo.address or "", timeout=60) as client:
        chunks, result = _collect(
            client.stream({**text, "image": image, "audio": audio}, request_id="demo-mm")
        )
        plain = client.generate(text)
    _check_stream(chunks, result.outputs)
    assert ENCODERS <= _stage_spans(receiver, "demo-mm")
    # The image and audio are in the prompt: the same seed says something else.
    assert result.outputs["decode"]["text"] != plain.outputs["decode"]["text"]


def test_speak_false_answers_in_text_only(demo: Mesh) -> None:
    with Client(demo.address or "", timeout=60) as client:
        inputs = {"text": "quiet please", "speak": False, "max_new_tokens": 6}
        chunks, result = _collect(client.stream(inputs))
    assert set(result.outputs) == {"decode"} and set(chunks) == {"text"}


def test_concurrent_requests_match_the_same_requests_one_by_one(demo: Mesh) -> None:
    inputs = [
        {"text": f"story number {i}", "max_new_tokens": 4 + 3 * i, "seed": i} for i in range(6)
    ]
    with Client(demo.address or "", timeout=120) as client:
        alone = [client.generate(x).outputs for x in inputs]
        together: list[Any] = [None] * len(inputs)

        def run(i: int) -> None:
            together[i] = client.generate(inputs[i]).outputs

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(inputs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert together == alone  # batching in the thinker and talker changes nothing


def test_bad_input_fails_that_request_naming_the_field(demo: Mesh) -> None:
    with Client(demo.address or "", timeout=60) as client:
        with pytest.raises(OmniError) as info:
            client.generate({"text": "hi", "max_new_tokens": 100000})
        assert "inputs.max_new_tokens" in info.value.message
        assert info.value.stage == "preprocessing"
        assert info.value.code == Code.INVALID_ARGUMENT
        with pytest.raises(OmniError) as info:
            client.generate({"text": "hi", "image": np.zeros((5, 5), np.uint8)})
        assert "inputs.image: expected HxWx3" in info.value.message
        for inputs, field in (
            ({"text": 123}, "inputs.text"),
            ({"text": "hi", "seed": "abc"}, "inputs.seed"),
            ({}, "inputs.text"),
            ({"text": "hi", "x": 2}, "inputs: unknown fields"),
        ):
            with pytest.raises(OmniError) as info:
                client.generate(inputs)
            assert info.value.code == Code.INVALID_ARGUMENT, info.value
            assert info.value.message.startswith(field), info.value
        ok = client.generate({"text": "still here", "max_new_tokens": 3})
    assert ok.outputs["decode"]["tokens"] == 3


def test_abort_mid_stream_stops_every_stage_and_the_mesh_keeps_serving(demo: Mesh) -> None:
    with Client(demo.address or "", timeout=60) as client:
        events = client.stream({"text": "a long one", "max_new_tokens": 256}, request_id="demo-ab")
        for event in events:
            if isinstance(event, Chunk) and event.modality == "audio":
                break
        ended: list[BaseException] = []

        def read_rest() -> None:
            try:
                for _ in events:
                    pass
            except OmniError as exc:
                ended.append(exc)

        reader = threading.Thread(target=read_rest)
        reader.start()
        acked = client.abort("demo-ab", "test abort")
        reader.join(30)
        assert ended and getattr(ended[0], "code", None) == Code.CANCELLED
        assert {"thinker", "talker", "code2wav", "decode"} <= {
            a.split("/")[0] for a in acked.acknowledged
        }
        assert client.status("demo-ab").state == "aborted"
        chunks, result = _collect(client.stream({"text": "after the abort", "max_new_tokens": 5}))
    _check_stream(chunks, result.outputs)


def test_sdk_example_prints_text_and_writes_wav(demo: Mesh, tmp_path: Path) -> None:
    wav_path = tmp_path / "answer.wav"
    proc = _python_m(
        "examples.omni_demo.client",
        "--address",
        demo.address or "",
        "--text",
        "hello there",
        "--wav",
        str(wav_path),
        "--image",
        # The request's deadline ends it well before the process timeout, so a stall
        # fails with the coordinator's account of it (and the mesh's logs) on stderr.
        "--timeout",
        "60",
        timeout=120,
        mesh=demo,
    )
    with wave.open(str(wav_path)) as wav:
        assert (wav.getframerate(), wav.getnchannels(), wav.getsampwidth()) == (16000, 1, 2)
        frames = wav.getnframes()
    assert frames > 0 and f"{frames / 16000:.2f} s of audio" in proc.stdout


@pytest.mark.slow
def test_cli_run_streams_text_and_writes_the_wav(tmp_path: Path) -> None:
    wav_path = tmp_path / "out.wav"
    proc = _python_m(
        "omnirail",
        "run",
        str(DEMO / "pipeline.yaml"),
        "--input-file",
        str(DEMO / "input_multimodal.json"),
        "--stream",
        "--audio-out",
        str(wav_path),
        cwd=tmp_path,
    )
    text_line, rest = proc.stdout.split("\n", 1)
    outputs = json.loads(rest)
    assert text_line == outputs["decode"]["text"] and outputs["decode"]["tokens"] == 24
    with wave.open(str(wav_path)) as wav:
        assert wav.getnframes() == outputs["code2wav"]["samples"] == 24 * 4 * 320
    assert "first audio" in proc.stderr and "real-time factor" in proc.stderr


@pytest.mark.slow
def test_hugging_face_thinker_from_a_local_directory(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from tests.integration.tiny_hf_model import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny-llama")
    path = _pipeline_copy(tmp_path, "pipeline_hf.yaml")
    mesh = Mesh(path, env={"OMNI_DEMO_HF_MODEL": str(model)})
    mesh.start(timeout=240)
    try:
        with Client(mesh.address or "", timeout=120) as client:
            inputs = {"text": "tell me a story about the sea", "max_new_tokens": 8, "seed": 1}
            chunks, result = _collect(client.stream({**inputs, "image": "synthetic"}))
            again = client.generate({**inputs, "image": "synthetic"})
    finally:
        mesh.stop()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    text = result.outputs["decode"]["text"]
    assert "".join(c.data for c in chunks["text"]) == text
    tokens = result.outputs["decode"]["tokens"]
    # Special tokens the random model samples are streamed but print as nothing.
    assert 1 <= len(tok(text, add_special_tokens=False).input_ids) <= tokens <= 8
    assert text == again.outputs["decode"]["text"]  # the seed decides
    pcm = np.concatenate([np.asarray(c.data["pcm"]) for c in chunks["audio"]])
    assert pcm.size == result.outputs["code2wav"]["samples"] == tokens * 4 * 320


def test_bench_demo_against_a_running_mesh(demo: Mesh) -> None:
    proc = _python_m(
        "omnirail",
        "bench",
        "demo",
        "--address",
        demo.address or "",
        "--runs",
        "2",
        "--concurrency",
        "2",
        "--input",
        '{"text": "bench", "max_new_tokens": 6}',
        "--json",
    )
    report = json.loads(proc.stdout)
    assert report["concurrency"] == 2 and len(report["rtf_runs"]) == 4
    assert report["audio_s"] == 6 * 4 * 0.02  # 6 tokens, 4 frames of 20 ms each
    assert 0 < report["ttft_ms"] and 0 < report["ttfa_ms"] < report["total_ms"]
    assert report["rtf"] == pytest.approx(report["total_ms"] / 1000 / report["audio_s"], rel=0.5)
