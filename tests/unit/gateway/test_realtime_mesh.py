"""The Realtime API's mesh side (`realtime_mesh`): a response's conversation as the
pipeline's `messages`, user audio exactly as a chat client's WAV gives it, the stream's
chunks as deltas, mesh errors as `ResponseFailed`, cancellation closing the SDK stream,
and the conversation closed with the session. The mesh client is a fake here (the
integration test runs the real one)."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from omnirail.client.sdk import Chunk, GenerateResult
from omnirail.config import load_pipeline
from omnirail.gateway.audio import wav
from omnirail.gateway.mesh import Gateway
from omnirail.gateway.realtime.audio import float_to_pcm16, model_pcm16, pcm16_to_float, resample
from omnirail.gateway.realtime.items import Item, Part
from omnirail.gateway.realtime.session import ResponseFailed, ResponseRequest
from omnirail.gateway.realtime_mesh import (
    MeshResponder,
    conversation_inputs,
    conversation_messages,
)
from omnirail.gateway.requests import RequestMapper
from omnirail.wire.errors import Code, OmniError

ROOT = Path(__file__).resolve().parents[3]
QWEN = load_pipeline(ROOT / "omnirail/models/qwen3_omni/pipeline.yaml", resolve=False)


def _request(*items: Item, **settings: Any) -> ResponseRequest:
    base: dict[str, Any] = {
        "response_id": "resp_1",
        "items": items,
        "instructions": None,
        "output_modalities": ("audio",),
        "voice": None,
        "speed": 1.0,
        "max_output_tokens": None,
        "conversation_id": "conv_1",
    }
    return ResponseRequest(**{**base, **settings})


def _speech_pcm(ms: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    return float_to_pcm16(0.3 * rng.standard_normal(ms * 24).clip(-3, 3) / 3)


def _user(item_id: str, pcm: bytes) -> Item:
    return Item(item_id, "user", [Part("input_audio", audio=pcm)])


def _assistant(item_id: str, transcript: str) -> Item:
    return Item(item_id, "assistant", [Part("output_audio", transcript=transcript, audio=b"")])


# -- the conversation as messages ---------------------------------------------------------------


def test_model_pcm16_is_resampled_and_quantized() -> None:
    pcm = _speech_pcm(250)
    got = model_pcm16(pcm, 16000)
    assert len(got) == 2 * (250 * 16)
    assert got == float_to_pcm16(resample(pcm16_to_float(pcm), 24000, 16000))


def test_user_audio_reaches_the_model_as_a_chat_wav_would() -> None:
    """The exactness rule: the floats the mesh gets for a realtime user turn are those the
    chat API reads from a 16-bit WAV of `model_pcm16`'s samples."""
    pcm = _speech_pcm(333, seed=3)
    (message,) = conversation_messages(_request(_user("item_a", pcm)), 16000)
    (part,) = message["content"]
    assert message["role"] == "user" and part["sample_rate"] == 16000
    data = base64.b64encode(wav(model_pcm16(pcm, 16000), 16000)).decode()
    chat = RequestMapper(QWEN.api, "qwen3-omni").chat(
        {
            "model": "qwen3-omni",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}
                    ],
                }
            ],
        }
    )
    (chat_part,) = chat.inputs["messages"][0]["content"]
    assert chat_part["audio"].dtype == part["audio"].dtype == np.float32
    np.testing.assert_array_equal(chat_part["audio"], part["audio"])
    assert chat_part["sample_rate"] == part["sample_rate"]


def test_the_whole_conversation_in_order_with_truncated_answers() -> None:
    items = (
        Item("item_s", "system", [Part("input_text", text="be brief")]),
        _user("item_u1", _speech_pcm(100)),
        _assistant("item_a1", "cut here"),
        Item("item_u2", "user", [Part("input_text", text="and then?")]),
        _assistant("item_a2", "   "),  # cut to nothing: left out
        Item("item_u3", "user", [Part("input_audio", audio=b"")]),  # audio let go: left out
        Item("item_a3", "assistant", [Part("output_text", text="typed")]),
    )
    messages = conversation_messages(_request(*items, instructions="speak English"), 16000)
    assert [m["role"] for m in messages] == ["system", "system", "user", "assistant", "user",
                                             "assistant"]  # fmt: skip
    assert messages[0]["content"] == [{"type": "text", "text": "speak English"}]
    assert messages[1]["content"] == [{"type": "text", "text": "be brief"}]
    assert messages[2]["content"][0]["type"] == "audio"
    assert messages[3]["content"] == [{"type": "text", "text": "cut here"}]
    assert messages[4]["content"] == [{"type": "text", "text": "and then?"}]
    assert messages[5]["content"] == [{"type": "text", "text": "typed"}]


