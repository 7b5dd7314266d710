"""`api:`, what a pipeline shows the standard front doors (KServe v2 gRPC, OpenAI HTTP).

    api:
      model: omni-demo                # the model name clients ask for (default: the pipeline's)
      inputs:                         # request fields as named tensors
        - {name: text, datatype: BYTES, shape: [1]}            # [1]: a scalar (here a str)
        - {name: max_new_tokens, datatype: INT64, shape: [1], optional: true}
        - {name: audio, datatype: FP32, shape: [-1], optional: true}  # -1: any length
      outputs:                        # what comes back, from the terminal stages
        - {name: text, datatype: BYTES, shape: [1], stage: decode, result: text, chunks: "."}
        - {name: audio, datatype: FP32, shape: [-1], stage: code2wav, chunks: pcm}
      openai:                         # how OpenAI requests map onto those inputs and outputs
        text_input: text              # the chat's text, joined ("messages_input" passes the chat)
        max_tokens_input: max_new_tokens
        text_output: text
        audio_output: audio
        sample_rate: 16000
        voices: {default: {}}         # voice -> extra inputs it sets
        realtime: {max_sessions: 16}  # also the Realtime API (WebSocket /v1/realtime)

An output takes a field of its stage's result (`result: FIELD`) and/or of each of its stream
chunks (`chunks: FIELD`); "." is the whole value. A unary call answers with the result field,
or with the chunks' fields concatenated when it has none; a stream sends each chunk as it
comes and ends with the outputs that have only a result field. BYTES carry text (str as
UTF-8), raw bytes, or JSON (`format: json`) for anything else.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from omnirail.config.errors import NAME_RE, short
from omnirail.wire.errors import internal

# KServe v2 datatypes -> numpy dtype names ("BYTES" holds text, bytes or JSON).
DATATYPES: dict[str, str] = {
    "BOOL": "bool",
    "UINT8": "uint8",
    "UINT16": "uint16",
    "UINT32": "uint32",
    "UINT64": "uint64",
    "INT8": "int8",
    "INT16": "int16",
    "INT32": "int32",
    "INT64": "int64",
    "FP16": "float16",
    "FP32": "float32",
    "FP64": "float64",
    "BYTES": "object",
}
WHOLE = "."  # `result:` / `chunks:` value meaning the whole result or chunk
MAX_DIMS = 8
AUDIO_FORMATS = ("wav", "pcm16")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class TensorSpec(_Model):
    """A named tensor of the KServe v2 protocol, as a request field or a result."""

    name: str = Field(
        min_length=1, max_length=63, description="The tensor's name (a request or result field)."
    )
    datatype: Literal[
        "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
        "FP16", "FP32", "FP64", "BYTES",
    ] = Field(description="KServe v2 datatype; BYTES holds text, raw bytes or JSON.")  # fmt: skip
    shape: list[int] = Field(
        min_length=1,
        max_length=MAX_DIMS,
        description="Dimensions; -1: any size along that axis; [1] is a plain value (str, "
        "int, ...) on the pipeline's side.",
    )
    format: Literal["text", "json", "bytes"] = Field(
        "text",
        description='BYTES only: how the bytes read ("text": UTF-8, "json": a JSON document, '
        '"bytes": raw).',
    )

    @field_validator("name")
    @classmethod
    def _check_name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError(f"invalid tensor name {short(v)}: letters, digits, '_' or '-'")
        return v

    @field_validator("shape")
    @classmethod
    def _check_shape(cls, v: list[int]) -> list[int]:
        bad = [d for d in v if d < -1 or d > 1 << 40]
        if bad:
            raise ValueError(f"dimensions are -1 (any) or a size >= 0, got {bad[0]}")
        return v

    @model_validator(mode="after")
    def _format_for_bytes(self) -> TensorSpec:
        if self.datatype != "BYTES" and "format" in self.model_fields_set:
            raise ValueError(f"format: only BYTES tensors have one, not {self.datatype}")
        return self

    @property
    def scalar(self) -> bool:
        """A one-element tensor that is a plain value (str, int, ...) on the pipeline side."""
        return self.shape == [1]


class InputSpec(TensorSpec):
    """`api.inputs[]`: a request field as a named tensor."""

    optional: bool = Field(False, description="A request may leave the field out.")


class OutputSpec(TensorSpec):
    """`api.outputs[]`: what comes back, from a terminal stage's result and/or chunks."""

    stage: str = Field(description="The terminal stage the output comes from.")
    result: str | None = Field(
        None, description='The field of the stage\'s result ("." the whole result).'
    )
    chunks: str | None = Field(
        None, description='The field of each of the stage\'s stream chunks ("." the whole chunk).'
    )

    @model_validator(mode="after")
    def _has_source(self) -> OutputSpec:
        if self.result is None and self.chunks is None:
            raise ValueError("set result: FIELD and/or chunks: FIELD ('.' for the whole value)")
        return self

    def of_result(self, value: Any) -> Any:
        """This output's field of its stage's result; raises INTERNAL without it."""
        assert self.result is not None
        return pick(value, self.result, self._where("result"))

    def of_chunk(self, value: Any) -> Any:
        """This output's field of one of its stage's chunks; raises INTERNAL without it."""
        assert self.chunks is not None
        return pick(value, self.chunks, self._where("chunk"))

    def _where(self, what: str) -> str:
        return f"api output {self.name!r}: the {what} of stage {self.stage!r}"


