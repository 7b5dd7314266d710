"""The gateway's answers: mesh events to OpenAI chat completions (whole, or chunks over
SSE) and to speech audio. Each closes its event source when done, which aborts the mesh
request when a client left early."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from omnirail.client.sdk import GenerateResult
from omnirail.gateway.audio import wav, wav_header
from omnirail.gateway.errors import ApiError, from_mesh
from omnirail.gateway.mesh import Event, Gateway
from omnirail.gateway.requests import Plan
from omnirail.telemetry.tracer import Span
from omnirail.wire.errors import OmniError

AUDIO_TTL_S = 3600


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def first_event(events: AsyncIterator[Event]) -> Event | None:
    """The stream's first event (mesh errors raised as ApiError); None if it is empty."""
    try:
        return await anext(events)
    except StopAsyncIteration:
        return None
    except OmniError as exc:
        raise from_mesh(exc) from None


async def _rest(first: Event | None, events: AsyncGenerator[Event]) -> AsyncGenerator[Event]:
    """The stream again from its first event; closing it closes (and so aborts) `events`."""
    try:
        if first is not None:
            yield first
        async for event in events:
            yield event
    finally:
        await events.aclose()


def end_span(span: Span | None, error: BaseException | None) -> None:
    if span is None:
        return
    if isinstance(error, asyncio.CancelledError):
        span.error("client disconnected")
    elif isinstance(error, ApiError):
        span.error(f"{error.status}: {error.message}")
    elif error is not None:
        span.error(f"{type(error).__name__}: {error}")
    span.end()


async def chat_whole(
    gateway: Gateway, plan: Plan, rid: str, events: AsyncIterator[Event]
) -> dict[str, Any]:
    pieces: list[str] = []
    audio: list[bytes] = []
    rate = gateway.oa.sample_rate
    text: str | None = None
    try:
        async for event in events:
            if isinstance(event, GenerateResult):
                text = gateway.text_of_result(event)
                whole = gateway.audio_of_result(event) if plan.want_audio else None
                if whole is not None:
                    audio, rate = [whole[0]], whole[1]
                continue
            piece = gateway.text_of_chunk(event)
            if piece:
                pieces.append(piece)
            sound = gateway.audio_of_chunk(event) if plan.want_audio else None
            if sound is not None:
                audio.append(sound[0])
                rate = sound[1]
    except OmniError as exc:
        raise from_mesh(exc) from None
    if text is None:
        text = "".join(pieces)
    created = int(time.time())
    message: dict[str, Any] = {"role": "assistant", "content": text}
    pcm = b"".join(audio)
    if plan.want_audio:
        data = wav(pcm, rate) if plan.audio_format == "wav" else pcm
        message["audio"] = {
            "id": f"audio_{rid}",
            "data": base64.b64encode(data).decode(),
            "expires_at": created + AUDIO_TTL_S,
            "transcript": text,
        }
    gateway.metrics.audio_seconds(len(pcm) / 2 / rate)
    return {
        "id": f"chatcmpl-{rid}",
        "object": "chat.completion",
        "created": created,
        "model": gateway.model,
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
    }


async def _opened(source: AsyncGenerator[Event], span: Span | None) -> AsyncGenerator[Event]:
    """`source` from its first event, awaited now (ApiError when the mesh refused the
    request, which then ends the span and closes the source)."""
    try:
        first = await first_event(source)
    except BaseException as exc:
        end_span(span, exc)
        await source.aclose()
        raise
    return _rest(first, source)


async def chat_stream(
    gateway: Gateway, plan: Plan, rid: str, source: AsyncGenerator[Event], span: Span | None
) -> AsyncGenerator[bytes]:
    events = await _opened(source, span)
    created = int(time.time())
    base = {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": created,
            "model": gateway.model}  # fmt: skip

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return _sse({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

    error: BaseException | None = None
    sound_out = _AudioOut(plan.audio_format, gateway.oa.sample_rate)

    def audio_delta(pcm: bytes, sample_rate: int) -> bytes:
        data = base64.b64encode(sound_out.encode(pcm, sample_rate)).decode()
        audio = {"id": f"audio_{rid}", "data": data, "expires_at": created + AUDIO_TTL_S}
        return chunk({"audio": audio})

    streamed_text = False
    # The role preamble goes out in one write with the first event's deltas.
    out = chunk({"role": "assistant", "content": ""})
    try:
        async for event in events:
            if isinstance(event, GenerateResult):
                text = gateway.text_of_result(event)
                if text and not streamed_text:
                    out += chunk({"content": text})
                whole = gateway.audio_of_result(event) if plan.want_audio else None
                if whole is not None and not sound_out.started:
                    out += audio_delta(*whole)
            else:
                piece = gateway.text_of_chunk(event)
                if piece:
                    streamed_text = True
                    out += chunk({"content": piece})
                sound = gateway.audio_of_chunk(event) if plan.want_audio else None
                if sound is not None:
                    out += audio_delta(*sound)
            if out:
                yield out
                out = b""
        yield out + chunk({}, "stop") + b"data: [DONE]\n\n"
    except OmniError as exc:
        error = exc
        yield _sse(from_mesh(exc).body())
    except BaseException as exc:  # the client went away (cancelled), or a bug
        error = exc
        raise
    finally:
        await events.aclose()  # a client that left: aborts the request through the mesh
        gateway.metrics.audio_seconds(sound_out.seconds)
        end_span(span, error)


async def speech_stream(
    gateway: Gateway, plan: Plan, source: AsyncGenerator[Event], span: Span | None
) -> AsyncGenerator[bytes]:
    events = await _opened(source, span)
    error: BaseException | None = None
    sound_out = _AudioOut(plan.audio_format, gateway.oa.sample_rate)

    def out(pcm: bytes, sample_rate: int) -> bytes:
        pcm = sound_out.encode(pcm, sample_rate)
        if plan.sse:
            return _sse({"type": "speech.audio.delta", "audio": base64.b64encode(pcm).decode()})
        return pcm

    try:
        async for event in events:
            sound = (
                gateway.audio_of_result(event)
                if isinstance(event, GenerateResult)
                else gateway.audio_of_chunk(event)
            )
            if sound is not None and not (isinstance(event, GenerateResult) and sound_out.started):
                yield out(*sound)
        if not sound_out.started and plan.audio_format == "wav":
            yield out(b"", sound_out.rate)  # no audio at all: still a valid (empty) WAV
        if plan.sse:
            yield _sse({"type": "speech.audio.done"})
    except OmniError as exc:
        # Headers are gone: an SSE stream says why; a raw audio stream can only stop short.
        error = exc
        if plan.sse:
            yield _sse(from_mesh(exc).body())
    except BaseException as exc:
        error = exc
        raise
    finally:
        await events.aclose()  # a client that left: aborts the request through the mesh
        gateway.metrics.audio_seconds(sound_out.seconds)
        end_span(span, error)


class _AudioOut:
    """Streamed PCM as it goes out: a WAV header (its sizes "unknown") before the first
    bytes when the format is wav, and what was sent, in samples and at which rate."""

    def __init__(self, audio_format: str, rate: int) -> None:
        self.wav = audio_format == "wav"
        self.rate = rate
        self.samples = 0
        self.started = False

    def encode(self, pcm: bytes, rate: int) -> bytes:
        self.samples += len(pcm) // 2
        self.rate = rate
        if self.wav and not self.started:
            pcm = wav_header(rate) + pcm
        self.started = True
        return pcm

    @property
    def seconds(self) -> float:
        return self.samples / self.rate if self.samples else 0.0
