"""The Realtime API of `omnirail serve` as users reach it: a tiny Qwen3-Omni checkpoint
served detached with the gateway (`--http`, a bearer token), driven by the official
`openai` SDK's realtime client over a real WebSocket.

- A spoken conversation of three turns (synthetic speech Silero takes for speech, in
  20-100 ms appends, each turn ended by the server VAD) is answered in transcript and
  audio; the same conversation through `/v1/chat/completions` (the audio the server
  committed, as 16 kHz WAV by the exactness rule, and the transcripts received) gives the
  same text and the same pcm16 samples for every turn; the thinker reused its KV cache
  for turns 2 and 3 and dropped it when the session closed.
- Barge-in: speech during an answer cancels it within 200 ms of `speech_started`, nothing
  stays in flight in the mesh, the answer keeps the audio the client got, and once the
  client truncates it to what it played, the next turn's history holds the cut transcript
  (checked against the chat API).
- Protocol errors come back as `error` events on a socket that stays open; the session
  limit and the token hold at the handshake.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest

pytest.importorskip("transformers")
if importlib.util.find_spec("silero_vad") is None:  # found, not imported: its import
    # sets torch's thread count for the whole process (the VAD never imports it)
    pytest.skip("needs the realtime extra (silero-vad)", allow_module_level=True)
pytest.importorskip("websockets")
openai = pytest.importorskip("openai")

from websockets.exceptions import ConnectionClosed, InvalidStatus  # noqa: E402

from omnirail.client.sdk import Client  # noqa: E402
from omnirail.gateway.audio import wav  # noqa: E402
from omnirail.gateway.realtime.audio import float_to_pcm16, model_pcm16, ms_to_samples  # noqa: E402
from omnirail.gateway.realtime.items import truncate_transcript  # noqa: E402
from omnirail.ops.launcher import read_states  # noqa: E402
from omnirail.testing.speech import silence, speech  # noqa: E402
from tests.integration.conftest import delta_pieces, explain, omnirail, scrape  # noqa: E402
from tests.unit.gateway.realtime.sdk_types import parse_server_event  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NAME = "realtime-it"
MODEL = "qwen3-omni"
MAX_SESSIONS = 2
# Answers stay short (the suite's time); the talker's are long enough to barge into.
SETS = [
    "stages.preprocessing.factory_args.max_new_tokens=12",
    "stages.talker.factory_args.max_new_tokens=64",
    f"api.openai.realtime.max_sessions={MAX_SESSIONS}",
]
WAIT = 120.0  # seconds: only reached when something is broken
BARGE_IN_S = 0.2


# -- the served mesh -----------------------------------------------------------------------------


@dataclass
class Served:
    http: str
    address: str
    token: str

    @property
    def ws(self) -> str:
        return self.http.replace("http://", "ws://", 1)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("realtime") / "tiny"
    proc = subprocess.run(
        [sys.executable, "-m", "omnirail.testing.tiny", "qwen3-omni", str(where)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, explain(proc)
    return where


@pytest.fixture(scope="module")
def served(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    token = "rt-" + secrets.token_hex(12)
    tokens = tmp_path_factory.mktemp("tokens") / "tokens"
    tokens.write_text(f"{token}\n")
    sets = [arg for s in SETS for arg in ("--set", s)]
    proc = omnirail(
        "serve", str(tiny_dir), "--detach", "--name", NAME, "--http", "127.0.0.1:0",
        "--tokens-file", str(tokens), *sets,
    )  # fmt: skip
    assert proc.returncode == 0, explain(proc)
    try:
        state = read_states()[NAME]
        yield Served(str(state["http"]), str(state["address"]), token)
    finally:
        down = omnirail("down", "--name", NAME)
        assert down.returncode == 0, explain(down)


# -- a realtime connection, read continuously ---------------------------------------------------


class Realtime:
    """An SDK connection whose server events a task reads as they come, each checked
    against the SDK's types and stamped with its arrival time."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        self.sent = bytearray()  # every audio byte appended, the session's timeline
        self._events: asyncio.Queue[tuple[float, dict[str, Any]] | BaseException] = asyncio.Queue()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            while True:
                raw = await self.connection.recv_bytes()
                arrived = time.perf_counter()
                event = json.loads(raw)
                parse_server_event(event)
                self._events.put_nowait((arrived, event))
        except BaseException as exc:  # the socket closed: the next read says so
            self._events.put_nowait(exc)
            raise

    async def next(self) -> tuple[float, dict[str, Any]]:
        got = await asyncio.wait_for(self._events.get(), WAIT)
        if isinstance(got, BaseException):
            raise AssertionError(f"the connection ended: {got!r}")
        return got

    async def until(self, kind: str) -> list[dict[str, Any]]:
        """Events up to and including the next one of type `kind`."""
        events = []
        while True:
            _, event = await self.next()
            events.append(event)
            if event["type"] == kind:
                return events

    async def append(self, pcm: bytes, chunks_ms: tuple[int, ...] = (20, 40, 100)) -> None:
        """Appends `pcm` in pieces of the given lengths, in turn (the SDK's helper)."""
        at, turn = 0, 0
        while at < len(pcm):
            size = ms_to_samples(chunks_ms[turn % len(chunks_ms)]) * 2
            piece = pcm[at : at + size]
            await self.connection.input_audio_buffer.append(audio=base64.b64encode(piece).decode())
            self.sent += piece
            at, turn = at + size, turn + 1

    async def retrieve(self, item_id: str) -> dict[str, Any]:
        await self.connection.conversation.item.retrieve(item_id=item_id)
        (*_, retrieved) = await self.until("conversation.item.retrieved")
        return retrieved["item"]

    async def close(self) -> None:
        self._reader.cancel()
        await asyncio.wait({self._reader})


