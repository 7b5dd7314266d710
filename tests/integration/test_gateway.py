"""The OpenAI-compatible HTTP gateway (`omnirail up --http`), driven by the official
`openai` SDK: a streamed chat completion with audio (text and WAV equal to what the native
SDK gets), a whole one, `/v1/audio/speech`, `/v1/models`; bad requests in OpenAI's error
shape; and a client that disconnects mid-stream aborting its request on every stage.

The omni demo here takes at least 5 ms a thinker step, so a request lasts long enough
for a disconnect to land while it generates.
"""

from __future__ import annotations

import base64
import io
import json
import socket
import time
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from omnirail.client.sdk import Client
from omnirail.ops.launcher import Mesh
from omnirail.telemetry.export import read_span_files
from tests.integration.conftest import omni_demo_answer
from tests.integration.test_metrics import scrape, value
from tests.integration.test_omni_demo import _pipeline_copy

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")

pytestmark = pytest.mark.timeout(300)
MODEL = "omni-demo"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    path = _pipeline_copy(tmp_path_factory.mktemp("demo"), step_ms=5)
    with Mesh(path, http="127.0.0.1:0") as running:
        yield running


@pytest.fixture(scope="module")
def oai(mesh: Mesh) -> Any:
    return openai.OpenAI(base_url=f"{mesh.http_address}/v1", api_key="unused", max_retries=0)


def _pcm16(samples: np.ndarray) -> np.ndarray:
    return np.rint(np.clip(samples, -1, 1) * 32767).astype(np.int16)


def _wav_samples(data: bytes, streamed: bool) -> tuple[int, np.ndarray]:
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getnchannels(), w.getsampwidth()) == (1, 2)
        # A streamed WAV's header says "unknown length": read what is there.
        frames = w.readframes(1 << 30 if streamed else w.getnframes())
        return w.getframerate(), np.frombuffer(frames, dtype="<i2")


def test_models_and_health(mesh: Mesh, oai: Any) -> None:
    assert [m.id for m in oai.models.list().data] == [MODEL]
    assert oai.models.retrieve(MODEL).owned_by == "omnirail"
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-4o")
    health = httpx.get(f"{mesh.http_address}/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_streamed_chat_with_audio_equals_the_native_api(mesh: Mesh, oai: Any) -> None:
    prompt = "Tell me a story about a river"
    inputs = {"text": prompt, "max_new_tokens": 12, "seed": 3}
    text, audio = omni_demo_answer(mesh.address or "", inputs)
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        modalities=["text", "audio"],
        audio={"voice": "default", "format": "wav"},
        max_tokens=12,
        seed=3,
        stream=True,
    )
    pieces: list[str] = []
    wav_bytes = bytearray()
    audio_deltas = 0
    finish = None
    for chunk in stream:
        choice = chunk.choices[0]
        if choice.delta.content:
            pieces.append(choice.delta.content)
        extra = getattr(choice.delta, "audio", None) or (choice.delta.model_extra or {}).get(
            "audio"
        )
        if extra:
            data = extra["data"] if isinstance(extra, dict) else extra.data
            wav_bytes += base64.b64decode(data)
            audio_deltas += 1
        finish = choice.finish_reason or finish
    assert "".join(pieces) == text and len(pieces) > 1
    assert audio_deltas > 1, "audio should stream in several deltas"
    assert finish == "stop"
    rate, samples = _wav_samples(bytes(wav_bytes), streamed=True)
    assert rate == 16000
    np.testing.assert_array_equal(samples, _pcm16(audio))


def test_whole_chat_with_audio_and_text_only(mesh: Mesh, oai: Any) -> None:
    prompt = "Describe a mountain"
    text, audio = omni_demo_answer(mesh.address or "", {"text": prompt, "max_new_tokens": 6})
    reply = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [{"type": "text", "text": prompt}]}],
        modalities=["text", "audio"],
        audio={"voice": "default", "format": "wav"},
        max_completion_tokens=6,
    )
    message = reply.choices[0].message
    assert message.content == text and message.audio.transcript == text
    rate, samples = _wav_samples(base64.b64decode(message.audio.data), streamed=False)
    assert rate == 16000
    np.testing.assert_array_equal(samples, _pcm16(audio))
    # Text only: no talker runs, no audio comes back.
    only = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=6
    )
    assert only.choices[0].message.content == text and only.choices[0].message.audio is None


