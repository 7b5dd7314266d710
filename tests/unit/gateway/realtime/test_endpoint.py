"""The `/v1/realtime` endpoint under a real uvicorn server on 127.0.0.1, driven by the
official openai SDK's realtime client: a spoken turn detected by Silero (server VAD), an
answer in audio and transcript, and every server event parsed with the SDK's types. Also:
tokens, the session cap, a wrong model, and a client that leaves mid-answer."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import importlib.util
import json
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest
import uvicorn
from openai import AsyncOpenAI
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute

from omnirail.gateway.audio import pcm16
from omnirail.gateway.realtime.audio import float_to_pcm16, resample
from omnirail.gateway.realtime.endpoint import Caller, realtime_endpoint
from omnirail.gateway.realtime.session import Delta
from omnirail.testing.speech import silence, speech
from tests.unit.gateway.realtime.fakes import WAIT, FakeResponder, scripted, tone
from tests.unit.gateway.realtime.sdk_types import parse_server_event

MODEL = "omni-test"
HAS_VAD = importlib.util.find_spec("silero_vad") is not None
# uvicorn serves WebSockets, and the SDK connects, only with `websockets` (realtime extra).
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("websockets") is None, reason="needs the realtime extra (websockets)"
)


@contextlib.asynccontextmanager
async def _server(**options: Any) -> AsyncIterator[tuple[int, list[Caller], list[FakeResponder]]]:
    """The endpoint on an ephemeral port; yields (port, callers seen, responders made)."""
    callers: list[Caller] = []
    responders: list[FakeResponder] = []
    make: Callable[[], FakeResponder] = options.pop("make", FakeResponder)

    def factory(caller: Caller) -> FakeResponder:
        callers.append(caller)
        responders.append(make())
        return responders[-1]

    endpoint = realtime_endpoint(factory, model=MODEL, **options)
    app = Starlette(routes=[WebSocketRoute("/v1/realtime", endpoint)])
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            assert not task.done(), "uvicorn did not start"
            await asyncio.sleep(0.01)
        yield sock.getsockname()[1], callers, responders
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, WAIT)
        sock.close()


def _client(port: int, key: str = "sk-test") -> AsyncOpenAI:
    return AsyncOpenAI(
        api_key=key,
        base_url=f"http://127.0.0.1:{port}/v1",
        websocket_base_url=f"ws://127.0.0.1:{port}/v1",
    )


async def _next(connection: Any) -> tuple[dict[str, Any], Any]:
    """The next server event as JSON, checked strictly against the SDK's type, and as the
    SDK's own client parses it."""
    raw = await asyncio.wait_for(connection.recv_bytes(), WAIT)
    event = json.loads(raw)
    strict = parse_server_event(event)
    sdk = connection.parse_event(raw)
    assert type(sdk) is type(strict) and sdk.type == event["type"]
    return event, sdk


async def _until(connection: Any, kind: str) -> list[dict[str, Any]]:
    events = []
    while True:
        event, _ = await _next(connection)
        events.append(event)
        if event["type"] == kind:
            return events


def _answer() -> list[Delta]:
    # The model speaks at 16 kHz: the client must get 24 kHz.
    return [
        Delta("Hello ", tone(0.2, 16000), sample_rate=16000),
        Delta("there.", tone(0.3, 16000, 300), sample_rate=16000),
    ]


@pytest.mark.skipif(not HAS_VAD, reason="needs the realtime extra (silero-vad)")
async def test_a_spoken_turn_through_the_official_sdk() -> None:
    def responder() -> FakeResponder:
        return FakeResponder(_answer())

    async with _server(make=responder) as (port, callers, responders):
        client = _client(port)
        async with client.realtime.connect(model=MODEL) as connection:
            created, sdk_created = await _next(connection)
            assert created["type"] == "session.created"
            assert sdk_created.session.audio.input.turn_detection.type == "server_vad"
            await connection.session.update(
                session={"type": "realtime", "instructions": "be brief",
                         "audio": {"input": {"turn_detection": {"type": "server_vad",
                                                                "silence_duration_ms": 400}}}}
            )  # fmt: skip
            updated, _ = await _next(connection)
            assert updated["session"]["instructions"] == "be brief"

            # 0.5 s of silence, 1.5 s of speech, 1 s of silence, in 40 ms appends.
            audio = np.concatenate([silence(0.5), speech(1.5, seed=1), silence(1.0)])
            wire = float_to_pcm16(audio)
            for at in range(0, len(wire), 40 * 48):
                chunk = base64.b64encode(wire[at : at + 40 * 48]).decode()
                await connection.input_audio_buffer.append(audio=chunk)
            events = await _until(connection, "response.done")

    kinds = [e["type"] for e in events]
    started = events[kinds.index("input_audio_buffer.speech_started")]
    stopped = events[kinds.index("input_audio_buffer.speech_stopped")]
    committed = events[kinds.index("input_audio_buffer.committed")]
    assert kinds.count("input_audio_buffer.speech_started") == 1
    # Speech begins at 500 ms; Silero scores 32 ms windows: within a window of it.
    assert 500 - 32 - 300 <= started["audio_start_ms"] <= 500 + 32 - 300
    # Speech ends at 2000 ms; Silero's score falls under the threshold's hysteresis a few
    # windows later; the stop comes silence_duration_ms (400) after that.
    assert 2000 + 400 - 32 <= stopped["audio_end_ms"] <= 2000 + 400 + 4 * 32
    assert started["item_id"] == stopped["item_id"] == committed["item_id"]
    assert kinds.index("input_audio_buffer.committed") < kinds.index("response.created")

    transcript = [
        e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta"
    ]
    assert "".join(transcript) == "Hello there."
    done = next(e for e in events if e["type"] == "response.output_audio_transcript.done")
    assert done["transcript"] == "Hello there."
    received = b"".join(
        base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta"
    )
    spoken = np.concatenate([d.audio for d in _answer() if d.audio is not None])
    assert received == pcm16(resample(spoken, 16000, 24000))
    response = events[-1]["response"]
    assert response["status"] == "completed"
    assert response["output"][0]["content"][0]["transcript"] == "Hello there."

    (request,) = responders[0].requests
    assert request.instructions == "be brief"
    user_audio = request.items[0].content[0].audio
    heard_ms = len(user_audio) // 48
    assert heard_ms == stopped["audio_end_ms"] - started["audio_start_ms"]
    assert callers == [Caller(principal=None, model=MODEL)]