def sdk(served: Served, key: str | None = None) -> Any:
    """The official SDK's client of the served gateway (HTTP and WebSocket)."""
    return openai.AsyncOpenAI(
        api_key=key or served.token,
        base_url=f"{served.http}/v1",
        websocket_base_url=f"{served.ws}/v1",
        max_retries=0,
    )


@asynccontextmanager
async def realtime(served: Served, key: str | None = None) -> AsyncIterator[Realtime]:
    async with sdk(served, key) as client, client.realtime.connect(model=MODEL) as connection:
        rt = Realtime(connection)
        try:
            _, created = await rt.next()
            assert created["type"] == "session.created", created
            yield rt
        finally:
            await rt.close()


def of(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == kind]


def utterance(seed: int, seconds: float = 1.2) -> bytes:
    """A spoken turn: a moment of silence, speech, then silence the VAD ends it on."""
    return float_to_pcm16(np.concatenate([silence(0.3), speech(seconds, seed=seed), silence(0.9)]))


@dataclass
class Turn:
    user: bytes  # the pcm16 the server committed (24 kHz)
    transcript: str
    audio: bytes  # the pcm16 received (24 kHz)


async def spoken_turn(rt: Realtime, seed: int) -> tuple[Turn, list[dict[str, Any]]]:
    """One turn ended by the server VAD and answered; checks the events it takes."""
    await rt.append(utterance(seed))
    events = await rt.until("response.done")
    kinds = [e["type"] for e in events]
    for kind in (
        "input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed", "response.created",
        "response.output_audio_transcript.delta", "response.output_audio.delta",
    ):  # fmt: skip
        assert kind in kinds, (kind, kinds)
    assert kinds.index("input_audio_buffer.committed") < kinds.index("response.created")
    done = events[-1]["response"]
    assert done["status"] == "completed", done["status_details"]
    user = await committed_audio(rt, events)
    transcript = "".join(e["delta"] for e in of(events, "response.output_audio_transcript.delta"))
    audio = b"".join(
        base64.b64decode(e["delta"]) for e in of(events, "response.output_audio.delta")
    )
    assert done["output"][0]["content"][0]["transcript"] == transcript
    return Turn(user, transcript, audio), events


async def committed_audio(rt: Realtime, events: list[dict[str, Any]]) -> bytes:
    """The user turn's audio as the server keeps it (retrieved), checked to be the audio
    sent between the VAD's bounds."""
    (started,) = of(events, "input_audio_buffer.speech_started")
    (stopped,) = of(events, "input_audio_buffer.speech_stopped")
    (committed,) = of(events, "input_audio_buffer.committed")
    item = await rt.retrieve(committed["item_id"])
    (part,) = item["content"]
    pcm = base64.b64decode(part["audio"])
    begin = ms_to_samples(started["audio_start_ms"]) * 2
    end = ms_to_samples(stopped["audio_end_ms"]) * 2
    assert pcm == bytes(rt.sent[begin:end])
    return pcm


# -- the chat API and the mesh's figures ---------------------------------------------------------


