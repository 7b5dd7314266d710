"""OpenAI request bodies -> pipeline inputs: what is taken, and every refusal named."""

from __future__ import annotations

import base64
import io
import struct
import wave
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from omnirail.config import load_pipeline
from omnirail.config.api import ApiConfig
from omnirail.gateway.errors import ApiError
from omnirail.gateway.requests import RequestMapper
from omnirail.models.omni_demo import pipeline_file

ROOT = Path(__file__).resolve().parents[3]
DEMO = load_pipeline(pipeline_file()).api
QWEN = load_pipeline(ROOT / "omnirail/models/qwen3_omni/pipeline.yaml", resolve=False).api


def _variant(api: ApiConfig, **openai: Any) -> ApiConfig:
    assert api.openai is not None
    return api.model_copy(update={"openai": api.openai.model_copy(update=openai)})


def _demo(**openai: Any) -> RequestMapper:
    return RequestMapper(_variant(DEMO, **openai), "omni-demo")


def _qwen() -> RequestMapper:
    return RequestMapper(QWEN, "qwen3-omni")


def _chat(**body: Any) -> dict[str, Any]:
    return {"model": "omni-demo", "messages": [{"role": "user", "content": "hi"}], **body}


def _user(*parts: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "look"}, *parts]}]


def _png_url(pixels: np.ndarray, mode: str = "RGB") -> str:
    buf = io.BytesIO()
    Image.fromarray(pixels, mode).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _image(url: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def _wav(samples: list[int], rate: int = 16000, width: int = 2, channels: int = 1) -> str:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        fmt = "<h" if width == 2 else "<B"
        w.writeframes(b"".join(struct.pack(fmt, s) for s in samples))
    return base64.b64encode(buf.getvalue()).decode()


def _audio(data: Any, fmt: Any = "wav") -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": data, "format": fmt}}


def _refused(body: Any, mapper: RequestMapper | None = None, speech: bool = False) -> ApiError:
    mapper = mapper or _demo()
    with pytest.raises(ApiError) as ei:
        (mapper.speech if speech else mapper.chat)(body)
    assert ei.value.status == 400
    return ei.value


# -- /v1/chat/completions: what a request sets ---------------------------------------------------


def test_text_is_joined_from_messages() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": ""}]},
        {"role": "developer", "content": "b"},
    ]
    plan = _demo().chat(_chat(messages=messages))
    assert plan.inputs == {"speak": False, "text": "be brief\na\nb"}
    assert not plan.stream and not plan.want_audio and not plan.include_usage


def test_audio_modality_sets_speak_and_format() -> None:
    body = _chat(modalities=["text", "audio"], audio={"voice": "default", "format": "pcm"})
    plan = _demo().chat(body)
    assert plan.inputs["speak"] is True and plan.want_audio
    assert (plan.voice, plan.audio_format) == ("default", "pcm16")


def test_audio_defaults_to_first_voice_and_wav() -> None:
    plan = _demo().chat(_chat(modalities=["audio"], audio={}))
    assert (plan.voice, plan.audio_format) == ("default", "wav")


def test_voice_extras_become_inputs() -> None:
    mapper = _demo(voices={"default": {}, "deep": {"temperature": 0.2, "seed": 7}})
    plan = mapper.chat(_chat(modalities=["audio"], audio={"voice": "deep"}))
    assert plan.inputs["temperature"] == 0.2 and plan.inputs["seed"] == 7


def test_stream_and_include_usage() -> None:
    plan = _demo().chat(_chat(stream=True, stream_options={"include_usage": True}))
    assert plan.stream and plan.include_usage


def test_sampling_inputs() -> None:
    plan = _demo().chat(_chat(max_tokens=5, seed=3, temperature=1))
    assert plan.inputs["max_new_tokens"] == 5 and plan.inputs["seed"] == 3
    assert plan.inputs["temperature"] == 1.0 and isinstance(plan.inputs["temperature"], float)


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    plan = _demo().chat(_chat(max_tokens=5, max_completion_tokens=9))
    assert plan.inputs["max_new_tokens"] == 9


@pytest.mark.parametrize("temperature", [0, 2, 0.7])
def test_temperature_bounds_are_inclusive(temperature: float) -> None:
    assert _demo().chat(_chat(temperature=temperature)).inputs["temperature"] == temperature


