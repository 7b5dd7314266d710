"""Realtime API events (GA names): client frames validated into typed events, and builders
of server events.

`parse_client_event(frame)` gives a typed event or a `ProtocolError`, never an exception:
every bad frame becomes an `error` server event (`error_event`) and the socket stays
open. The error's `type` is "invalid_request_error", its `event_id` the offending client
event's (when it had one), and its `code` says what was wrong:

| code                          | when                                                        |
| ----------------------------- | ----------------------------------------------------------- |
| `frame_too_large`             | a frame over the size bound                                 |
| `invalid_json`                | not JSON text (or not UTF-8, or nested too deep)            |
| `invalid_type`                | not an object, or a field of the wrong JSON type            |
| `unknown_event_type`          | `type` is not a client event (param `type`)                 |
| `unsupported_event`           | a client event this server does not serve                   |
| `missing_required_parameter`  | a required field is absent                                  |
| `unknown_parameter`           | a field the API does not have                               |
| `invalid_value`               | a value out of its range or set                             |
| `invalid_base64`              | audio that is not base64                                    |
| `invalid_audio_length`        | audio whose byte length is not whole pcm16 samples          |
| `unsupported_audio_format`    | a format other than `audio/pcm` at 24000 Hz                 |
| `unsupported_parameter`       | an API feature this server does not have (e.g. images)      |
| `invalid_frame`               | a binary WebSocket frame (the endpoint's check)             |

`param` is the offending field's path, as the API writes it (`session.audio.input.format`,
`item.content[0].audio`). Fields the API has but this server does not act on (tools,
tracing, transcription, noise reduction, ...) are accepted and left out of the effective
configuration that `session.updated` reports.

Server events are plain dicts without `event_id`: the session's outbox stamps it.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from omnirail.gateway.realtime.audio import BYTES_PER_SAMPLE, WIRE_RATE
from omnirail.gateway.realtime.items import Item, Part

# uvicorn refuses WebSocket messages over 16 MiB (closing the socket); frames under that
# but over this bound get an error event instead. 8 MiB of base64 is ~130 s of audio.
MAX_FRAME_CHARS = 8 << 20
MAX_ID_CHARS = 64

AUDIO_FORMAT = {"type": "audio/pcm", "rate": WIRE_RATE}


@dataclass(frozen=True)
class ProtocolError:
    """An `error` server event's `error` object."""

    code: str
    message: str
    param: str | None = None
    event_id: str | None = None
    type: str = "invalid_request_error"


class _Problem(Exception):
    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


# -- client event models -------------------------------------------------------------------


class _Strict(BaseModel):
    # strict: no coercion ("5" is not an integer); forbid: an unknown field is an error.
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


def _decode_audio(value: Any) -> Any:
    """base64 -> pcm16 bytes; a str that is not base64, or not whole samples, is an error."""
    if not isinstance(value, str):
        return value  # strict validation reports the type
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise PydanticCustomError("invalid_base64", "audio is not valid base64") from None
    if len(data) % BYTES_PER_SAMPLE:
        raise PydanticCustomError(
            "invalid_audio_length",
            "audio is {n} bytes, not a whole number of 16-bit samples",
            {"n": len(data)},
        )
    return data


class AudioFormat(_Strict):
    type: str | None = None
    rate: int | None = None


class ServerVadParams(_Strict):
    type: Literal["server_vad"]
    threshold: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    prefix_padding_ms: Annotated[int, Field(ge=0, le=10_000)] | None = None
    silence_duration_ms: Annotated[int, Field(ge=0, le=10_000)] | None = None
    create_response: bool | None = None
    interrupt_response: bool | None = None
    idle_timeout_ms: int | None = None


class SemanticVadParams(_Strict):
    type: Literal["semantic_vad"]
    create_response: bool | None = None
    interrupt_response: bool | None = None
    eagerness: str | None = None


TurnDetection = Annotated[ServerVadParams | SemanticVadParams, Field(discriminator="type")]


class AudioInput(_Strict):
    format: AudioFormat | None = None
    turn_detection: TurnDetection | None = None
    # Accepted, not acted on: the effective configuration reports them as null.
    noise_reduction: Any = None
    transcription: Any = None


class AudioOutput(_Strict):
    format: AudioFormat | None = None
    voice: str | dict[str, Any] | None = None
    speed: Annotated[float, Field(ge=0.25, le=1.5)] | None = None


class SessionAudio(_Strict):
    input: AudioInput | None = None
    output: AudioOutput | None = None


Modalities = Annotated[list[Literal["text", "audio"]], Field(min_length=1, max_length=1)]
MaxTokens = Annotated[int, Field(ge=1, le=4096)] | Literal["inf"]