def chat_history(turns: list[Turn], user: bytes) -> list[dict[str, Any]]:
    """A realtime conversation as chat messages: each user turn as 16 kHz WAV of the audio
    the model heard (`model_pcm16`), each answer's transcript (a blank one left out, as
    the realtime gateway leaves it out)."""
    messages: list[dict[str, Any]] = []
    for turn in [*turns, Turn(user, "", b"")]:
        data = base64.b64encode(wav(model_pcm16(turn.user, 16000), 16000)).decode()
        part = {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}
        messages.append({"role": "user", "content": [part]})
        if turn.transcript.strip():
            messages.append({"role": "assistant", "content": turn.transcript})
    return messages


async def chat(served: Served, messages: list[dict[str, Any]]) -> tuple[str, bytes]:
    """The streamed chat completion's text and pcm16 audio (24 kHz)."""
    text, audio = [], bytearray()
    async with sdk(served) as client:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            modalities=["text", "audio"],
            audio={"voice": "ethan", "format": "pcm16"},
            stream=True,
        )
        async for chunk in stream:
            piece, data = delta_pieces(chunk)
            text.append(piece)
            audio += data
    return "".join(text), bytes(audio)


class Mesh:
    """The served mesh's figures: replicas in flight, and Prometheus samples."""

    def __init__(self, served: Served) -> None:
        self.client = Client(served.address, token=served.token, timeout=30)
        info = self.client.describe()
        self.coordinator = info.metrics_address
        self.thinker = next(s for s in info.stages if s.name == "thinker").replicas[0]
        self.gateway = served.http.removeprefix("http://")

    def inflight(self) -> list[tuple[str, int]]:
        return [
            (s.name, r.inflight) for s in self.client.describe().stages for r in s.replicas
            if r.inflight
        ]  # fmt: skip

    def value(self, where: str, name: str, **labels: str) -> float:
        address = {"coordinator": self.coordinator, "thinker": self.thinker.metrics_address,
                   "gateway": self.gateway}[where]  # fmt: skip
        return scrape(address).get((name, tuple(sorted(labels.items()))), 0.0)

    def turns(self) -> tuple[float, float]:
        """The thinker's conversation turns: (reused their kept state, rebuilt it)."""
        name = "omnirail_conversation_turns_total"
        return (
            self.value("thinker", name, stage="thinker", state="reused"),
            self.value("thinker", name, stage="thinker", state="rebuilt"),
        )

    def closed(self) -> float:
        name = "omnirail_conversation_evictions_total"
        return self.value("thinker", name, stage="thinker", reason="closed")

    def close(self) -> None:
        self.client.close()


@pytest.fixture
def mesh(served: Served) -> Iterator[Mesh]:
    made = Mesh(served)
    yield made
    made.close()


async def eventually(condition: Any, what: str, timeout: float = 15.0) -> float:
    """Seconds until `condition()` held (polled off the loop)."""
    start = time.perf_counter()
    while not await asyncio.to_thread(condition):
        assert time.perf_counter() - start < timeout, f"not within {timeout:g}s: {what}"
        await asyncio.sleep(0.05)
    return time.perf_counter() - start


def assert_same_audio(got: bytes, want: bytes, what: str) -> None:
    a, b = np.frombuffer(got, "<i2"), np.frombuffer(want, "<i2")
    if a.shape == b.shape and np.array_equal(a, b):
        return
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    raise AssertionError(
        f"{what}: {len(a)} vs {len(b)} samples; {len(differ)} of the first {n} differ"
        + (f", first at {differ[0]}, by up to {np.abs(a[:n] - b[:n]).max()}" if len(differ) else "")
    )


# -- the tests -----------------------------------------------------------------------------------


async def test_a_spoken_conversation_equals_the_chat_api(served: Served, mesh: Mesh) -> None:
    reused, rebuilt = await asyncio.to_thread(mesh.turns)
    closed = await asyncio.to_thread(mesh.closed)
    turns: list[Turn] = []
    async with realtime(served) as rt:
        for seed in (1, 2, 3):
            turn, _ = await spoken_turn(rt, seed)
            assert turn.transcript and turn.audio
            turns.append(turn)
        # Every turn after the first found the thinker's KV cache of the one before.
        assert await asyncio.to_thread(mesh.turns) == (reused + 2, rebuilt + 1)

    # The session's end closes its conversation: the thinker drops what it kept.
    await eventually(lambda: mesh.closed() == closed + 1, "the conversation closed")
    state = await asyncio.to_thread(
        mesh.value, "thinker", "omnirail_conversation_states", stage="thinker"
    )
    assert state == 0

    for index, turn in enumerate(turns):
        text, audio = await chat(served, chat_history(turns[:index], turn.user))
        assert text == turn.transcript, f"turn {index + 1}"
        assert_same_audio(turn.audio, audio, f"turn {index + 1}")


