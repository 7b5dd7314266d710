"""The session state machine with a fake responder and a scripted VAD: manual and VAD
turns, responses and their events, barge-in, truncation, refusals and bounds. Every event
is checked against the SDK's types as it is taken from the outbox."""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from omnirail.gateway.audio import pcm16
from omnirail.gateway.realtime.audio import resample
from omnirail.gateway.realtime.session import Delta, Limits, ResponseFailed, Session
from tests.unit.gateway.realtime.fakes import (
    FakeResponder,
    append,
    of,
    pcm,
    scripted,
    send,
    take,
    take_until,
    tone,
    types,
    until,
)

MANUAL = {"type": "realtime", "audio": {"input": {"turn_detection": None}}}
ASSISTANT_EVENTS = [
    "response.created",
    "response.output_item.added",
    "conversation.item.added",
    "response.content_part.added",
]


def _session(responder: FakeResponder, *script: tuple[int, str], **limits: object) -> Session:
    session = Session(
        responder, model="omni-test", limits=Limits(**limits), vad_factory=scripted(*script)
    )
    session.start()
    return session


async def _manual(responder: FakeResponder, **limits: object) -> Session:
    session = _session(responder, **limits)
    await send(session, type="session.update", session=MANUAL)
    await take(session)
    return session


def _audio(events: list[dict]) -> bytes:
    return b"".join(base64.b64decode(e["delta"]) for e in of(events, "response.output_audio.delta"))