def test_speech_streams_audio(mesh: Mesh, oai: Any) -> None:
    _, audio = omni_demo_answer(mesh.address or "", {"text": "good morning", "speak": True})
    with oai.audio.speech.with_streaming_response.create(
        model=MODEL, voice="default", input="good morning", response_format="wav"
    ) as response:
        assert response.headers["content-type"] == "audio/wav"
        pieces = list(response.iter_bytes())
    rate, samples = _wav_samples(b"".join(pieces), streamed=True)
    assert rate == 16000
    np.testing.assert_array_equal(samples, _pcm16(audio))
    raw = oai.audio.speech.create(
        model=MODEL, voice="default", input="good morning", response_format="pcm"
    )
    np.testing.assert_array_equal(np.frombuffer(raw.read(), "<i2"), _pcm16(audio))


def test_bad_requests_get_openai_errors(mesh: Mesh, oai: Any) -> None:
    user = [{"role": "user", "content": "hi"}]
    cases: list[tuple[dict[str, Any], type, str]] = [
        ({"model": "gpt-4o", "messages": user}, openai.NotFoundError, "does not exist"),
        ({"model": MODEL, "messages": []}, openai.BadRequestError, "messages: required"),
        (
            {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
            openai.BadRequestError,
            "messages[0].role: unsupported role 'robot'",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "video"}]}]},
            openai.BadRequestError,
            "messages[0].content[0].type: unsupported content part 'video'",
        ),
        (
            {"model": MODEL, "messages": user, "modalities": ["text", "video"]},
            openai.BadRequestError,
            "unsupported modality 'video'",
        ),
        (
            {
                "model": MODEL,
                "messages": user,
                "modalities": ["audio"],
                "audio": {"voice": "alloy", "format": "wav"},
            },
            openai.BadRequestError,
            "audio.voice: unsupported voice 'alloy'; supported: ['default']",
        ),
        (
            {
                "model": MODEL,
                "messages": user,
                "modalities": ["audio"],
                "audio": {"voice": "default", "format": "mp3"},
            },
            openai.BadRequestError,
            "audio.format: unsupported audio format 'mp3'",
        ),
        ({"model": MODEL, "messages": user, "n": 2}, openai.BadRequestError, "n: only 1"),
        (
            {
                "model": MODEL,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
                        ],
                    }
                ],
            },
            openai.BadRequestError,
            "only data: URLs",
        ),
        # The pipeline's own check, through the gateway: 256 tokens at most.
        (
            {"model": MODEL, "messages": user, "max_tokens": 5000},
            openai.BadRequestError,
            "inputs.max_new_tokens",
        ),
    ]
    for body, error, message in cases:
        with pytest.raises(error) as info:
            oai.chat.completions.create(**body)
        assert message in str(info.value), (body, info.value)
        assert info.value.body["type"] in ("invalid_request_error", "not_found_error")
    # Refused by the pipeline before its first chunk: a streamed request gets the status too.
    with pytest.raises(openai.BadRequestError, match=r"inputs\.max_new_tokens"):
        oai.chat.completions.create(model=MODEL, messages=user, max_tokens=5000, stream=True)
    with pytest.raises(openai.BadRequestError, match=r"inputs\.text"):
        oai.audio.speech.create(model=MODEL, voice="default", input="x" * 4000 + "y" * 96)
    with pytest.raises(openai.BadRequestError, match="voice: unsupported voice 'nova'"):
        oai.audio.speech.create(model=MODEL, voice="nova", input="hi")
    with pytest.raises(openai.BadRequestError, match=r"speed: only 1\.0"):
        oai.audio.speech.create(model=MODEL, voice="default", input="hi", speed=2.0)
    # Not JSON at all, and JSON that is not an object.
    url = f"{mesh.http_address}/v1/chat/completions"
    for body in (b"{nope", b"[1, 2]"):
        reply = httpx.post(url, content=body, timeout=10)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["type"] == "invalid_request_error"
    # The mesh serves on.
    ok = oai.chat.completions.create(model=MODEL, messages=user, max_tokens=2)
    assert ok.choices[0].message.content