async def test_barge_in_cancels_at_once_and_the_history_keeps_what_was_heard(
    served: Served, mesh: Mesh
) -> None:
    aborted = await asyncio.to_thread(
        mesh.value, "coordinator", "omnirail_requests_total", state="aborted"
    )
    reused, rebuilt = await asyncio.to_thread(mesh.turns)
    async with realtime(served) as rt:
        await rt.append(utterance(4))
        opening = await rt.until("response.output_audio.delta")
        (created,) = of(opening, "response.created")
        answer = created["response"]["id"]
        heard_text = "".join(
            e["delta"] for e in of(opening, "response.output_audio_transcript.delta")
        )
        heard_audio = bytearray(base64.b64decode(opening[-1]["delta"]))

        # The user speaks over the answer: 200 ms of speech, in 20 ms appends.
        interruption = float_to_pcm16(speech(1.2, seed=5))
        sent_at = time.perf_counter()
        await rt.append(interruption[: ms_to_samples(200) * 2], chunks_ms=(20,))
        started_at = done_at = None
        done: dict[str, Any] = {}
        during: list[dict[str, Any]] = []
        while done_at is None:
            arrived, event = await rt.next()
            during.append(event)
            kind = event["type"]
            if kind == "input_audio_buffer.speech_started":
                started_at = arrived
            elif kind == "response.output_audio_transcript.delta":
                heard_text += event["delta"]
            elif kind == "response.output_audio.delta":
                heard_audio += base64.b64decode(event["delta"])
            elif kind == "response.done":
                done, done_at = event["response"], arrived
        assert started_at is not None, "no speech_started before the answer ended"
        assert done["id"] == answer and done["status"] == "cancelled", done["status"]
        assert done["status_details"] == {"type": "cancelled", "reason": "turn_detected"}
        after_detection = done_at - started_at
        after_speech = done_at - sent_at
        print(
            f"\nbarge-in: response.done {after_detection * 1000:.1f} ms after speech_started "
            f"arrived, {after_speech * 1000:.1f} ms after the speech was sent"
        )
        assert after_detection <= BARGE_IN_S

        # Nothing of the cancelled answer stays in the mesh.
        settled = await eventually(lambda: not mesh.inflight(), "replicas idle")
        running = await asyncio.to_thread(mesh.value, "coordinator", "omnirail_requests_running")
        assert running == 0
        assert (
            await asyncio.to_thread(
                mesh.value, "coordinator", "omnirail_requests_total", state="aborted"
            )
            == aborted + 1
        )
        print(f"barge-in: no request in flight {settled * 1000:.0f} ms after response.done")

        # The answer keeps the audio the client got, its transcript cut by the same share.
        (kept,) = done["output"]
        assert kept["status"] == "incomplete"
        sent_cut = kept["content"][0]["transcript"]
        assert heard_text.startswith(sent_cut)
        first = await committed_audio(rt, opening)
        stored = await rt.retrieve(kept["id"])
        assert stored["content"][0]["transcript"] == sent_cut
        assert base64.b64decode(stored["content"][0]["audio"]) == bytes(heard_audio)
        # The client played only half of what it got, and says so (as the API asks).
        got_ms = len(heard_audio) // 48
        played_ms = got_ms // 2
        await rt.connection.conversation.item.truncate(
            item_id=kept["id"], content_index=0, audio_end_ms=played_ms
        )
        await rt.until("conversation.item.truncated")
        stored = await rt.retrieve(kept["id"])
        cut = stored["content"][0]["transcript"]
        assert cut == truncate_transcript(sent_cut, played_ms, got_ms)
        played = bytes(heard_audio[: ms_to_samples(played_ms) * 2])
        assert base64.b64decode(stored["content"][0]["audio"]) == played

        # The user finishes: the interruption is the next turn.
        await rt.append(interruption[ms_to_samples(200) * 2 :] + float_to_pcm16(silence(0.9)))
        events = await rt.until("response.done")
        assert events[-1]["response"]["status"] == "completed"
        second = await committed_audio(rt, [*during, *events])
        reply = "".join(e["delta"] for e in of(events, "response.output_audio_transcript.delta"))
        reply_audio = b"".join(
            base64.b64decode(e["delta"]) for e in of(events, "response.output_audio.delta")
        )

    now_reused, now_rebuilt = await asyncio.to_thread(mesh.turns)
    print(
        f"barge-in: got {got_ms} ms of audio and {len(heard_text)} characters, kept "
        f"{len(sent_cut)}; played {played_ms} ms: {cut!r} of {heard_text!r}; the thinker's "
        f"turns since: {now_reused - reused:g} reused, "
        f"{now_rebuilt - rebuilt:g} rebuilt"
    )
    # What was heard is the start of the whole answer the same history gets.
    whole_text, whole_audio = await chat(served, chat_history([], first))
    assert whole_text.startswith(heard_text)
    assert_same_audio(bytes(heard_audio), whole_audio[: len(heard_audio)], "heard answer")
    # The next turn's history held the cut answer: the chat API with it says the same.
    history = chat_history([Turn(first, cut, b"")], second)
    text, audio = await chat(served, history)
    assert text == reply
    assert_same_audio(reply_audio, audio, "the turn after barge-in")