class RealtimeConfig(_Model):
    """`api.openai.realtime`: the OpenAI Realtime API (WebSocket `/v1/realtime`) over the
    same mapping as the chat: each answer is one request whose `messages_input` holds the
    whole conversation (user audio at `input_sample_rate`), with `speak_input`,
    `max_tokens_input`, the voices, and text and audio from `text_output` and
    `audio_output`. Unset: the gateway refuses `/v1/realtime` with 404."""

    max_sessions: int = Field(
        16,
        ge=1,
        le=100_000,
        description="Realtime sessions (WebSocket connections) one gateway holds at once; "
        "one more is told so in an `error` event and closed (1013, try again later).",
    )
    max_items: int = Field(
        512,
        ge=2,
        le=100_000,
        description="Conversation items one session holds; creating one more is an "
        "`error` event (delete old ones).",
    )
    max_buffer_s: float = Field(
        120.0,
        gt=0,
        le=3600,
        description="Seconds of input audio a session buffers before a commit; appending "
        "more is an `error` event.",
    )
    max_audio_s: float = Field(
        1800.0,
        gt=0,
        le=86_400,
        description="Seconds of audio a session keeps in its items; past it the oldest "
        "items lose their audio (their user turns then leave the history the model gets).",
    )


class OpenAIConfig(_Model):
    """`api.openai`: how OpenAI requests map onto the pipeline's `api` inputs and outputs
    (exactly one of `messages_input` and `text_input`)."""

    messages_input: str | None = Field(
        None,
        description="The input that gets the whole conversation (a list of {role, content: "
        "[{type: text|image|audio, ...}]}).",
    )
    text_input: str | None = Field(
        None, description="The input that gets the chat's text, joined by newlines."
    )
    image_input: str | None = Field(
        None,
        description="The input that gets the chat's first image (HxWx3 uint8), for "
        "`text_input` pipelines.",
    )
    audio_input: str | None = Field(
        None,
        description="The input that gets the chat's first audio (float32 PCM at "
        "`input_sample_rate`), for `text_input` pipelines.",
    )
    max_tokens_input: str | None = Field(
        None, description="The input that gets `max_tokens` / `max_completion_tokens`."
    )
    seed_input: str | None = Field(None, description="The input that gets `seed`.")
    temperature_input: str | None = Field(None, description="The input that gets `temperature`.")
    speak_input: str | None = Field(
        None,
        description="The input set to false when a request does not ask for audio (so no "
        "talker runs for it).",
    )
    text_output: str | None = Field(None, description="The output that carries the text.")
    audio_output: str | None = Field(None, description="The output that carries the audio.")
    sample_rate: int = Field(
        16000,
        gt=0,
        le=384000,
        description="Output audio's rate when its chunks do not say (a `sample_rate` field "
        "beside the PCM).",
    )
    input_sample_rate: int = Field(
        16000,
        gt=0,
        le=384000,
        description="The rate input audio must have (WAV in `input_audio` parts).",
    )
    voices: dict[str, dict[str, Any]] = Field(
        {"default": {}},
        description="Voice name -> extra inputs it sets; the first is the default.",
    )
    speech_template: str = Field(
        "{input}",
        description="`/v1/audio/speech`: the text to speak becomes this with {input} filled.",
    )
    realtime: RealtimeConfig | None = Field(
        None,
        description="The Realtime API (WebSocket `/v1/realtime`) over this mapping; "
        "unset: not served.",
    )

    @model_validator(mode="after")
    def _one_chat_input(self) -> OpenAIConfig:
        if (self.messages_input is None) == (self.text_input is None):
            raise ValueError("set exactly one of messages_input and text_input")
        if not self.voices:
            raise ValueError("voices: at least one")
        if "{input}" not in self.speech_template:
            raise ValueError("speech_template: must contain {input}")
        return self


