"""The Realtime API's model on the mesh: each response of a session is one streaming mesh
request, a turn of the session's conversation.

What holds:
- A session is one conversation of the mesh: every response is a request with
  `conversation_id` = the session's, and its inputs carry the whole conversation (the
  pipeline's `messages_input`), never a delta, so a stage that keeps state between turns
  (the Qwen3-Omni thinker's KV cache, on the replica the turns are routed to) reuses what
  agrees with the history and rebuilds what does not (state lost, history edited).
- The conversation, in the session's order: the instructions as a system message, then
  each item as a message of its role: text parts as text; a user's audio as an audio part
  at the api's `input_sample_rate` (`model_pcm16`: exactly what a 16-bit WAV at that rate
  in a chat API `input_audio` part gives the model); an assistant's text, or its
  transcript as the session truncated it (barge-in, `conversation.item.truncate`). Parts
  with nothing for the model (blank text, audio let go by the session's audio bound) are
  left out, and so are messages left without parts.
- `speak_input` is whether audio is asked for (text only: no talker runs);
  `max_tokens_input` gets `max_output_tokens`; the voice sets its inputs as in the chat.
  What the pipeline cannot honour (an unknown voice, `speed` other than 1, a token limit
  it takes no input for) fails the response, naming it, rather than being ignored.
- The stream's chunks become deltas as they come: the text output's as text, the audio
  output's as float32 audio at their `sample_rate` (else the api's). An output with only
  a result field comes from the result, at the end.
- Cancelling the response (barge-in, `response.cancel`, the client gone) closes the SDK's
  stream, which aborts the request through the mesh; a mesh error fails the response
  with OpenAI's error type and the mesh's code (`ResponseFailed`).
- `aclose()` (the session ended) closes the conversation in the mesh: every stage drops
  what it kept of it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from omnirail.client.sdk import Chunk, GenerateResult
from omnirail.config.api import OpenAIConfig
from omnirail.gateway.answers import end_span
from omnirail.gateway.errors import from_mesh
from omnirail.gateway.mesh import Gateway
from omnirail.gateway.realtime.audio import model_pcm16, pcm16_to_float
from omnirail.gateway.realtime.items import Part
from omnirail.gateway.realtime.session import Delta, ResponseFailed, ResponseRequest
from omnirail.telemetry.tracer import KIND_SERVER
from omnirail.wire.errors import OmniError

log = logging.getLogger(__name__)


def conversation_messages(request: ResponseRequest, input_rate: int) -> list[dict[str, Any]]:
    """The conversation of `request` as `messages` (see the module), user audio at
    `input_rate`."""
    messages: list[dict[str, Any]] = []
    if request.instructions and request.instructions.strip():
        messages.append({"role": "system", "content": [_text(request.instructions)]})
    for item in request.items:
        parts = [p for p in (_part(part, input_rate) for part in item.content) if p is not None]
        if parts:
            messages.append({"role": item.role, "content": parts})
    return messages


def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _part(part: Part, input_rate: int) -> dict[str, Any] | None:
    if part.type == "input_audio":
        if not part.audio:
            return None  # let go by the session's audio bound
        audio = pcm16_to_float(model_pcm16(bytes(part.audio), input_rate))
        return {"type": "audio", "audio": audio, "sample_rate": input_rate}
    text = part.transcript if part.type == "output_audio" else part.text
    return _text(text) if text and text.strip() else None


def conversation_inputs(request: ResponseRequest, oa: OpenAIConfig) -> dict[str, Any]:
    """The mesh request's inputs for `request`; ResponseFailed names what the pipeline
    cannot honour."""
    assert oa.messages_input is not None  # api_problems: realtime needs it
    messages = conversation_messages(request, oa.input_sample_rate)
    if not messages:
        raise _invalid("the conversation holds nothing to answer: add a user turn first")
    inputs: dict[str, Any] = {oa.messages_input: messages}
    speak = "audio" in request.output_modalities
    if oa.speak_input is not None:
        inputs[oa.speak_input] = speak
    if request.max_output_tokens is not None:
        if oa.max_tokens_input is None:
            raise _invalid("max_output_tokens: this model takes no token limit; use 'inf'")
        inputs[oa.max_tokens_input] = request.max_output_tokens
    if request.speed != 1:
        raise _invalid(f"speed: only 1.0 is supported, got {request.speed:g}")
    voices = list(oa.voices)
    voice = request.voice if request.voice is not None else voices[0]
    if voice not in oa.voices:
        raise _invalid(f"voice: {str(voice)[:40]!r} is not one of this model's voices {voices}")
    if speak:
        inputs.update(oa.voices[voice])
    return inputs


def _invalid(message: str) -> ResponseFailed:
    return ResponseFailed(message, "invalid_value", "invalid_request_error")


class MeshResponder:
    """One session's model: `respond` runs each response as a mesh request (see the
    module); `aclose` closes the session's conversation in the mesh."""

    def __init__(self, gateway: Gateway, principal: str | None = None) -> None:
        self._gateway = gateway
        self._conversations: set[str] = set()
        # The caller's principal (the token middleware's): each response is attributed to it.
        self._principal = principal

    async def respond(self, request: ResponseRequest) -> AsyncIterator[Delta]:
        gateway = self._gateway
        assert gateway.client is not None  # started with the app
        inputs = conversation_inputs(request, gateway.oa)
        conversation = request.conversation_id or None
        if conversation is not None:
            self._conversations.add(conversation)
        rid = uuid.uuid4().hex
        span = gateway.tracer.start(
            "realtime response",
            None,
            {
                "omnirail.request_id": rid,
                "omnirail.conversation_id": request.conversation_id,
                "omnirail.front_door": "openai-realtime",
            },
            kind=KIND_SERVER,
        )
        events = gateway.client.stream(
            inputs,
            request_id=rid,
            traceparent=span.traceparent if span else None,
            conversation_id=conversation,
            on_behalf_of=gateway.on_behalf_of(self._principal),
        )
        error: BaseException | None = None
        try:
            async for event in events:
                for delta in self._deltas(event):
                    if delta.audio is not None:
                        gateway.metrics.audio_seconds(delta.audio.size / delta.sample_rate)
                    yield delta
        except OmniError as exc:
            error = exc
            api = from_mesh(exc)
            raise ResponseFailed(api.message, api.code or "response_failed", api.kind) from None
        except BaseException as exc:  # cancelled (barge-in, response.cancel, client gone)
            error = exc
            raise
        finally:
            await events.aclose()  # a request not read to its end is aborted in the mesh
            if span is not None and isinstance(error, asyncio.CancelledError | GeneratorExit):
                span.error("cancelled")  # barge-in, response.cancel or the client gone
                span.end()
            else:
                end_span(span, error)

    async def aclose(self) -> None:
        client = self._gateway.client
        if client is None:
            return
        for conversation in sorted(self._conversations):
            try:
                await client.close_conversation(conversation)
            except OmniError as exc:  # the mesh's state expires on its own anyway
                log.warning("realtime: closing conversation %s: %s", conversation, exc)
        self._conversations.clear()

    def _deltas(self, event: Chunk | GenerateResult) -> list[Delta]:
        gateway = self._gateway
        text_spec, audio_spec = gateway.text_spec, gateway.audio_spec
        out: list[Delta] = []
        if isinstance(event, Chunk):
            text = gateway.text_of_chunk(event)
            if text:
                out.append(Delta(text=text))
            if audio_spec is not None and audio_spec.chunks is not None:
                if event.stage == audio_spec.stage:
                    pcm = _floats(audio_spec.of_chunk(event.data))
                    out.append(Delta(audio=pcm, sample_rate=gateway.rate_of(event.data)))
            return out
        # The result: only outputs that have no chunks (theirs came as chunks already).
        if text_spec is not None and text_spec.chunks is None:
            text = gateway.text_of_result(event)
            if text:
                out.append(Delta(text=text))
        spec = audio_spec
        if spec is not None and spec.chunks is None and spec.stage in event.outputs:
            value = event.outputs[spec.stage]
            pcm = _floats(spec.of_result(value))
            out.append(Delta(audio=pcm, sample_rate=gateway.rate_of(value)))
        return out


def _floats(samples: Any) -> np.ndarray:
    """Model audio as float32 in [-1, 1]: integer PCM (INT16 outputs) is scaled."""
    array = np.asarray(samples).reshape(-1)
    if array.dtype.kind in "iu":
        return (array.astype(np.float32) / np.float32(32768.0)).astype(np.float32)
    return array.astype(np.float32, copy=False)


def responder_factory(gateway: Gateway) -> Any:
    """The endpoint's `responder_factory`: a `MeshResponder` per session."""
    return lambda caller: MeshResponder(
        gateway, caller.principal if isinstance(caller.principal, str) else None
    )