async def test_manual_turns_and_errors_keep_the_socket_open() -> None:
    async with _server(make=lambda: FakeResponder(_answer())) as (port, _, responders):
        async with _client(port).realtime.connect(model=MODEL) as connection:
            await _next(connection)
            await connection.session.update(
                session={"type": "realtime", "audio": {"input": {"turn_detection": None}}}
            )
            await _next(connection)
            await connection.input_audio_buffer.append(audio="@@@")
            await connection.send_raw("not json")  # type: ignore[attr-defined]
            await connection.input_audio_buffer.commit(event_id="commit-1")
            errors = [(await _next(connection))[0]["error"] for _ in range(3)]
            assert [e["code"] for e in errors] == [
                "invalid_base64", "invalid_json", "input_audio_buffer_commit_empty",
            ]  # fmt: skip
            assert errors[2]["event_id"] == "commit-1"
            await connection.input_audio_buffer.append(
                audio=base64.b64encode(float_to_pcm16(tone(0.3))).decode()
            )
            await connection.input_audio_buffer.commit()
            await connection.response.create()
            events = await _until(connection, "response.done")
            assert events[-1]["response"]["status"] == "completed"
    assert len(responders[0].requests) == 1


async def test_a_client_that_leaves_cancels_its_response() -> None:
    def slow() -> FakeResponder:
        return FakeResponder([Delta("one "), Delta("two")], gated=True)

    async with _server(make=slow, vad_factory=scripted()) as (port, _, responders):
        async with _client(port).realtime.connect(model=MODEL) as connection:
            await _next(connection)
            await connection.response.create()
            responders[0].release()
            await _until(connection, "response.output_audio_transcript.delta")
        await asyncio.wait_for(responders[0].ended.wait(), WAIT)
        assert responders[0].cancelled == 1  # the mesh request would be aborted here


async def test_sessions_over_the_cap_are_told_and_closed() -> None:
    async with _server(max_sessions=1, vad_factory=scripted()) as (port, _, _responders):
        client = _client(port)
        async with client.realtime.connect(model=MODEL) as first:
            await _next(first)
            async with client.realtime.connect(model=MODEL) as second:
                refused, _ = await _next(second)
                assert refused["error"]["code"] == "session_limit_reached"
                with pytest.raises(Exception, match="1013"):
                    await asyncio.wait_for(second.recv_bytes(), WAIT)
        # The first left: there is room again.
        async with client.realtime.connect(model=MODEL) as third:
            created, _ = await _next(third)
            assert created["type"] == "session.created"


async def test_a_wrong_model_is_told_and_closed() -> None:
    async with _server(vad_factory=scripted()) as (port, _, responders):
        async with _client(port).realtime.connect(model="gpt-realtime") as connection:
            refused, _ = await _next(connection)
            assert refused["error"]["code"] == "model_not_found"
            with pytest.raises(Exception, match="1008"):
                await asyncio.wait_for(connection.recv_bytes(), WAIT)
        assert responders == []


async def test_tokens() -> None:
    def authenticate(token: str | None) -> str | None:
        return {"good-key": "alice"}.get(token or "")

    async with _server(authenticate=authenticate, vad_factory=scripted()) as (port, callers, _):
        with pytest.raises(Exception, match="401"):
            async with _client(port, key="bad-key").realtime.connect(model=MODEL):
                pass
        async with _client(port, key="good-key").realtime.connect(model=MODEL) as connection:
            created, _ = await _next(connection)
            assert created["type"] == "session.created"
        # Browsers send the key as a subprotocol.
        from websockets.asyncio.client import connect

        url = f"ws://127.0.0.1:{port}/v1/realtime?model={MODEL}"
        protocols = ["realtime", "openai-insecure-api-key.good-key"]
        async with connect(url, subprotocols=protocols) as ws:  # type: ignore[arg-type]
            assert ws.subprotocol == "realtime"
            assert json.loads(await ws.recv())["type"] == "session.created"
    assert [c.principal for c in callers] == ["alice", "alice"]