async def test_session_created_comes_first_with_the_effective_config() -> None:
    session = _session(FakeResponder())
    (created,) = await take(session)
    assert created["type"] == "session.created"
    config = created["session"]
    assert config["model"] == "omni-test" and config["output_modalities"] == ["audio"]
    assert config["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
    assert config["audio"]["output"]["format"] == {"type": "audio/pcm", "rate": 24000}
    assert config["audio"]["input"]["turn_detection"] == {
        "type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300,
        "silence_duration_ms": 500, "create_response": True, "interrupt_response": True,
        "idle_timeout_ms": None,
    }  # fmt: skip


async def test_manual_commit_then_response() -> None:
    spoken = [tone(0.1, 16000), tone(0.15, 16000, 300)]
    responder = FakeResponder(
        [Delta("Hel", spoken[0], 16000), Delta("lo"), Delta(audio=spoken[1], sample_rate=16000)]
    )
    session = await _manual(responder)

    await append(session, pcm(50))
    await send(session, type="input_audio_buffer.commit", event_id="c1")
    (error,) = await take(session)
    assert error["error"]["code"] == "input_audio_buffer_commit_empty"
    assert error["error"]["event_id"] == "c1"
    assert "only has 50ms" in error["error"]["message"]

    await append(session, pcm(100, 50 * 24))
    await send(session, type="input_audio_buffer.commit")
    committed, added, done = await take(session)
    assert types([committed, added, done]) == [
        "input_audio_buffer.committed", "conversation.item.added", "conversation.item.done",
    ]  # fmt: skip
    user_id = committed["item_id"]
    assert committed["previous_item_id"] is None and added["item"]["id"] == user_id
    assert added["item"]["content"] == [{"type": "input_audio", "transcript": None}]

    await send(session, type="response.create")
    events = await take_until(session, "response.done")
    assert types(events)[:4] == ASSISTANT_EVENTS
    assert types(events)[-6:] == [
        "response.output_audio.done", "response.output_audio_transcript.done",
        "response.content_part.done", "response.output_item.done", "conversation.item.done",
        "response.done",
    ]  # fmt: skip
    deltas = of(events, "response.output_audio_transcript.delta")
    assert "".join(e["delta"] for e in deltas) == "Hello"
    assert of(events, "response.output_audio_transcript.done")[0]["transcript"] == "Hello"
    # The model's 16 kHz audio arrives at 24 kHz, resampled as one stream, quantized as
    # the HTTP routes quantize theirs.
    expected = pcm16(resample(np.concatenate(spoken), 16000, 24000))
    assert _audio(events) == expected
    pieces = of(events, "response.output_audio.delta")
    assert all(len(base64.b64decode(e["delta"])) <= 4800 for e in pieces)  # 100 ms at most
    done = events[-1]["response"]
    assert done["status"] == "completed" and done["output"][0]["status"] == "completed"
    assert done["output"][0]["content"] == [{"type": "output_audio", "transcript": "Hello"}]
    # The responder saw the user's whole buffer (the refused commit kept it).
    (request,) = responder.requests
    assert [i.id for i in request.items] == [user_id]
    assert request.items[0].content[0].audio == pcm(150)

    assistant_id = done["output"][0]["id"]
    await send(session, type="conversation.item.retrieve", item_id=assistant_id)
    (retrieved,) = await take(session)
    assert base64.b64decode(retrieved["item"]["content"][0]["audio"]) == expected


async def test_text_output() -> None:
    responder = FakeResponder([Delta("Hi", tone(0.1)), Delta(" there")])
    session = await _manual(responder)
    await send(
        session, type="session.update", session={"type": "realtime", "output_modalities": ["text"]}
    )
    (updated,) = await take(session)
    assert updated["session"]["output_modalities"] == ["text"]
    await send(session, type="response.create")
    events = await take_until(session, "response.done")
    assert of(events, "response.content_part.added")[0]["part"] == {"type": "text", "text": ""}
    assert "".join(e["delta"] for e in of(events, "response.output_text.delta")) == "Hi there"
    assert of(events, "response.output_text.done")[0]["text"] == "Hi there"
    assert not of(events, "response.output_audio.delta")  # audio is not asked for
    item = events[-1]["response"]["output"][0]
    assert item["content"] == [{"type": "output_text", "text": "Hi there"}]


async def test_response_create_while_one_runs_is_refused() -> None:
    responder = FakeResponder([Delta("a"), Delta("b")], gated=True)
    session = await _manual(responder)
    await send(session, type="response.create")
    (created,) = await take(session)
    await send(session, type="response.create", event_id="again")
    (error,) = await take(session)
    assert error["error"]["code"] == "conversation_already_has_active_response"
    assert error["error"]["event_id"] == "again"
    assert created["response"]["id"] in error["error"]["message"]
    responder.release(2)
    events = await take_until(session, "response.done")
    assert events[-1]["response"]["status"] == "completed"
    assert events[-1]["response"]["id"] == created["response"]["id"]
    assert len(responder.requests) == 1


async def test_response_cancel() -> None:
    responder = FakeResponder([Delta("a"), Delta("b")], gated=True)
    session = await _manual(responder)
    await send(session, type="response.cancel", event_id="x")
    (error,) = await take(session)
    assert error["error"]["code"] == "response_cancel_not_active"
    assert error["error"]["event_id"] == "x"

    await send(session, type="response.create")
    await take(session)
    await until(lambda: responder.requests)  # the responder is at work
    await send(session, type="response.cancel", response_id="resp_other")
    (error,) = await take(session)
    assert error["error"]["code"] == "response_cancel_not_active"
    await send(session, type="response.cancel")
    events = await take(session)
    done = events[-1]["response"]
    assert done["status"] == "cancelled"
    assert done["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}
    assert done["output"] == []  # nothing was made yet
    assert responder.cancelled == 1 and responder.closed == 1
    assert session.active_response is None


async def test_barge_in_cancels_and_keeps_only_the_audio_sent() -> None:
    words = [Delta(f"word{i} ", tone(0.1)) for i in range(5)]  # the fifth never comes
    responder = FakeResponder(words, gated=True)
    session = _session(responder, (100, "start"))
    await take(session)
    await send(session, type="response.create")
    responder.release(2)
    # The transport takes (sends) the first two words' audio...
    events = []
    while len(of(events, "response.output_audio.delta")) < 2:
        events += await take_until(session, "response.output_audio.delta")
    # ...and the next two are made but still queued when the user speaks.
    responder.release(2)
    await until(lambda: len(of(session.outbox.pending(), "response.output_audio.delta")) == 2)

    await append(session, pcm(200))  # the VAD hears speech at 100 ms
    events = await take(session)
    started = of(events, "input_audio_buffer.speech_started")[0]
    assert started["audio_start_ms"] == 0  # 100 - 300 ms of padding, clamped to the start
    assert not of(events, "response.output_audio.delta")  # the queued audio was dropped
    assert types(events).index("input_audio_buffer.speech_started") < types(events).index(
        "response.done"
    )
    done = events[-1]["response"]
    assert done["status"] == "cancelled"
    assert done["status_details"] == {"type": "cancelled", "reason": "turn_detected"}
    item = done["output"][0]
    assert item["status"] == "incomplete"
    # 200 of the 400 ms made were sent: the transcript keeps the same share of characters,
    # back to a whole word.
    assert item["content"][0]["transcript"] == "word0 word1"
    assert of(events, "response.output_audio_transcript.done")[0]["transcript"] == "word0 word1"
    assert responder.cancelled == 1

    await send(session, type="conversation.item.retrieve", item_id=item["id"])
    (retrieved,) = await take(session)
    assert len(base64.b64decode(retrieved["item"]["content"][0]["audio"])) == 200 * 48

    # The client heard 150 ms of it.
    await send(session, type="conversation.item.truncate", item_id=item["id"],
               content_index=0, audio_end_ms=150)  # fmt: skip
    (truncated,) = await take(session)
    assert truncated == {
        "event_id": truncated["event_id"], "type": "conversation.item.truncated",
        "item_id": item["id"], "content_index": 0, "audio_end_ms": 150,
    }  # fmt: skip
    await send(session, type="conversation.item.retrieve", item_id=item["id"])
    (retrieved,) = await take(session)
    content = retrieved["item"]["content"][0]
    assert len(base64.b64decode(content["audio"])) == 150 * 48
    assert content["transcript"] == "word0"


async def test_truncate_refusals() -> None:
    responder = FakeResponder([Delta("hello there", tone(0.2))])
    session = await _manual(responder)
    await send(session, type="response.create")
    item = (await take_until(session, "response.done"))[-1]["response"]["output"][0]
    await append(session, pcm(200))
    await send(session, type="input_audio_buffer.commit")
    user_id = (await take(session))[0]["item_id"]

    cases = [
        (dict(item_id="item_nope", content_index=0, audio_end_ms=0), "item_not_found", "item_id"),
        (dict(item_id=user_id, content_index=0, audio_end_ms=0), "invalid_value", "item_id"),
        (
            dict(item_id=item["id"], content_index=3, audio_end_ms=0),
            "invalid_value",
            "content_index",
        ),
        (
            dict(item_id=item["id"], content_index=0, audio_end_ms=201),
            "invalid_value",
            "audio_end_ms",
        ),
    ]
    for fields, code, param in cases:
        await send(session, type="conversation.item.truncate", event_id="t", **fields)
        (error,) = await take(session)
        assert (error["error"]["code"], error["error"]["param"]) == (code, param), fields
        assert error["error"]["event_id"] == "t"
    await send(session, type="conversation.item.truncate", item_id=item["id"], content_index=0,
               audio_end_ms=200)  # fmt: skip
    assert types(await take(session)) == ["conversation.item.truncated"]


async def test_speech_stop_commits_the_turn_and_responds() -> None:
    responder = FakeResponder([Delta("ok", tone(0.05))])
    session = _session(responder, (500, "start"), (1500, "stop"))
    await take(session)
    sent = pcm(2000)
    for at in range(0, 2000, 40):  # 40 ms appends
        await append(session, sent[at * 48 : (at + 40) * 48])
    events = await take_until(session, "response.done")
    assert types(events)[:5] == [
        "input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed", "conversation.item.added", "conversation.item.done",
    ]  # fmt: skip
    started, stopped, committed = events[:3]
    assert started["audio_start_ms"] == 200  # 500 ms less 300 ms of padding
    assert stopped["audio_end_ms"] == 1500
    assert started["item_id"] == stopped["item_id"] == committed["item_id"]
    assert types(events)[5:9] == ASSISTANT_EVENTS
    assert events[-1]["response"]["status"] == "completed"
    # The turn's item holds the audio from 200 ms to 1500 ms of the session's input.
    (request,) = responder.requests
    assert request.items[0].content[0].audio == sent[200 * 48 : 1500 * 48]
    assert session.buffered_ms <= 500


@pytest.mark.parametrize(("create", "interrupt"), [(False, True), (True, False)])
async def test_vad_create_and_interrupt_switches(create: bool, interrupt: bool) -> None:
    responder = FakeResponder([Delta("a", tone(0.05)), Delta("b")], gated=True)
    session = _session(responder, (100, "start"), (600, "stop"))
    detection = {"type": "server_vad", "create_response": create, "interrupt_response": interrupt}
    audio = {"input": {"turn_detection": detection}}
    await send(session, type="session.update", session={"type": "realtime", "audio": audio})
    await send(session, type="response.create")
    responder.release()
    await take_until(session, "response.output_audio.delta")
    await append(session, pcm(800))
    events = await take(session)
    cancelled = [e for e in of(events, "response.done") if e["response"]["status"] == "cancelled"]
    assert bool(cancelled) == interrupt
    if not interrupt:
        # The running response goes on; the turn's response cannot start beside it.
        errors = of(events, "error")
        assert [e["error"]["code"] for e in errors] == ["conversation_already_has_active_response"]
        responder.release()
        assert (await take_until(session, "response.done"))[-1]["response"]["status"] == "completed"
    assert len(responder.requests) == 1  # create_response=False: no second response


async def test_manual_commit_during_speech_takes_the_turn() -> None:
    session = _session(FakeResponder(), (100, "start"), (900, "stop"))
    await take(session)
    await append(session, pcm(400))
    started = (await take(session))[0]
    await send(session, type="input_audio_buffer.commit")
    committed = (await take(session))[0]
    assert committed["item_id"] == started["item_id"]
    await append(session, pcm(800))
    assert not of(await take(session), "input_audio_buffer.speech_stopped")


async def test_clear_empties_the_buffer() -> None:
    session = await _manual(FakeResponder())
    await append(session, pcm(300))
    await send(session, type="input_audio_buffer.clear")
    assert types(await take(session)) == ["input_audio_buffer.cleared"]
    await send(session, type="input_audio_buffer.commit")
    assert (await take(session))[0]["error"]["code"] == "input_audio_buffer_commit_empty"


async def test_items_create_delete_retrieve() -> None:
    session = await _manual(FakeResponder())
    user = {"type": "message", "role": "user", "id": "mine",
            "content": [{"type": "input_text", "text": "hello"}]}  # fmt: skip
    system = {
        "type": "message",
        "role": "system",
        "content": [{"type": "input_text", "text": "be kind"}],
    }
    await send(session, type="conversation.item.create", item=user)
    added, done = await take(session)
    assert added["item"]["id"] == "mine" and added["previous_item_id"] is None
    assert done["item"]["content"] == [{"type": "input_text", "text": "hello"}]
    await send(session, type="conversation.item.create", item=system, previous_item_id="root")
    added, _ = await take(session)
    assert added["previous_item_id"] is None
    assert [i.id for i in session.items] == [added["item"]["id"], "mine"]

    await send(session, type="conversation.item.create", item=system, previous_item_id="gone")
    assert (await take(session))[0]["error"]["param"] == "previous_item_id"
    await send(session, type="conversation.item.create", item=user)
    assert (await take(session))[0]["error"]["code"] == "duplicate_item_id"

    await send(session, type="conversation.item.retrieve", item_id="mine")
    assert (await take(session))[0]["item"]["content"][0]["text"] == "hello"
    await send(session, type="conversation.item.delete", item_id="mine")
    (deleted,) = await take(session)
    assert (deleted["type"], deleted["item_id"]) == ("conversation.item.deleted", "mine")
    for kind in ("conversation.item.delete", "conversation.item.retrieve"):
        await send(session, type=kind, item_id="mine")
        assert (await take(session))[0]["error"]["code"] == "item_not_found"


async def test_bounds_are_errors() -> None:
    session = await _manual(FakeResponder(), max_items=2, max_buffer_seconds=0.5)
    text = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}]}
    for _ in range(2):
        await send(session, type="conversation.item.create", item=text)
    await send(session, type="conversation.item.create", item=text)
    assert types(await take(session))[-1] == "error"
    assert session.outbox.pending() == [] and len(session.items) == 2

    await append(session, pcm(400))
    await append(session, pcm(200))
    (error,) = await take(session)
    assert error["error"]["code"] == "input_audio_buffer_full"
    assert session.buffered_ms == 400
    await send(session, type="input_audio_buffer.commit")
    assert (await take(session))[0]["error"]["code"] == "conversation_item_limit_reached"


