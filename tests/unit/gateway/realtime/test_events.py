"""Client frames validated into typed events; each kind of bad frame answered by the
protocol's `error` event (checked against the SDK's types), never an exception."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from omnirail.gateway.realtime import events as ev
from omnirail.gateway.realtime.items import Item, Part
from tests.unit.gateway.realtime.sdk_types import parse_server_event

PCM = base64.b64encode(b"\x00\x01" * 240).decode()  # 10 ms


def _session(**fields: Any) -> str:
    return json.dumps({"type": "session.update", "event_id": "ev1", "session": fields})


def _audio_input(**fields: Any) -> str:
    return _session(type="realtime", audio={"input": fields})


# (frame, code, param, event_id)
BAD_FRAMES = [
    ("{not json", "invalid_json", None, None),
    (b"\xff\xfe", "invalid_json", None, None),
    ('{"type": "response.create", "x": NaN}', "invalid_json", None, None),
    ("[" * 100_000, "invalid_json", None, None),
    ("[1, 2]", "invalid_type", None, None),
    ('"response.create"', "invalid_type", None, None),
    ('{"event_id": "e1"}', "missing_required_parameter", "type", "e1"),
    ('{"type": 7, "event_id": "e2"}', "invalid_type", "type", "e2"),
    ('{"type": "response.explode", "event_id": "e3"}', "unknown_event_type", "type", "e3"),
    ('{"type": "output_audio_buffer.clear"}', "unsupported_event", "type", None),
    ('{"type": "input_audio_buffer.append", "event_id": "a"}', "missing_required_parameter",
     "audio", "a"),
    ('{"type": "input_audio_buffer.append", "audio": 12}', "invalid_type", "audio", None),
    ('{"type": "input_audio_buffer.append", "audio": "@@not base64@@"}', "invalid_base64",
     "audio", None),
    ('{"type": "input_audio_buffer.append", "audio": "AAAA"}', "invalid_audio_length", "audio",
     None),
    ('{"type": "input_audio_buffer.commit", "extra": 1}', "unknown_parameter", "extra", None),
    ('{"type": "conversation.item.truncate", "item_id": "i", "content_index": 0}',
     "missing_required_parameter", "audio_end_ms", None),
    ('{"type": "conversation.item.truncate", "item_id": "i", "content_index": 0, '
     '"audio_end_ms": "10"}', "invalid_type", "audio_end_ms", None),
    ('{"type": "conversation.item.truncate", "item_id": "i", "content_index": 0, '
     '"audio_end_ms": 1.5}', "invalid_type", "audio_end_ms", None),
    ('{"type": "conversation.item.truncate", "item_id": "i", "content_index": -1, '
     '"audio_end_ms": 0}', "invalid_value", "content_index", None),
    ('{"type": "conversation.item.delete", "item_id": ["x"]}', "invalid_type", "item_id", None),
    ('{"type": "response.cancel", "response_id": 5}', "invalid_type", "response_id", None),
    ('{"type": "response.create", "response": {"output_modalities": ["audio", "text"]}}',
     "invalid_value", "response.output_modalities", None),
    ('{"type": "response.create", "response": {"conversation": "none"}}',
     "unsupported_parameter", "response.conversation", None),
    ('{"type": "response.create", "response": {"max_output_tokens": "lots"}}',
     "invalid_type", "response.max_output_tokens", None),
    ('{"type": "response.create", "response": {"audio": {"output": {"format": '
     '{"type": "audio/pcmu"}}}}}', "unsupported_audio_format",
     "response.audio.output.format.type", None),
    (_session(), "missing_required_parameter", "session.type", "ev1"),
    (_session(type="transcription"), "invalid_value", "session.type", "ev1"),
    (_session(type="realtime", colour="red"), "unknown_parameter", "session.colour", "ev1"),
    (_session(type="realtime", instructions=3), "invalid_type", "session.instructions", "ev1"),
    (_session(type="realtime", output_modalities=["video"]), "invalid_value",
     "session.output_modalities[0]", "ev1"),
    (_audio_input(format={"type": "audio/pcmu"}), "unsupported_audio_format",
     "session.audio.input.format.type", "ev1"),
    (_audio_input(format={"type": "audio/pcma"}), "unsupported_audio_format",
     "session.audio.input.format.type", "ev1"),
    (_audio_input(format={"type": "audio/pcm", "rate": 16000}), "unsupported_audio_format",
     "session.audio.input.format.rate", "ev1"),
    (_session(type="realtime", audio={"output": {"format": {"rate": 44100}}}),
     "unsupported_audio_format", "session.audio.output.format.rate", "ev1"),
    (_audio_input(turn_detection={"type": "server_vad", "threshold": 1.5}), "invalid_value",
     "session.audio.input.turn_detection.threshold", "ev1"),
    (_audio_input(turn_detection={"type": "server_vad", "silence_duration_ms": "500"}),
     "invalid_type", "session.audio.input.turn_detection.silence_duration_ms", "ev1"),
    (_audio_input(turn_detection={"threshold": 0.5}), "missing_required_parameter",
     "session.audio.input.turn_detection.type", "ev1"),
    (_audio_input(turn_detection={"type": "loudness"}), "invalid_value",
     "session.audio.input.turn_detection.type", "ev1"),
    (_audio_input(turn_detection={"type": "semantic_vad"}), "unsupported_parameter",
     "session.audio.input.turn_detection.type", "ev1"),
    (_audio_input(turn_detection={"type": "server_vad", "idle_timeout_ms": 5000}),
     "unsupported_parameter", "session.audio.input.turn_detection.idle_timeout_ms", "ev1"),
    ('{"type": "conversation.item.create", "item": {"type": "message", "role": "user", '
     '"content": [{"type": "input_audio", "audio": "AAA"}]}}', "invalid_base64",
     "item.content[0].audio", None),
    ('{"type": "conversation.item.create", "item": {"type": "message", "role": "user", '
     '"content": [{"type": "input_audio"}]}}', "missing_required_parameter",
     "item.content[0].audio", None),
    ('{"type": "conversation.item.create", "item": {"type": "message", "role": "assistant", '
     '"content": [{"type": "output_audio", "transcript": "hi"}]}}', "invalid_value",
     "item.content[0].type", None),
    ('{"type": "conversation.item.create", "item": {"type": "message", "role": "user", '
     '"content": [{"type": "input_image", "image_url": "data:"}]}}', "unsupported_parameter",
     "item.content[0].type", None),
    ('{"type": "conversation.item.create", "item": {"type": "function_call", "name": "f"}}',
     "unsupported_parameter", "item.type", None),
    ('{"type": "conversation.item.create", "item": {"type": "message", "role": "robot", '
     '"content": []}}', "invalid_value", "item.role", None),
]  # fmt: skip


@pytest.mark.parametrize(("frame", "code", "param", "event_id"), BAD_FRAMES)
def test_bad_frames_become_error_events(
    frame: str | bytes, code: str, param: str | None, event_id: str | None
) -> None:
    error = ev.parse_client_event(frame)
    assert isinstance(error, ev.ProtocolError), error
    assert (error.code, error.param, error.event_id) == (code, param, event_id)
    assert error.type == "invalid_request_error"
    assert error.message
    event = ev.error_event(error)
    parsed = parse_server_event({"event_id": "event_1", **event})
    assert parsed.error.code == code  # type: ignore[attr-defined]


def test_messages_name_the_field_and_what_was_wrong() -> None:
    error = ev.parse_client_event(_session(type="realtime", colour="red"))
    assert isinstance(error, ev.ProtocolError)
    assert error.message == "Unknown parameter: 'session.colour'."
    frame = json.dumps(
        {
            "type": "conversation.item.truncate",
            "item_id": "i",
            "content_index": 0,
            "audio_end_ms": "9",
        }
    )
    error = ev.parse_client_event(frame)
    assert isinstance(error, ev.ProtocolError)
    assert error.message == (
        "Invalid type for 'audio_end_ms': expected an integer, but got a string."
    )


def test_frames_over_the_bound_are_refused_before_parsing() -> None:
    frame = json.dumps({"type": "input_audio_buffer.append", "audio": PCM * 100})
    error = ev.parse_client_event(frame, max_chars=1000)
    assert isinstance(error, ev.ProtocolError)
    assert error.code == "frame_too_large"
    assert isinstance(ev.parse_client_event(frame), ev.AudioAppend)


def test_audio_is_decoded_to_pcm_bytes() -> None:
    event = ev.parse_client_event(
        json.dumps({"type": "input_audio_buffer.append", "audio": PCM, "event_id": "x"})
    )
    assert isinstance(event, ev.AudioAppend)
    assert event.audio == b"\x00\x01" * 240 and event.event_id == "x"


def test_session_update_keeps_which_fields_were_given() -> None:
    event = ev.parse_client_event(
        _audio_input(
            format={"type": "audio/pcm", "rate": 24000},
            turn_detection=None,
            transcription={"model": "whisper-1"},
        )
    )
    assert isinstance(event, ev.SessionUpdate)
    assert event.session.audio is not None and event.session.audio.input is not None
    given = event.session.audio.input.model_fields_set
    assert "turn_detection" in given and event.session.audio.input.turn_detection is None
    assert "instructions" not in event.session.model_fields_set


def test_every_client_event_type_parses() -> None:
    frames = {
        "session.update": {"session": {"type": "realtime", "instructions": "be brief"}},
        "input_audio_buffer.append": {"audio": PCM},
        "input_audio_buffer.commit": {},
        "input_audio_buffer.clear": {},
        "conversation.item.create": {
            "previous_item_id": "root",
            "item": {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "hi"},
                    {"type": "input_audio", "audio": PCM},
                ],
            },
        },
        "conversation.item.truncate": {"item_id": "i", "content_index": 0, "audio_end_ms": 5},
        "conversation.item.delete": {"item_id": "i"},
        "conversation.item.retrieve": {"item_id": "i"},
        "response.create": {"response": {"instructions": "x", "output_modalities": ["text"]}},
        "response.cancel": {},
    }
    assert set(frames) == set(ev.CLIENT_EVENTS)
    for kind, fields in frames.items():
        event = ev.parse_client_event(json.dumps({"type": kind, **fields}))
        assert isinstance(event, ev.CLIENT_EVENTS[kind]), (kind, event)


def test_item_from_params() -> None:
    event = ev.parse_client_event(
        json.dumps(
            {
                "type": "conversation.item.create",
                "item": {
                    "type": "message",
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "hi"},
                        {"type": "input_audio", "audio": PCM},
                    ],
                },
            }
        )
    )
    assert isinstance(event, ev.ItemCreate)
    item = ev.item_from_params(event.item, "item_1")
    assert item.role == "user" and item.status == "completed"
    assert [p.type for p in item.content] == ["input_text", "input_audio"]
    assert item.content[0].text == "hi" and item.content[1].audio_ms == 10


def test_server_event_builders_parse_with_the_sdk_types() -> None:
    user = Item("item_u", "user", [Part("input_audio", audio=b"\x00\x00" * 2400)])
    spoken = Part("output_audio", transcript="hello", audio=b"\x00\x00" * 4800)
    assistant = Item("item_a", "assistant", [spoken])
    written = Part("output_text", text="hello")
    ref = ev.PartRef("resp_1", "item_a", 0, 0)
    session = {"type": "realtime", "model": "m", "output_modalities": ["audio"]}
    response = {"object": "realtime.response", "id": "resp_1", "status": "completed",
                "output": [assistant.to_json()]}  # fmt: skip
    built = [
        ev.session_created(session),
        ev.session_updated(session),
        ev.speech_started(300, "item_u"),
        ev.speech_stopped(1800, "item_u"),
        ev.buffer_committed("item_u", None),
        ev.buffer_cleared(),
        ev.item_added(user, None),
        ev.item_done(assistant, "item_u"),
        ev.item_deleted("item_u"),
        ev.item_retrieved(user),
        ev.item_truncated("item_a", 0, 120),
        ev.response_created(response),
        ev.response_done(response),
        ev.output_item_added("resp_1", 0, assistant),
        ev.output_item_done("resp_1", 0, assistant),
        ev.content_part_added(ref, spoken),
        ev.content_part_done(ref, written),
        ev.audio_delta(ref, b"\x01\x00" * 10),
        ev.audio_done(ref),
        ev.transcript_delta(ref, "he"),
        ev.transcript_done(ref, "hello"),
        ev.text_delta(ref, "he"),
        ev.text_done(ref, "hello"),
        ev.error_event(ev.ProtocolError("c", "m", "p", "e")),
    ]
    for number, event in enumerate(built):
        parse_server_event({"event_id": f"event_{number}", **event})
    retrieved = parse_server_event({"event_id": "e", **ev.item_retrieved(user)})
    audio = retrieved.item.content[0].audio  # type: ignore[attr-defined]
    assert base64.b64decode(audio) == b"\x00\x00" * 2400