class SessionParams(_Strict):
    """`session.update`'s `session`: only the fields present (`model_fields_set`) change."""

    type: Literal["realtime"]
    model: str | None = None
    instructions: str | None = None
    output_modalities: Modalities | None = None
    audio: SessionAudio | None = None
    max_output_tokens: MaxTokens | None = None
    # Accepted, not acted on (no tools, tracing or prompts in the mesh).
    tools: list[Any] | None = None
    tool_choice: Any = None
    tracing: Any = None
    truncation: Any = None
    include: Any = None
    prompt: Any = None
    reasoning: Any = None
    parallel_tool_calls: Any = None


class ContentPartParams(_Strict):
    type: Literal["input_text", "input_audio", "input_image", "output_text", "output_audio"]
    text: str | None = None
    audio: bytes | None = None
    transcript: str | None = None
    image_url: str | None = None
    detail: str | None = None

    @field_validator("audio", mode="before")
    @classmethod
    def decode_audio(cls, value: Any) -> Any:
        return _decode_audio(value)


class ItemParams(_Strict):
    type: Literal["message", "function_call", "function_call_output"]
    role: Literal["system", "user", "assistant"] | None = None
    content: list[ContentPartParams] | None = None
    id: Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)] | None = None
    object: Literal["realtime.item"] | None = None
    status: Literal["completed", "incomplete", "in_progress"] | None = None
    # function_call items (refused below).
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None


class ResponseAudioParams(_Strict):
    output: AudioOutput | None = None


class ResponseParams(_Strict):
    conversation: str | None = None
    input: list[Any] | None = None
    instructions: str | None = None
    output_modalities: Modalities | None = None
    max_output_tokens: MaxTokens | None = None
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None
    audio: ResponseAudioParams | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    prompt: Any = None
    reasoning: Any = None
    parallel_tool_calls: Any = None


EventId = Annotated[str, Field(max_length=512)] | None


class SessionUpdate(_Strict):
    type: Literal["session.update"]
    event_id: EventId = None
    session: SessionParams


class AudioAppend(_Strict):
    type: Literal["input_audio_buffer.append"]
    event_id: EventId = None
    audio: bytes

    @field_validator("audio", mode="before")
    @classmethod
    def decode_audio(cls, value: Any) -> Any:
        return _decode_audio(value)


class AudioCommit(_Strict):
    type: Literal["input_audio_buffer.commit"]
    event_id: EventId = None


class AudioClear(_Strict):
    type: Literal["input_audio_buffer.clear"]
    event_id: EventId = None


class ItemCreate(_Strict):
    type: Literal["conversation.item.create"]
    event_id: EventId = None
    item: ItemParams
    previous_item_id: str | None = None


class ItemTruncate(_Strict):
    type: Literal["conversation.item.truncate"]
    event_id: EventId = None
    item_id: str
    content_index: Annotated[int, Field(ge=0)]
    audio_end_ms: Annotated[int, Field(ge=0)]


class ItemDelete(_Strict):
    type: Literal["conversation.item.delete"]
    event_id: EventId = None
    item_id: str


class ItemRetrieve(_Strict):
    type: Literal["conversation.item.retrieve"]
    event_id: EventId = None
    item_id: str


class ResponseCreate(_Strict):
    type: Literal["response.create"]
    event_id: EventId = None
    response: ResponseParams | None = None


class ResponseCancel(_Strict):
    type: Literal["response.cancel"]
    event_id: EventId = None
    response_id: str | None = None


ClientEvent = (
    SessionUpdate
    | AudioAppend
    | AudioCommit
    | AudioClear
    | ItemCreate
    | ItemTruncate
    | ItemDelete
    | ItemRetrieve
    | ResponseCreate
    | ResponseCancel
)

CLIENT_EVENTS: dict[str, type[BaseModel]] = {
    "session.update": SessionUpdate,
    "input_audio_buffer.append": AudioAppend,
    "input_audio_buffer.commit": AudioCommit,
    "input_audio_buffer.clear": AudioClear,
    "conversation.item.create": ItemCreate,
    "conversation.item.truncate": ItemTruncate,
    "conversation.item.delete": ItemDelete,
    "conversation.item.retrieve": ItemRetrieve,
    "response.create": ResponseCreate,
    "response.cancel": ResponseCancel,
}
_UNSUPPORTED_EVENTS = {
    "output_audio_buffer.clear": "output_audio_buffer.clear is for WebRTC and SIP "
    "connections; over a WebSocket send response.cancel and conversation.item.truncate",
}