async def test_a_failing_responder_fails_the_response() -> None:
    responder = FakeResponder([Delta("partial"), RuntimeError("the mesh fell over")])
    session = await _manual(responder)
    await send(session, type="response.create")
    done = (await take_until(session, "response.done"))[-1]["response"]
    assert done["status"] == "failed"
    assert done["status_details"]["error"]["message"] == "the mesh fell over"
    assert done["output"][0]["status"] == "incomplete"
    assert session.active_response is None


async def test_a_refusing_responder_names_its_error() -> None:
    refusal = ResponseFailed(
        "inputs.messages: too long", "invalid_argument", "invalid_request_error"
    )
    responder = FakeResponder([refusal])
    session = await _manual(responder)
    await send(session, type="response.create")
    done = (await take_until(session, "response.done"))[-1]["response"]
    assert done["status"] == "failed" and done["output"] == []
    assert done["status_details"]["error"] == {
        "type": "invalid_request_error",
        "code": "invalid_argument",
        "message": "inputs.messages: too long",
    }
    # Every response of a session is a turn of the session's one conversation.
    await send(session, type="response.create")
    await take_until(session, "response.done")
    ids = {request.conversation_id for request in responder.requests}
    assert ids == {session.conversation_id} and session.conversation_id.startswith("conv_")