def test_undeclared_seed_and_temperature_are_ignored() -> None:
    plan = _qwen().chat({"model": "qwen3-omni", "messages": _user(), "seed": 1, "temperature": 1})
    assert set(plan.inputs) == {"speak", "messages"}


def test_png_data_url_becomes_an_rgb_array() -> None:
    pixels = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    plan = _demo().chat(_chat(messages=_user(_image(_png_url(pixels)))))
    image = plan.inputs["image"]
    assert image.dtype == np.uint8 and image.shape == (2, 3, 3)
    assert np.array_equal(image, pixels)


def test_grayscale_png_becomes_three_channels() -> None:
    plan = _demo().chat(_chat(messages=_user(_image(_png_url(np.zeros((4, 5), np.uint8), "L")))))
    assert plan.inputs["image"].shape == (4, 5, 3)


def test_wav_becomes_float32_pcm() -> None:
    plan = _demo().chat(_chat(messages=_user(_audio(_wav([0, 16384, -32768])))))
    audio = plan.inputs["audio"]
    assert audio.dtype == np.float32 and audio.tolist() == [0.0, 0.5, -1.0]


def test_stereo_wav_is_averaged() -> None:
    data = _wav([16384, 0, -16384, -16384], channels=2)
    audio = _demo().chat(_chat(messages=_user(_audio(data)))).inputs["audio"]
    assert audio.tolist() == [0.25, -0.5]


def test_messages_input_passes_the_conversation() -> None:
    pixels = np.full((1, 2, 3), 9, np.uint8)
    messages = [
        {"role": "developer", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, _image(_png_url(pixels)),
                                     _audio(_wav([16384]))]},
    ]  # fmt: skip
    plan = _qwen().chat({"model": "qwen3-omni", "messages": messages, "max_tokens": 4})
    turns = plan.inputs["messages"]
    assert turns[0] == {"role": "system", "content": [{"type": "text", "text": "sys"}]}
    text, image, audio = turns[1]["content"]
    assert turns[1]["role"] == "user" and text == {"type": "text", "text": "hi"}
    assert image["type"] == "image" and np.array_equal(image["image"], pixels)
    assert set(audio) == {"type", "audio", "sample_rate"} and audio["sample_rate"] == 16000
    assert audio["type"] == "audio" and audio["audio"].tolist() == [0.5]
    assert plan.inputs["max_new_tokens"] == 4 and plan.inputs["speak"] is False


def test_unknown_model_is_404() -> None:
    with pytest.raises(ApiError) as ei:
        _demo().chat(_chat(model="gpt-4o"))
    err = ei.value
    assert (err.status, err.code, err.param) == (404, "model_not_found", "model")
    assert "The model 'gpt-4o' does not exist; this server serves 'omni-demo'" in err.message


def test_mapper_needs_an_openai_section() -> None:
    with pytest.raises(ValueError, match=r"no api\.openai"):
        RequestMapper(DEMO.model_copy(update={"openai": None}), "m")


# -- /v1/chat/completions: refusals --------------------------------------------------------------

