"""OpenAI request bodies -> a pipeline's inputs, as its `api.openai` section declares.

Every field a request may carry is checked here and a bad one is refused naming it
(`messages[1].content[0].image_url.url`), in OpenAI's error shape. Options the pipeline
cannot honour are refused, not ignored: `n` > 1, tools, logprobs, an unknown voice or
audio format, a modality it does not make. Sampling hints it does not declare
(`temperature`, `top_p`, ...) are accepted and have no effect, as on most servers.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import wave
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omnirail.config.api import ApiConfig, OpenAIConfig
from omnirail.gateway.audio import FORMATS
from omnirail.gateway.errors import ApiError, bad

MAX_MESSAGES = 1024
MAX_TEXT = 1 << 20  # characters in one request's text
MAX_SPEECH_INPUT = 4096  # OpenAI's limit for /v1/audio/speech
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_MAX_ECHO = 40


def _echo(value: Any) -> str:
    text = value if isinstance(value, str) else type(value).__name__
    return repr(text[:_MAX_ECHO] + ("..." if len(text) > _MAX_ECHO else ""))


@dataclass
class Plan:
    """What one HTTP request asks of the mesh."""

    inputs: dict[str, Any]
    stream: bool = False
    want_audio: bool = False
    audio_format: str = "wav"
    voice: str = ""
    include_usage: bool = False
    sse: bool = False  # /v1/audio/speech with stream_format "sse"
    images: list[Any] = field(default_factory=list)


class RequestMapper:
    def __init__(self, api: ApiConfig, model: str) -> None:
        if api.openai is None:
            raise ValueError("the pipeline has no api.openai section")
        self.api = api
        self.oa: OpenAIConfig = api.openai
        self.model = model

    # ---- shared checks ---------------------------------------------------------------

    def _object(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise bad(f"the request body must be a JSON object, not {type(body).__name__}")
        return body

    def _model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise bad("model: required, a string", "model")
        if model != self.model:
            raise ApiError(
                404,
                f"The model {_echo(model)} does not exist; this server serves {self.model!r}",
                "model",
                "model_not_found",
            )

    def _voice(self, voice: Any, param: str) -> str:
        voices = list(self.oa.voices)
        if voice is None:
            return voices[0]
        if not isinstance(voice, str) or voice not in self.oa.voices:
            raise bad(f"{param}: unsupported voice {_echo(voice)}; supported: {voices}", param)
        return voice

    def _format(self, value: Any, param: str, default: str) -> str:
        fmt = default if value is None else value
        if fmt == "pcm":
            fmt = "pcm16"
        if not isinstance(fmt, str) or fmt not in FORMATS or fmt == "pcm":
            raise bad(
                f"{param}: unsupported audio format {_echo(fmt)}; supported: wav, pcm16 "
                "(16-bit little-endian mono PCM)",
                param,
            )
        return fmt

    def _set(self, inputs: dict[str, Any], name: str | None, value: Any, param: str) -> None:
        if name is None:
            raise bad(f"{param}: this model does not take it", param)
        inputs[name] = value

    def _voice_inputs(self, inputs: dict[str, Any], voice: str) -> None:
        inputs.update(self.oa.voices[voice])

    # ---- /v1/chat/completions --------------------------------------------------------

    def chat(self, body: Any) -> Plan:
        body = self._object(body)
        self._model(body)
        oa = self.oa
        if body.get("n") not in (None, 1):
            raise bad("n: only 1 is supported", "n")
        for name in ("tools", "functions", "logprobs"):
            if body.get(name):
                raise bad(f"{name}: not supported by this server", name)
        stream = body.get("stream", False)
        if not isinstance(stream, bool) and stream is not None:
            raise bad("stream: a boolean", "stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise bad("stream_options: an object", "stream_options")
        modalities = body.get("modalities") or ["text"]
        if not isinstance(modalities, list) or not all(isinstance(m, str) for m in modalities):
            raise bad("modalities: a list of strings", "modalities")
        makes = (["text"] if oa.text_output else []) + (["audio"] if oa.audio_output else [])
        for m in modalities:
            if m not in makes:
                raise bad(
                    f"modalities: unsupported modality {_echo(m)}; this model makes {makes}",
                    "modalities",
                )
        want_audio = "audio" in modalities
        plan = Plan(inputs={}, stream=bool(stream), want_audio=want_audio)
        plan.include_usage = bool(options.get("include_usage"))
        audio = body.get("audio")
        if want_audio:
            if not isinstance(audio, dict):
                raise bad('audio: required with modalities ["audio"]: {"voice", "format"}', "audio")
            plan.voice = self._voice(audio.get("voice"), "audio.voice")
            plan.audio_format = self._format(audio.get("format"), "audio.format", "wav")
            self._voice_inputs(plan.inputs, plan.voice)
        elif audio is not None:
            raise bad('audio: only with modalities including "audio"', "audio")
        if oa.speak_input is not None:
            plan.inputs[oa.speak_input] = want_audio
        self._messages(body.get("messages"), plan.inputs)
        self._sampling(body, plan.inputs)
        return plan

    def _sampling(self, body: dict[str, Any], inputs: dict[str, Any]) -> None:
        oa = self.oa
        # max_tokens is the older name of max_completion_tokens (an explicit null is unset).
        newer = body.get("max_completion_tokens")
        limit = newer if newer is not None else body.get("max_tokens")
        param = "max_completion_tokens" if newer is not None else "max_tokens"
        if limit is not None:
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
                raise bad(f"{param}: a positive integer", param)
            self._set(inputs, oa.max_tokens_input, limit, param)
        seed = body.get("seed")
        if seed is not None:
            if isinstance(seed, bool) or not isinstance(seed, int):
                raise bad("seed: an integer", "seed")
            if oa.seed_input is not None:
                inputs[oa.seed_input] = seed
        temperature = body.get("temperature")
        if temperature is not None:
            if (
                isinstance(temperature, bool)
                or not isinstance(temperature, int | float)
                # A JSON integer can be any size: compared as it is, not made a float.
                or not (0 <= temperature <= 2)
                or (isinstance(temperature, float) and not math.isfinite(temperature))
            ):
                raise bad("temperature: a number within 0..2", "temperature")
            if oa.temperature_input is not None:
                inputs[oa.temperature_input] = float(temperature)

    def _messages(self, messages: Any, inputs: dict[str, Any]) -> None:
        if not isinstance(messages, list) or not messages:
            raise bad("messages: required, a non-empty list", "messages")
        if len(messages) > MAX_MESSAGES:
            raise bad(f"messages: at most {MAX_MESSAGES}", "messages")
        turns = [self._message(i, m) for i, m in enumerate(messages)]
        oa = self.oa
        if oa.messages_input is not None:
            inputs[oa.messages_input] = turns
            return
        texts = [p["text"] for t in turns for p in t["content"] if p["type"] == "text"]
        text = "\n".join(t for t in texts if t)
        if not text.strip():
            raise bad("messages: no text in any message", "messages")
        if len(text) > MAX_TEXT:
            raise bad(f"messages: {len(text)} characters of text; at most {MAX_TEXT}", "messages")
        inputs[oa.text_input or ""] = text
        for kind, name in (("image", oa.image_input), ("audio", oa.audio_input)):
            found = [p for t in turns for p in t["content"] if p["type"] == kind]
            if not found:
                continue
            if name is None:
                raise bad(f"messages: this model takes no {kind} input", "messages")
            if len(found) > 1:
                raise bad(f"messages: this model takes one {kind}, got {len(found)}", "messages")
            inputs[name] = found[0][kind]

    def _message(self, i: int, message: Any) -> dict[str, Any]:
        at = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(f"{at}: an object with role and content", at)
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise bad(
                f"{at}.role: unsupported role {_echo(role)}; supported: {sorted(ROLES)}",
                f"{at}.role",
            )
        content = message.get("content")
        if content is None:
            if role != "assistant":
                raise bad(f"{at}.content: required", f"{at}.content")
            parts: list[dict[str, Any]] = []
        elif isinstance(content, str):
            parts = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            parts = [self._part(f"{at}.content[{j}]", p) for j, p in enumerate(content)]
        else:
            raise bad(f"{at}.content: a string or a list of parts", f"{at}.content")
        return {"role": ROLES[role], "content": parts}

    def _part(self, at: str, part: Any) -> dict[str, Any]:
        if not isinstance(part, dict):
            raise bad(f"{at}: an object with a type", at)
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise bad(f"{at}.text: a string", f"{at}.text")
            return {"type": "text", "text": text}
        if kind == "image_url":
            spec = part.get("image_url")
            url = spec.get("url") if isinstance(spec, dict) else spec
            return {"type": "image", "image": _image(f"{at}.image_url.url", url)}
        if kind == "input_audio":
            spec = part.get("input_audio")
            if not isinstance(spec, dict):
                raise bad(f"{at}.input_audio: an object with data and format", f"{at}.input_audio")
            pcm = _audio(f"{at}.input_audio", spec, self.oa.input_sample_rate)
            return {"type": "audio", "audio": pcm, "sample_rate": self.oa.input_sample_rate}
        raise bad(
            f"{at}.type: unsupported content part {_echo(kind)}; supported: text, image_url, "
            "input_audio",
            f"{at}.type",
        )

    # ---- /v1/audio/speech ------------------------------------------------------------

    def speech(self, body: Any) -> Plan:
        body = self._object(body)
        self._model(body)
        oa = self.oa
        if oa.audio_output is None:
            raise bad("this model makes no audio", "model")
        text = body.get("input")
        if not isinstance(text, str) or not text.strip():
            raise bad("input: required, a non-empty string", "input")
        if len(text) > MAX_SPEECH_INPUT:
            raise bad(f"input: at most {MAX_SPEECH_INPUT} characters, got {len(text)}", "input")
        speed = body.get("speed")
        if speed is not None and speed != 1:
            raise bad("speed: only 1.0 is supported", "speed")
        if body.get("instructions"):
            raise bad("instructions: not supported by this model", "instructions")
        stream_format = body.get("stream_format", "audio")
        if stream_format not in ("audio", "sse"):
            raise bad("stream_format: 'audio' or 'sse'", "stream_format")
        voice = self._voice(body.get("voice"), "voice")
        plan = Plan(inputs={}, stream=True, want_audio=True, voice=voice)
        plan.audio_format = self._format(body.get("response_format"), "response_format", "wav")
        plan.sse = stream_format == "sse"
        prompt = oa.speech_template.replace("{input}", text)
        if oa.messages_input is not None:
            plan.inputs[oa.messages_input] = [
                {"role": "user", "content": [{"type": "text", "text": prompt}]}
            ]
        else:
            plan.inputs[oa.text_input or ""] = prompt
        if oa.speak_input is not None:
            plan.inputs[oa.speak_input] = True
        self._voice_inputs(plan.inputs, voice)
        return plan


def _b64(at: str, data: Any) -> bytes:
    if not isinstance(data, str) or not data:
        raise bad(f"{at}: base64 data, a non-empty string", at)
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise bad(f"{at}: not valid base64", at) from None


def _image(at: str, url: Any) -> np.ndarray:
    if not isinstance(url, str) or not url:
        raise bad(f"{at}: required, a data: URL", at)
    if not url.startswith("data:"):
        # Fetching a caller's URL from inside the cluster would be a server-side request
        # forgery waiting to happen, and this machine class downloads nothing anyway.
        raise bad(f"{at}: only data: URLs (base64 images) are accepted, not remote URLs", at)
    head, _, data = url.partition(",")
    if not head.endswith(";base64") or not head.startswith("data:image/"):
        raise bad(f"{at}: expected data:image/<type>;base64,<data>", at)
    raw = _b64(at, data)
    try:
        from PIL import Image, UnidentifiedImageError
        from PIL.Image import DecompressionBombError
    except ImportError:
        raise ApiError(400, f"{at}: image input needs Pillow on the gateway", at) from None
    try:
        with Image.open(io.BytesIO(raw)) as img:
            if img.width * img.height > 64 << 20:
                raise bad(f"{at}: {img.width}x{img.height} pixels is too large", at)
            return np.asarray(img.convert("RGB"), dtype=np.uint8)
    except DecompressionBombError:
        raise bad(f"{at}: the image is too large (a decompression bomb?)", at) from None
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise bad(f"{at}: not a readable image ({str(exc)[:80]})", at) from None


def _audio(at: str, spec: dict[str, Any], rate: int) -> np.ndarray:
    fmt = spec.get("format")
    if fmt != "wav":
        raise bad(f"{at}.format: unsupported {_echo(fmt)}; supported: wav", f"{at}.format")
    raw = _b64(f"{at}.data", spec.get("data"))
    try:
        with wave.open(io.BytesIO(raw)) as w:
            channels, width, got_rate = w.getnchannels(), w.getsampwidth(), w.getframerate()
            frames = w.readframes(w.getnframes())
    except (wave.Error, EOFError, ValueError) as exc:
        raise bad(f"{at}.data: not a readable WAV file ({str(exc)[:80]})", f"{at}.data") from None
    if width != 2:
        raise bad(f"{at}.data: {8 * width}-bit samples; send 16-bit PCM WAV", f"{at}.data")
    if got_rate != rate:
        raise bad(f"{at}.data: {got_rate} Hz; this model takes {rate} Hz audio", f"{at}.data")
    pcm = np.frombuffer(frames, dtype="<i2").astype(np.float32) / 32768.0
    if channels > 1:
        pcm = pcm[: len(pcm) // channels * channels].reshape(-1, channels).mean(axis=1)
    return pcm