class ApiConfig(_Model):
    """`api:`: what the KServe v2 gRPC and OpenAI HTTP front doors show."""

    model: str | None = Field(
        None,
        min_length=1,
        max_length=63,
        description="The model name clients ask for; unset: the pipeline's name.",
    )
    inputs: list[InputSpec] = Field(
        default_factory=list, max_length=256, description="Request fields as named tensors."
    )
    outputs: list[OutputSpec] = Field(
        default_factory=list,
        max_length=256,
        description="What comes back, from the terminal stages.",
    )
    openai: OpenAIConfig | None = Field(
        None, description="The OpenAI-compatible HTTP mapping; unset: no HTTP gateway."
    )

    @field_validator("model")
    @classmethod
    def _check_model(cls, v: str | None) -> str | None:
        if v is not None and not NAME_RE.match(v):
            raise ValueError(f"invalid model name {short(v)}: letters, digits, '_' or '-'")
        return v

    def input(self, name: str) -> InputSpec | None:
        return next((i for i in self.inputs if i.name == name), None)

    def output(self, name: str) -> OutputSpec | None:
        return next((o for o in self.outputs if o.name == name), None)


def api_problems(api: ApiConfig, terminals: set[str]) -> list[str]:
    """Cross-field rules (names unique, outputs from terminal stages, OpenAI references)."""
    out: list[str] = []
    for kind, specs in (("inputs", api.inputs), ("outputs", api.outputs)):
        seen: set[str] = set()
        for spec in specs:
            if spec.name in seen:
                out.append(f"pipeline.api.{kind}[{spec.name}]: duplicate name")
            seen.add(spec.name)
    for spec in api.outputs:
        if spec.stage not in terminals:
            out.append(
                f"pipeline.api.outputs[{spec.name}].stage: {short(spec.stage)} is not a "
                f"terminal stage (terminal: {sorted(terminals)})"
            )
    oa = api.openai
    if oa is None:
        return out
    for field in (
        "messages_input", "text_input", "image_input", "audio_input", "max_tokens_input",
        "seed_input", "temperature_input", "speak_input",
    ):  # fmt: skip
        name = getattr(oa, field)
        if name is not None and api.input(name) is None:
            out.append(f"pipeline.api.openai.{field}: {short(name)} is not one of api.inputs")
    for field in ("text_output", "audio_output"):
        name = getattr(oa, field)
        if name is not None and api.output(name) is None:
            out.append(f"pipeline.api.openai.{field}: {short(name)} is not one of api.outputs")
    if oa.text_output is None and oa.audio_output is None:
        out.append("pipeline.api.openai: set text_output and/or audio_output")
    audio = api.output(oa.audio_output) if oa.audio_output else None
    if audio is not None and (audio.datatype not in ("FP32", "FP16", "FP64", "INT16")):
        out.append(
            f"pipeline.api.openai.audio_output: {audio.name} must be FP32/FP16/FP64 PCM "
            f"in [-1, 1] or INT16, not {audio.datatype}"
        )
    text = api.output(oa.text_output) if oa.text_output else None
    if text is not None and text.datatype != "BYTES":
        out.append(f"pipeline.api.openai.text_output: {text.name} must be BYTES")
    if oa.realtime is not None:
        out += _realtime_problems(oa)
    for voice, extra in oa.voices.items():
        for key in extra:
            if api.input(key) is None:
                out.append(
                    f"pipeline.api.openai.voices[{short(voice)}]: {short(key)} is not one of "
                    "api.inputs"
                )
    return out


def _realtime_problems(oa: OpenAIConfig) -> list[str]:
    """What the Realtime API needs of the mapping: the conversation as messages (its audio
    turns are audio parts) and answers in text and audio (transcript and speech)."""
    where = "pipeline.api.openai.realtime"
    out = []
    if oa.messages_input is None:
        out.append(
            f"{where}: needs openai.messages_input (each answer gets the whole conversation, "
            "its spoken turns as audio parts), not text_input"
        )
    for field in ("text_output", "audio_output"):
        if getattr(oa, field) is None:
            out.append(f"{where}: needs openai.{field} (answers are speech and its transcript)")
    return out


def pick(value: Any, field: str, where: str) -> Any:
    """`field` of a stage's result or chunk ("." the whole value); raises INTERNAL (the
    pipeline does not make what its `api:` declares)."""
    if field == WHOLE:
        return value
    if isinstance(value, Mapping) and field in value:
        return value[field]
    got = sorted(map(str, value))[:8] if isinstance(value, Mapping) else type(value).__name__
    raise internal(f"{where}: has no field {field!r} (got {got}); check the pipeline's api")