def test_inputs_carry_speak_tokens_and_voice() -> None:
    oa = QWEN.api.openai
    assert oa is not None
    request = _request(Item("u", "user", [Part("input_text", text="hi")]))
    inputs = conversation_inputs(request, oa)
    assert inputs["speak"] is True and "max_new_tokens" not in inputs
    text_only = _request(*request.items, output_modalities=("text",), max_output_tokens=7)
    inputs = conversation_inputs(text_only, oa)
    assert inputs["speak"] is False and inputs["max_new_tokens"] == 7


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"voice": "alloy"}, "voice: 'alloy' is not one of this model's voices ['ethan']"),
        ({"speed": 1.5}, "speed: only 1.0 is supported, got 1.5"),
        ({"items": ()}, "the conversation holds nothing to answer"),
    ],
)
def test_what_the_pipeline_cannot_honour_fails_by_name(
    settings: dict[str, Any], message: str
) -> None:
    oa = QWEN.api.openai
    assert oa is not None
    request = _request(Item("u", "user", [Part("input_text", text="hi")]), **settings)
    with pytest.raises(ResponseFailed) as info:
        conversation_inputs(request, oa)
    assert info.value.message.startswith(message)
    assert (info.value.type, info.value.code) == ("invalid_request_error", "invalid_value")


# -- the responder over a fake mesh client ---------------------------------------------------


class FakeClient:
    """`AsyncClient.stream` and `close_conversation` as the responder uses them."""

    def __init__(self, events: list[Chunk | GenerateResult | Exception], gate: bool = False):
        self.events = events
        self.gate: asyncio.Event | None = asyncio.Event() if gate else None
        self.calls: list[dict[str, Any]] = []
        self.closed_streams = 0
        self.closed_conversations: list[str] = []

    def stream(self, inputs: dict[str, Any], **options: Any) -> AsyncIterator[Any]:
        self.calls.append({"inputs": inputs, **options})
        return self._events()

    async def _events(self) -> AsyncIterator[Any]:
        try:
            for event in self.events:
                if self.gate is not None:
                    await self.gate.wait()
                if isinstance(event, Exception):
                    raise event
                yield event
        finally:
            self.closed_streams += 1  # the SDK aborts a request not read to its end here

    async def close_conversation(self, conversation_id: str) -> None:
        self.closed_conversations.append(conversation_id)

    async def close(self) -> None:
        pass


@pytest.fixture
def gateway() -> Iterator[Gateway]:
    made = Gateway(QWEN, lambda: FakeClient([]))
    yield made
    assert made.vad_executor is not None
    made.vad_executor.shutdown()


def _chunk(stage: str, data: Any, index: int = 0) -> Chunk:
    return Chunk("rid", stage, index, "audio" if stage == "code2wav" else "text", data)


async def _collect(responder: MeshResponder, request: ResponseRequest) -> list[Any]:
    return [delta async for delta in responder.respond(request)]


async def test_chunks_become_deltas(gateway: Gateway) -> None:
    pcm = np.linspace(-1, 1, 480, dtype=np.float32)
    client = FakeClient(
        [
            _chunk("decode", "Hel"),
            _chunk("code2wav", {"pcm": pcm}),
            _chunk("decode", "lo", 1),
            _chunk("code2wav", {"pcm": pcm[:10], "sample_rate": 16000}, 1),
            GenerateResult("rid", {"decode": {"text": "Hello", "token_ids": [1]}}),
        ]
    )
    gateway.client = client  # type: ignore[assignment]
    responder = MeshResponder(gateway)
    request = _request(Item("u", "user", [Part("input_text", text="hi")]))
    deltas = await _collect(responder, request)
    # The result's text came as chunks already: not again.
    assert [d.text for d in deltas] == ["Hel", "", "lo", ""]
    np.testing.assert_array_equal(deltas[1].audio, pcm)
    assert deltas[1].sample_rate == 24000 and deltas[3].sample_rate == 16000
    (call,) = client.calls
    assert call["conversation_id"] == "conv_1" and call["inputs"]["speak"] is True
    assert client.closed_streams == 1
    await responder.aclose()
    assert client.closed_conversations == ["conv_1"]


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (Code.INVALID_ARGUMENT, "invalid_request_error"),
        (Code.RESOURCE_EXHAUSTED, "rate_limit_error"),
        (Code.UNAVAILABLE, "server_error"),
    ],
)
async def test_mesh_errors_fail_the_response(gateway: Gateway, code: int, kind: str) -> None:
    error = OmniError(code, "inputs.messages[0]: bad", stage="preprocessing")
    client = FakeClient([_chunk("decode", "a"), error])
    gateway.client = client  # type: ignore[assignment]
    responder = MeshResponder(gateway)
    with pytest.raises(ResponseFailed) as info:
        await _collect(responder, _request(Item("u", "user", [Part("input_text", text="x")])))
    assert info.value.type == kind and info.value.code == Code.Name(code).lower()
    assert info.value.message == "inputs.messages[0]: bad (stage preprocessing)"
    assert client.closed_streams == 1


async def test_cancelling_a_response_closes_the_stream(gateway: Gateway) -> None:
    client = FakeClient([_chunk("decode", "a"), _chunk("decode", "b", 1)], gate=True)
    gateway.client = client  # type: ignore[assignment]
    responder = MeshResponder(gateway)
    task = asyncio.create_task(
        _collect(responder, _request(Item("u", "user", [Part("input_text", text="x")])))
    )
    await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.wait({task})
    assert task.cancelled() and client.closed_streams == 1