_RED = _png_url(np.zeros((1, 1, 3), np.uint8))
_AT = "messages[0].content[1]"
# (id, body fields over _chat(), param, message fragment)
CHAT_REFUSALS: list[tuple[str, dict[str, Any], str | None, str]] = [
    ("no_model", {"model": None}, "model", "model: required, a string"),
    ("n", {"n": 2}, "n", "n: only 1 is supported"),
    ("tools", {"tools": [{"type": "function"}]}, "tools", "tools: not supported"),
    ("functions", {"functions": [{}]}, "functions", "functions: not supported"),
    ("logprobs", {"logprobs": True}, "logprobs", "logprobs: not supported"),
    ("stream", {"stream": "yes"}, "stream", "stream: a boolean"),
    ("stream_options", {"stream_options": "x"}, "stream_options", "stream_options: an object"),
    ("modalities_type", {"modalities": "audio"}, "modalities", "modalities: a list of strings"),
    ("modality", {"modalities": ["video"]}, "modalities",
     "unsupported modality 'video'; this model makes ['text', 'audio']"),
    ("audio_missing", {"modalities": ["audio"]}, "audio", 'required with modalities ["audio"]'),
    ("audio_unasked", {"audio": {}}, "audio", 'audio: only with modalities including "audio"'),
    ("voice", {"modalities": ["audio"], "audio": {"voice": "alloy"}}, "audio.voice",
     "audio.voice: unsupported voice 'alloy'; supported: ['default']"),
    ("audio_format", {"modalities": ["audio"], "audio": {"format": "mp3"}}, "audio.format",
     "audio.format: unsupported audio format 'mp3'"),
    ("no_messages", {"messages": None}, "messages", "messages: required, a non-empty list"),
    ("empty_messages", {"messages": []}, "messages", "messages: required, a non-empty list"),
    ("many_messages", {"messages": [{"role": "user", "content": "x"}] * 1025}, "messages",
     "messages: at most 1024"),
    ("message_type", {"messages": ["hi"]}, "messages[0]", "messages[0]: an object with role"),
    ("role", {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role",
     "messages[0].role: unsupported role 'tool'"),
    ("no_content", {"messages": [{"role": "user"}]}, "messages[0].content",
     "messages[0].content: required"),
    ("content_type", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content",
     "messages[0].content: a string or a list of parts"),
    ("part_type", {"messages": _user("x")}, _AT, f"{_AT}: an object with a type"),
    ("part_kind", {"messages": _user({"type": "video_url"})}, f"{_AT}.type",
     "unsupported content part 'video_url'; supported: text, image_url, input_audio"),
    ("part_text", {"messages": _user({"type": "text", "text": 5})}, f"{_AT}.text", "a string"),
    ("no_text", {"messages": [{"role": "user", "content": " "}]}, "messages",
     "messages: no text in any message"),
    ("text_too_long", {"messages": [{"role": "user", "content": "x" * ((1 << 20) + 1)}]},
     "messages", "messages: 1048577 characters of text; at most 1048576"),
    ("no_url", {"messages": _user(_image(""))}, f"{_AT}.image_url.url", "required, a data: URL"),
    ("remote_url", {"messages": _user(_image("https://example.com/cat.png"))},
     f"{_AT}.image_url.url", "only data: URLs (base64 images) are accepted, not remote URLs"),
    ("not_image_url", {"messages": _user(_image("data:text/plain;base64,aGk="))},
     f"{_AT}.image_url.url", "expected data:image/<type>;base64,<data>"),
    ("bad_base64", {"messages": _user(_image("data:image/png;base64,!!"))},
     f"{_AT}.image_url.url", "not valid base64"),
    ("not_an_image", {"messages": _user(_image("data:image/png;base64,aGVsbG8="))},
     f"{_AT}.image_url.url", "not a readable image"),
    ("two_images", {"messages": _user(_image(_RED), _image(_RED))}, "messages",
     "messages: this model takes one image, got 2"),
    ("audio_part", {"messages": _user({"type": "input_audio", "input_audio": "x"})},
     f"{_AT}.input_audio", "an object with data and format"),
    ("audio_fmt", {"messages": _user(_audio(_wav([0]), "mp3"))}, f"{_AT}.input_audio.format",
     "unsupported 'mp3'; supported: wav"),
    ("not_wav", {"messages": _user(_audio("aGVsbG8="))}, f"{_AT}.input_audio.data",
     "not a readable WAV file"),
    ("wav_rate", {"messages": _user(_audio(_wav([0], rate=8000)))}, f"{_AT}.input_audio.data",
     "8000 Hz; this model takes 16000 Hz audio"),
    ("wav_8bit", {"messages": _user(_audio(_wav([128], width=1)))}, f"{_AT}.input_audio.data",
     "8-bit samples; send 16-bit PCM WAV"),
    ("max_tokens", {"max_tokens": 0}, "max_tokens", "max_tokens: a positive integer"),
    ("max_tokens_bool", {"max_completion_tokens": True}, "max_completion_tokens",
     "max_completion_tokens: a positive integer"),
    ("seed", {"seed": "1"}, "seed", "seed: an integer"),
    ("temperature_high", {"temperature": 2.5}, "temperature", "a number within 0..2"),
    ("temperature_low", {"temperature": -0.1}, "temperature", "a number within 0..2"),
    ("temperature_nan", {"temperature": float("nan")}, "temperature", "a number within 0..2"),
    ("temperature_bool", {"temperature": True}, "temperature", "a number within 0..2"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "param", "message"), [pytest.param(*c[1:], id=c[0]) for c in CHAT_REFUSALS]
)
def test_chat_refusal(fields: dict[str, Any], param: str | None, message: str) -> None:
    err = _refused(_chat(**fields))
    assert err.param == param and message in err.message


def test_body_must_be_an_object() -> None:
    assert "must be a JSON object, not list" in _refused([]).message


def test_image_refused_when_the_model_takes_none() -> None:
    err = _refused(_chat(messages=_user(_image(_RED))), _demo(image_input=None))
    assert "messages: this model takes no image input" in err.message


def test_max_tokens_refused_when_the_model_takes_none() -> None:
    err = _refused(_chat(max_tokens=3), _demo(max_tokens_input=None))
    assert (err.param, err.message) == ("max_tokens", "max_tokens: this model does not take it")


def test_audio_modality_refused_when_the_model_makes_none() -> None:
    err = _refused(_chat(modalities=["audio"], audio={}), _demo(audio_output=None))
    assert "this model makes ['text']" in err.message


def _bomb_png_url() -> str:
    """A PNG whose header claims 20000x20000 pixels (past Pillow's own bomb limit)."""
    png = bytearray(base64.b64decode(_RED.partition(",")[2]))
    png[16:24] = struct.pack(">II", 20000, 20000)
    png[29:33] = struct.pack(">I", zlib.crc32(bytes(png[12:29])))
    return "data:image/png;base64," + base64.b64encode(bytes(png)).decode()


@pytest.mark.parametrize(
    "fields",
    [pytest.param({"messages": [{"role": ["user"], "content": "x"}]}, id="unhashable_role"),
     pytest.param({"temperature": 10**400}, id="huge_int_temperature"),
     pytest.param({"messages": _user(_image(_bomb_png_url()))}, id="pillow_bomb")],
)  # fmt: skip
def test_malformed_fields_are_refused_not_crashed(fields: dict[str, Any]) -> None:
    """An unhashable role, a JSON integer too big for a float, a Pillow decompression bomb:
    each a 400 naming the field, not a TypeError/OverflowError/DecompressionBombError."""
    err = _refused(_chat(**fields))
    assert err.status == 400 and err.param


# -- /v1/audio/speech ----------------------------------------------------------------------------


def _speech(**body: Any) -> dict[str, Any]:
    return {"model": "omni-demo", "input": "say this", **body}


def test_speech_defaults() -> None:
    plan = _demo().speech(_speech())
    assert plan.inputs == {"text": "say this", "speak": True}
    assert plan.stream and plan.want_audio and not plan.sse
    assert (plan.audio_format, plan.voice) == ("wav", "default")


def test_speech_options() -> None:
    plan = _demo().speech(_speech(response_format="pcm", stream_format="sse", speed=1.0))
    assert plan.audio_format == "pcm16" and plan.sse


def test_speech_template_and_voice_extras() -> None:
    mapper = _demo(speech_template="Repeat: {input}", voices={"a": {}, "b": {"seed": 2}})
    plan = mapper.speech(_speech(voice="b"))
    assert plan.inputs["text"] == "Repeat: say this" and plan.inputs["seed"] == 2


def test_speech_with_messages_input() -> None:
    plan = _qwen().speech({"model": "qwen3-omni", "input": "hello"})
    assert plan.inputs["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "hello"}]}
    ]
    assert plan.voice == "ethan" and plan.inputs["speak"] is True


SPEECH_REFUSALS: list[tuple[str, dict[str, Any], str, str]] = [
    ("no_input", {"input": None}, "input", "input: required, a non-empty string"),
    ("blank_input", {"input": "  "}, "input", "input: required, a non-empty string"),
    ("long_input", {"input": "x" * 4097}, "input", "input: at most 4096 characters, got 4097"),
    ("speed", {"speed": 1.5}, "speed", "speed: only 1.0 is supported"),
    ("instructions", {"instructions": "sing"}, "instructions", "instructions: not supported"),
    ("stream_format", {"stream_format": "chunks"}, "stream_format", "'audio' or 'sse'"),
    ("format", {"response_format": "mp3"}, "response_format", "unsupported audio format 'mp3'"),
    ("voice", {"voice": "nova"}, "voice", "voice: unsupported voice 'nova'"),
    ("no_model", {"model": ""}, "model", "model: required, a string"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "param", "message"), [pytest.param(*c[1:], id=c[0]) for c in SPEECH_REFUSALS]
)
def test_speech_refusal(fields: dict[str, Any], param: str, message: str) -> None:
    err = _refused(_speech(**fields), speech=True)
    assert err.param == param and message in err.message


def test_speech_refused_without_audio_output() -> None:
    err = _refused(_speech(), _demo(audio_output=None), speech=True)
    assert (err.param, err.message) == ("model", "this model makes no audio")