async def test_close_cancels_the_running_response() -> None:
    responder = FakeResponder([Delta("a"), Delta("b")], gated=True)
    session = await _manual(responder)
    await send(session, type="response.create")
    responder.release()
    await take_until(session, "response.output_audio_transcript.delta")
    await session.close()
    assert responder.cancelled == 1 and responder.closed == 1
    await take(session)
    assert await session.outbox.get() is None
    await send(session, type="response.create")  # ignored once closed
    assert len(responder.requests) == 1


async def test_session_update_and_response_overrides() -> None:
    responder = FakeResponder([Delta("a")])
    session = await _manual(responder)
    await send(session, type="session.update", session={
        "type": "realtime", "instructions": "be brief", "max_output_tokens": 100,
        "audio": {"output": {"voice": "marin", "speed": 1.25}},
        "tools": [], "tracing": "auto",
    })  # fmt: skip
    (updated,) = await take(session)
    config = updated["session"]
    assert config["instructions"] == "be brief" and config["max_output_tokens"] == 100
    assert config["audio"]["output"]["voice"] == "marin"
    assert config["audio"]["input"]["turn_detection"] is None  # unchanged by this update
    await send(session, type="response.create", response={"instructions": "be long"})
    await take_until(session, "response.done")
    (request,) = responder.requests
    assert request.instructions == "be long" and request.voice == "marin"
    assert request.max_output_tokens == 100 and request.speed == 1.25

    await send(session, type="session.update", session={"type": "realtime", "model": "other"})
    (error,) = await take(session)
    assert (error["error"]["code"], error["error"]["param"]) == ("invalid_value", "session.model")