# -- parsing -------------------------------------------------------------------------------


def parse_client_event(
    frame: str | bytes, *, max_chars: int = MAX_FRAME_CHARS
) -> ClientEvent | ProtocolError:
    """One client frame as a typed event, or the error to send back for it."""
    if len(frame) > max_chars:
        return ProtocolError(
            "frame_too_large",
            f"the event is {len(frame)} characters; at most {max_chars} are accepted",
        )
    try:
        data = json.loads(frame, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        return ProtocolError("invalid_json", f"the event is not valid JSON: {str(exc)[:100]}")
    if not isinstance(data, dict):
        return ProtocolError(
            "invalid_type", f"an event must be a JSON object, not {_json_type(data)}"
        )
    raw_id = data.get("event_id")
    event_id = raw_id[:512] if isinstance(raw_id, str) else None
    kind = data.get("type")
    if kind is None:
        return ProtocolError(
            "missing_required_parameter", "Missing required parameter: 'type'.", "type", event_id
        )
    if not isinstance(kind, str):
        message = f"Invalid type for 'type': expected a string, but got {_json_type(kind)}."
        return ProtocolError("invalid_type", message, "type", event_id)
    if kind in _UNSUPPORTED_EVENTS:
        return ProtocolError("unsupported_event", _UNSUPPORTED_EVENTS[kind], "type", event_id)
    model = CLIENT_EVENTS.get(kind)
    if model is None:
        known = ", ".join(f"'{name}'" for name in CLIENT_EVENTS)
        return ProtocolError(
            "unknown_event_type",
            f"Invalid value: '{kind[:80]}'. Supported values are: {known}.",
            "type",
            event_id,
        )
    try:
        event = model.model_validate(data)
        _check(event)
    except ValidationError as exc:
        code, message, param = _explain(exc, data)
        return ProtocolError(code, message, param, event_id)
    except _Problem as problem:
        return ProtocolError(problem.code, problem.message, problem.param, event_id)
    return event  # type: ignore[return-value]


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


_EXPECTED = {
    "model_type": "an object",
    "model_attributes_type": "an object",
    "dict_type": "an object",
    "list_type": "an array",
    "string_type": "a string",
    "int_type": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "bool_type": "a boolean",
    "bytes_type": "a base64 string",
}


def _explain(exc: ValidationError, data: Any) -> tuple[str, str, str]:
    """The API's code, message and param for the first validation error."""
    error = exc.errors(include_url=False)[0]
    kind = error["type"]
    param, value = _locate(data, error["loc"], missing=kind == "missing")
    if kind in ("union_tag_not_found", "union_tag_invalid"):
        # The discriminator is the field at fault: name it.
        param, value = f"{param}.type", value.get("type") if isinstance(value, dict) else None
        kind = "missing" if kind == "union_tag_not_found" else "literal_error"
    if kind == "missing":
        return "missing_required_parameter", f"Missing required parameter: '{param}'.", param
    if kind == "extra_forbidden":
        return "unknown_parameter", f"Unknown parameter: '{param}'.", param
    if kind in ("invalid_base64", "invalid_audio_length"):
        return kind, f"Invalid '{param}': {error['msg']}.", param
    if kind in _EXPECTED:
        expected = _EXPECTED[kind]
        message = f"Invalid type for '{param}': expected {expected}, but got {_json_type(value)}."
        return "invalid_type", message, param
    shown = json.dumps(value)[:80]
    return "invalid_value", f"Invalid value for '{param}': {shown}. {error['msg']}.", param


def _locate(data: Any, loc: tuple[Any, ...], missing: bool) -> tuple[str, Any]:
    """A pydantic error location as the API's param path ("item.content[0].audio"), and
    the value found there. Parts that are not keys of the input (a union member's tag)
    are skipped, but for the last part of a missing-field error."""
    path = ""
    node = data
    for index, part in enumerate(loc):
        last = index == len(loc) - 1
        if isinstance(part, int) and isinstance(node, list) and 0 <= part < len(node):
            path += f"[{part}]"
            node = node[part]
        elif isinstance(part, str) and isinstance(node, dict) and part in node:
            path += f".{part}" if path else part
            node = node[part]
        elif isinstance(part, str) and last and missing:
            path += f".{part}" if path else part
            node = None
    return path, node


# -- checks pydantic cannot express ----------------------------------------------------------


def _check(event: BaseModel) -> None:
    if isinstance(event, SessionUpdate):
        _check_session(event.session)
    elif isinstance(event, ItemCreate):
        _check_item(event.item)
    elif isinstance(event, ResponseCreate) and event.response is not None:
        _check_response(event.response)


def _check_format(fmt: AudioFormat | None, param: str) -> None:
    if fmt is None:
        return
    if fmt.type not in (None, "audio/pcm"):
        raise _Problem(
            "unsupported_audio_format",
            f"Unsupported audio format '{str(fmt.type)[:40]}': this server speaks only "
            f"'audio/pcm' (16-bit mono) at {WIRE_RATE} Hz.",
            f"{param}.type",
        )
    if fmt.rate not in (None, WIRE_RATE):
        raise _Problem(
            "unsupported_audio_format",
            f"Unsupported sample rate {fmt.rate}: 'audio/pcm' is {WIRE_RATE} Hz only.",
            f"{param}.rate",
        )


def _check_session(session: SessionParams) -> None:
    audio = session.audio
    if audio is not None and audio.input is not None:
        _check_format(audio.input.format, "session.audio.input.format")
        detection = audio.input.turn_detection
        if isinstance(detection, SemanticVadParams):
            raise _Problem(
                "unsupported_parameter",
                "semantic_vad is not supported: use server_vad, or null for manual turns.",
                "session.audio.input.turn_detection.type",
            )
        if detection is not None and detection.idle_timeout_ms is not None:
            raise _Problem(
                "unsupported_parameter",
                "idle_timeout_ms is not supported.",
                "session.audio.input.turn_detection.idle_timeout_ms",
            )
    if audio is not None and audio.output is not None:
        _check_format(audio.output.format, "session.audio.output.format")


def _check_response(response: ResponseParams) -> None:
    if response.conversation not in (None, "auto"):
        raise _Problem(
            "unsupported_parameter",
            "Only responses in the default conversation ('auto') are supported.",
            "response.conversation",
        )
    if response.input is not None:
        raise _Problem(
            "unsupported_parameter",
            "Responses over their own input items are not supported.",
            "response.input",
        )
    if response.audio is not None and response.audio.output is not None:
        _check_format(response.audio.output.format, "response.audio.output.format")


# Content types each role may send (the API cannot take assistant audio from clients).
_ALLOWED_PARTS = {
    "system": ("input_text",),
    "user": ("input_text", "input_audio"),
    "assistant": ("output_text",),
}


def _check_item(item: ItemParams) -> None:
    if item.type != "message":
        raise _Problem(
            "unsupported_parameter",
            f"'{item.type}' items are not supported: this server has no tools.",
            "item.type",
        )
    if item.role is None:
        raise _Problem(
            "missing_required_parameter", "Missing required parameter: 'item.role'.", "item.role"
        )
    if item.content is None:
        raise _Problem(
            "missing_required_parameter",
            "Missing required parameter: 'item.content'.",
            "item.content",
        )
    for index, part in enumerate(item.content):
        param = f"item.content[{index}]"
        if part.type == "input_image":
            raise _Problem(
                "unsupported_parameter", "Image input is not supported.", f"{param}.type"
            )
        if part.type not in _ALLOWED_PARTS[item.role]:
            allowed = ", ".join(f"'{t}'" for t in _ALLOWED_PARTS[item.role])
            raise _Problem(
                "invalid_value",
                f"Invalid value: '{part.type}'. {item.role.capitalize()} messages take {allowed}.",
                f"{param}.type",
            )
        if part.type == "input_audio" and part.audio is None:
            raise _Problem(
                "missing_required_parameter",
                f"Missing required parameter: '{param}.audio'.",
                f"{param}.audio",
            )
        if part.type != "input_audio" and part.text is None:
            raise _Problem(
                "missing_required_parameter",
                f"Missing required parameter: '{param}.text'.",
                f"{param}.text",
            )


def item_from_params(params: ItemParams, item_id: str) -> Item:
    """The conversation item a valid `conversation.item.create` asks for."""
    assert params.role is not None and params.content is not None
    parts = [
        Part(type=p.type, audio=p.audio or b"", transcript=p.transcript)  # type: ignore[arg-type]
        if p.type == "input_audio"
        else Part(type=p.type, text=p.text)  # type: ignore[arg-type]
        for p in params.content
    ]
    status = params.status or "completed"
    return Item(id=item_id, role=params.role, content=parts, status=status)


# -- server events -------------------------------------------------------------------------


def error_event(error: ProtocolError) -> dict[str, Any]:
    return {
        "type": "error",
        "error": {
            "type": error.type,
            "code": error.code,
            "message": error.message,
            "param": error.param,
            "event_id": error.event_id,
        },
    }


def session_created(session: dict[str, Any]) -> dict[str, Any]:
    return {"type": "session.created", "session": session}


def session_updated(session: dict[str, Any]) -> dict[str, Any]:
    return {"type": "session.updated", "session": session}


def speech_started(audio_start_ms: int, item_id: str) -> dict[str, Any]:
    return {
        "type": "input_audio_buffer.speech_started",
        "audio_start_ms": audio_start_ms,
        "item_id": item_id,
    }


def speech_stopped(audio_end_ms: int, item_id: str) -> dict[str, Any]:
    return {
        "type": "input_audio_buffer.speech_stopped",
        "audio_end_ms": audio_end_ms,
        "item_id": item_id,
    }


def buffer_committed(item_id: str, previous_item_id: str | None) -> dict[str, Any]:
    return {
        "type": "input_audio_buffer.committed",
        "item_id": item_id,
        "previous_item_id": previous_item_id,
    }


def buffer_cleared() -> dict[str, Any]:
    return {"type": "input_audio_buffer.cleared"}


def item_added(item: Item, previous_item_id: str | None) -> dict[str, Any]:
    return {
        "type": "conversation.item.added",
        "item": item.to_json(),
        "previous_item_id": previous_item_id,
    }


def item_done(item: Item, previous_item_id: str | None) -> dict[str, Any]:
    return {
        "type": "conversation.item.done",
        "item": item.to_json(),
        "previous_item_id": previous_item_id,
    }


def item_deleted(item_id: str) -> dict[str, Any]:
    return {"type": "conversation.item.deleted", "item_id": item_id}


def item_retrieved(item: Item) -> dict[str, Any]:
    return {"type": "conversation.item.retrieved", "item": item.to_json(include_audio=True)}


def item_truncated(item_id: str, content_index: int, audio_end_ms: int) -> dict[str, Any]:
    return {
        "type": "conversation.item.truncated",
        "item_id": item_id,
        "content_index": content_index,
        "audio_end_ms": audio_end_ms,
    }


def response_created(response: dict[str, Any]) -> dict[str, Any]:
    return {"type": "response.created", "response": response}


def response_done(response: dict[str, Any]) -> dict[str, Any]:
    return {"type": "response.done", "response": response}


def output_item_added(response_id: str, output_index: int, item: Item) -> dict[str, Any]:
    return {
        "type": "response.output_item.added",
        "response_id": response_id,
        "output_index": output_index,
        "item": item.to_json(),
    }


def output_item_done(response_id: str, output_index: int, item: Item) -> dict[str, Any]:
    return {
        "type": "response.output_item.done",
        "response_id": response_id,
        "output_index": output_index,
        "item": item.to_json(),
    }


@dataclass(frozen=True)
class PartRef:
    """Where a content part of a response sits."""

    response_id: str
    item_id: str
    output_index: int = 0
    content_index: int = 0

    def fields(self) -> dict[str, Any]:
        return {
            "response_id": self.response_id,
            "item_id": self.item_id,
            "output_index": self.output_index,
            "content_index": self.content_index,
        }


def _part_json(part: Part) -> dict[str, Any]:
    # Response content parts are typed "audio"/"text" (the items' are output_audio/_text).
    if part.is_audio:
        return {"type": "audio", "transcript": part.transcript or ""}
    return {"type": "text", "text": part.text or ""}


def content_part_added(ref: PartRef, part: Part) -> dict[str, Any]:
    return {"type": "response.content_part.added", **ref.fields(), "part": _part_json(part)}


def content_part_done(ref: PartRef, part: Part) -> dict[str, Any]:
    return {"type": "response.content_part.done", **ref.fields(), "part": _part_json(part)}


def audio_delta(ref: PartRef, pcm: bytes) -> dict[str, Any]:
    delta = base64.b64encode(pcm).decode("ascii")
    return {"type": "response.output_audio.delta", **ref.fields(), "delta": delta}


def audio_done(ref: PartRef) -> dict[str, Any]:
    return {"type": "response.output_audio.done", **ref.fields()}


def transcript_delta(ref: PartRef, text: str) -> dict[str, Any]:
    return {"type": "response.output_audio_transcript.delta", **ref.fields(), "delta": text}


def transcript_done(ref: PartRef, transcript: str) -> dict[str, Any]:
    return {
        "type": "response.output_audio_transcript.done",
        **ref.fields(),
        "transcript": transcript,
    }


def text_delta(ref: PartRef, text: str) -> dict[str, Any]:
    return {"type": "response.output_text.delta", **ref.fields(), "delta": text}


def text_done(ref: PartRef, text: str) -> dict[str, Any]:
    return {"type": "response.output_text.done", **ref.fields(), "text": text}