async def test_protocol_errors_are_error_events_on_an_open_socket(
    served: Served, mesh: Mesh
) -> None:
    async def error_for(rt: Realtime, frame: dict[str, Any] | str) -> dict[str, Any]:
        raw = frame if isinstance(frame, str) else json.dumps(frame)
        await rt.connection.send_raw(raw)
        (*_, error) = await rt.until("error")
        return error["error"]

    refused = await asyncio.to_thread(
        mesh.value, "gateway", "omnirail_gateway_realtime_refused_total",
        reason="session_limit_reached",
    )  # fmt: skip
    async with realtime(served) as rt:
        error = await error_for(rt, {"type": "conversation.frobnicate", "event_id": "e1"})
        assert (error["code"], error["param"], error["event_id"]) == (
            "unknown_event_type", "type", "e1",
        )  # fmt: skip
        error = await error_for(rt, {"type": "input_audio_buffer.append", "audio": "no*base64"})
        assert (error["code"], error["param"]) == ("invalid_base64", "audio")
        odd = base64.b64encode(b"\x01\x02\x03").decode()
        error = await error_for(rt, {"type": "input_audio_buffer.append", "audio": odd})
        assert error["code"] == "invalid_audio_length"
        pcmu = {"type": "realtime", "audio": {"input": {"format": {"type": "audio/pcmu"}}}}
        error = await error_for(rt, {"type": "session.update", "session": pcmu})
        assert (error["code"], error["param"]) == (
            "unsupported_audio_format", "session.audio.input.format.type",
        )  # fmt: skip
        error = await error_for(rt, "{not json")
        assert error["code"] == "invalid_json"
        for frame in (
            {"type": "conversation.item.retrieve", "item_id": "item_nope"},
            {"type": "conversation.item.truncate", "item_id": "item_nope", "content_index": 0,
             "audio_end_ms": 10},
        ):  # fmt: skip
            error = await error_for(rt, frame)
            assert (error["code"], error["param"]) == ("item_not_found", "item_id")

        # A response while one runs is refused; the running one goes on.
        item = {"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "Hello there."}]}  # fmt: skip
        await rt.connection.send_raw(json.dumps({"type": "conversation.item.create", "item": item}))
        await rt.connection.send_raw(json.dumps({"type": "response.create"}))
        error = await error_for(rt, {"type": "response.create", "event_id": "again"})
        assert (error["code"], error["event_id"]) == (
            "conversation_already_has_active_response", "again",
        )  # fmt: skip
        events = await rt.until("response.done")
        assert events[-1]["response"]["status"] == "completed"

        # More sessions than the configured limit: told why, then closed (1013).
        async with realtime(served):
            async with sdk(served) as client, client.realtime.connect(model=MODEL) as extra:
                event = json.loads(await asyncio.wait_for(extra.recv_bytes(), WAIT))
                assert event["type"] == "error", event
                assert event["error"]["code"] == "session_limit_reached"
                with pytest.raises(ConnectionClosed) as info:
                    await asyncio.wait_for(extra.recv_bytes(), WAIT)
                assert info.value.rcvd is not None and info.value.rcvd.code == 1013

        # The session served on through all of it.
        await rt.connection.send_raw(json.dumps({"type": "input_audio_buffer.clear"}))
        await rt.until("input_audio_buffer.cleared")

    limit = await asyncio.to_thread(
        mesh.value, "gateway", "omnirail_gateway_realtime_refused_total",
        reason="session_limit_reached",
    )  # fmt: skip
    assert limit == refused + 1

    # A wrong token is refused at the handshake, as on the HTTP routes.
    with pytest.raises(InvalidStatus) as denied:
        async with realtime(served, key="not-the-token"):
            pass
    assert denied.value.response.status_code == 401
    assert json.loads(denied.value.response.body)["error"]["code"] == "invalid_api_key"