def _stage_outcomes(mesh: Mesh) -> dict[str, dict[str, float]]:
    with Client(mesh.address or "", timeout=30) as client:
        stages = client.describe().stages
    out: dict[str, dict[str, float]] = {}
    for stage in stages:
        samples = scrape(stage.replicas[0].metrics_address)
        out[stage.name] = {
            outcome: value(
                samples, "omnirail_stage_requests_total", stage=stage.name, outcome=outcome
            )
            for outcome in ("aborted", "completed")
        }
        out[stage.name]["inflight"] = value(samples, "omnirail_stage_inflight", stage=stage.name)
    return out


def test_client_disconnect_aborts_the_request_on_every_stage(mesh: Mesh) -> None:
    before = _stage_outcomes(mesh)
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "a long answer please"}],
            "modalities": ["text", "audio"],
            "audio": {"voice": "default", "format": "pcm16"},
            "max_tokens": 256,
            "stream": True,
        }
    ).encode()
    host, port = mesh.http_address.removeprefix("http://").rsplit(":", 1)  # type: ignore[union-attr]
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    got = b""
    while b'"audio"' not in got:  # the talker and code2wav are at work too by now
        piece = sock.recv(65536)
        assert piece, got[-400:]
        got += piece
    rid = next(
        line.split(b":", 1)[1].strip().decode()
        for line in got.split(b"\r\n")
        if line.lower().startswith(b"x-request-id:")
    )
    sock.close()  # the client goes away mid-stream
    with Client(mesh.address or "", timeout=30) as client:
        deadline = time.monotonic() + 30
        while (state := client.status(rid).state) == "running":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert state == "aborted"
    streaming = ("thinker", "decode", "talker", "code2wav")
    deadline = time.monotonic() + 30
    while True:
        after = _stage_outcomes(mesh)
        aborted = {s: after[s]["aborted"] - before[s]["aborted"] for s in streaming}
        if all(n == 1 for n in aborted.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert aborted == dict.fromkeys(streaming, 1), aborted
    assert all(after[s]["inflight"] == 0 for s in after), after
    for stage in streaming:
        assert after[stage]["completed"] == before[stage]["completed"], stage


def test_traceparent_is_honoured(mesh: Mesh, tmp_path: Path) -> None:
    """The caller's trace continues through the gateway into the mesh."""
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    reply = httpx.post(
        f"{mesh.http_address}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "trace me"}],
            "max_tokens": 2,
        },
        headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"},
        timeout=30,
    )
    assert reply.status_code == 200, reply.text
    rid = reply.headers["x-request-id"]
    deadline = time.monotonic() + 20
    while True:
        files = sorted(mesh.span_dir.glob("*.otlp"))
        spans = [s for s in read_span_files(files) if s["trace_id"] == trace_id]
        names = {s.get("name") for s in spans}
        if {"POST /v1/chat/completions", "omnirail.request"} <= names:
            break
        assert time.monotonic() < deadline, names
        time.sleep(0.3)
    request = next(s for s in spans if s.get("name") == "omnirail.request")
    assert request["attributes"]["omnirail.request_id"] == rid
    gateway = next(s for s in spans if s["name"] == "POST /v1/chat/completions")
    assert gateway["parent_span_id"] == "00f067aa0ba902b7"
    assert request["parent_span_id"] == gateway["span_id"]


def test_counted_by_the_gateway_and_the_coordinator(mesh: Mesh, oai: Any) -> None:
    with Client(mesh.address or "", timeout=30) as client:
        coordinator = client.describe().metrics_address
    gateway = f"{(mesh.http_address or '').removeprefix('http://')}"
    route = {"route": "/v1/chat/completions", "code": "200"}
    before = (
        value(scrape(gateway), "omnirail_gateway_requests_total", **route),
        value(scrape(coordinator), "omnirail_requests_total", state="completed"),
    )
    oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "count me"}], max_tokens=2
    )
    after = (
        value(scrape(gateway), "omnirail_gateway_requests_total", **route),
        value(scrape(coordinator), "omnirail_requests_total", state="completed"),
    )
    assert after == (before[0] + 1, before[1] + 1)