async def test_without_a_vad_the_session_says_so_and_goes_manual() -> None:
    def broken(config: object, origin_ms: int) -> object:
        raise RuntimeError("no silero here")

    session = Session(FakeResponder(), model="m", vad_factory=broken)  # type: ignore[arg-type]
    session.start()
    created, error = await take(session)
    assert created["type"] == "session.created"
    assert created["session"]["audio"]["input"]["turn_detection"] is None
    assert error["error"]["code"] == "vad_unavailable"


async def test_bad_frames_do_not_end_the_session() -> None:
    session = await _manual(FakeResponder([Delta("a")]))
    await session.receive("{{{")
    await session.receive(b"\x00")
    await send(session, type="nope")
    codes = [e["error"]["code"] for e in await take(session)]
    assert codes == ["invalid_json", "invalid_json", "unknown_event_type"]
    await send(session, type="response.create")
    assert (await take_until(session, "response.done"))[-1]["response"]["status"] == "completed"


async def test_event_ids_are_unique() -> None:
    responder = FakeResponder([Delta("x", tone(0.5)) for _ in range(5)])
    session = await _manual(responder)
    await send(session, type="response.create")
    events = await take_until(session, "response.done")
    other = _session(FakeResponder())
    ids = [e["event_id"] for e in events + await take(other)]
    assert len(set(ids)) == len(ids)


async def test_the_vad_can_run_off_the_event_loop() -> None:
    responder = FakeResponder([Delta("ok")])
    with ThreadPoolExecutor(1) as executor:
        session = Session(
            responder,
            model="m",
            vad_factory=scripted((100, "start"), (600, "stop")),
            vad_executor=executor,
        )
        session.start()
        for at in range(0, 800, 20):
            await append(session, pcm(20, at * 24))
        events = await take_until(session, "response.done")
    assert types(events)[:3] == [
        "session.created", "input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
    ]  # fmt: skip
