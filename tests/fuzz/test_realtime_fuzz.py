"""Fuzzing the gateway's Realtime API: client event frames against `/v1/realtime`.

The gateway app is stacked as `omnirail gateway` stacks it (request counting, bearer
tokens, the app with the Qwen3-Omni pipeline's `api`), served by uvicorn on 127.0.0.1 in
a thread, with the real Silero VAD and a fake mesh client (`FakeMesh`: it checks every
request the gateway would send the mesh, answers with text and audio chunks, and fails
the requests the real preprocessing would refuse). Each example is one WebSocket session:
a few frames drawn near what clients send (session updates, audio appends of speech,
silence and noise, commits, items, truncations, responses, cancels, with ids that hit and
miss) and garbage (JSON of any shape, text that is not JSON, binary frames), then a
marker the session must answer.

What holds: every server event is one the openai SDK's types accept (error events carry
a type, a code and a message); the socket is never closed by the server whatever came in;
every request sent to the mesh is well-formed (audio as float32 at 16 kHz in [-1, 1]);
and afterwards no session, mesh stream or conversation is held.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnirail.client.sdk import Chunk, GenerateResult
from omnirail.config import load_pipeline
from omnirail.gateway.app import create_app
from omnirail.gateway.asgi import CountRequests
from omnirail.gateway.mesh import Gateway
from omnirail.gateway.realtime.audio import float_to_pcm16
from omnirail.gateway.server import TokenAuth
from omnirail.testing.speech import silence, speech
from omnirail.transport.security import SecretSet
from omnirail.wire.errors import Code, OmniError
from tests.fuzz.conftest import EXAMPLES
from tests.unit.gateway.realtime.sdk_types import parse_server_event

websockets = pytest.importorskip("websockets")
if importlib.util.find_spec("silero_vad") is None:  # found, not imported: its import
    # sets torch's thread count for the whole process (the VAD never imports it)
    pytest.skip("needs the realtime extra (silero-vad)", allow_module_level=True)
from websockets.exceptions import ConnectionClosed, InvalidStatus  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = ROOT / "omnirail/models/qwen3_omni/pipeline.yaml"
MODEL = "qwen3-omni"
TOKEN = "fuzz-token"
WAIT = 30.0
MARK = "fuzz-mark"


class FakeMesh:
    """The mesh client as the gateway uses it. Each stream checks its request (a problem
    is recorded: the gateway sent what the mesh would choke on), refuses what Qwen3-Omni's
    preprocessing refuses (no user turn), and otherwise yields text and audio chunks,
    yielding to the loop between them so cancels land anywhere."""

    def __init__(self) -> None:
        self.opened = 0
        self.closed = 0
        self.problems: list[str] = []
        self.conversations: set[str] = set()
        self.closed_conversations: set[str] = set()

    def stream(self, inputs: dict[str, Any], **options: Any) -> AsyncIterator[Any]:
        self.opened += 1
        conversation = options.get("conversation_id")
        if conversation:
            self.conversations.add(conversation)
        return self._answer(inputs)

    async def _answer(self, inputs: dict[str, Any]) -> AsyncIterator[Any]:
        try:
            self._check(inputs)
            if not any(m["role"] == "user" for m in inputs["messages"]):
                raise OmniError(Code.INVALID_ARGUMENT, "inputs.messages: needs a user turn")
            for index in range(3):
                await asyncio.sleep(0)
                yield Chunk("rid", "decode", index, "text", f"w{index} ")
                if inputs.get("speak", True):
                    pcm = np.full(2400, 0.1 * (index + 1), np.float32)
                    yield Chunk("rid", "code2wav", index, "audio", {"pcm": pcm})
            yield GenerateResult("rid", {"decode": {"text": "w0 w1 w2 ", "token_ids": [1]}})
        finally:
            self.closed += 1

    def _check(self, inputs: dict[str, Any]) -> None:
        if set(inputs) - {"messages", "speak", "max_new_tokens"}:
            self.problems.append(f"unknown inputs {sorted(inputs)}")
        messages = inputs.get("messages")
        if not isinstance(messages, list) or not messages:
            self.problems.append(f"messages: {messages!r:.80}")
            return
        for message in messages:
            if message["role"] not in ("system", "user", "assistant") or not message["content"]:
                self.problems.append(f"message {message!r:.80}")
            for part in message["content"]:
                if part["type"] == "text":
                    if not part["text"].strip():
                        self.problems.append("a blank text part")
                    continue
                audio = part["audio"]
                if (
                    message["role"] != "user"
                    or part["sample_rate"] != 16000
                    or audio.dtype != np.float32
                    or audio.ndim != 1
                    or not audio.size
                    or not np.all(np.abs(audio) <= 1)
                ):
                    self.problems.append(f"audio part {part!r:.120}")

    async def close_conversation(self, conversation_id: str) -> None:
        self.closed_conversations.add(conversation_id)

    async def describe(self) -> Any:
        raise OmniError(Code.UNAVAILABLE, "a fake mesh")

    async def close(self) -> None:
        pass


class Served:
    """The gateway app under uvicorn in a thread of its own (its own event loop)."""

    def __init__(self) -> None:
        self.mesh = FakeMesh()
        pipeline = load_pipeline(PIPELINE, resolve=False)
        self.gateway = Gateway(pipeline, lambda: self.mesh)  # type: ignore[arg-type,return-value]
        app = create_app(self.gateway)
        stack = CountRequests(TokenAuth(app, SecretSet([TOKEN.encode()])), self.gateway.metrics)
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.server = uvicorn.Server(
            uvicorn.Config(stack, log_level="warning", ws_ping_interval=None)
        )
        self.thread = threading.Thread(
            target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])), daemon=True
        )
        self.url = f"ws://127.0.0.1:{self.sock.getsockname()[1]}/v1/realtime"

    def __enter__(self) -> Served:
        self.thread.start()
        deadline = time.monotonic() + WAIT
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(WAIT)
        self.sock.close()

    def sessions(self) -> float:
        """Realtime sessions open, as the gateway's metrics say."""
        registry = self.gateway.metrics.registry
        return registry.get_sample_value("omnirail_gateway_realtime_sessions") or 0.0


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with Served() as running:
        yield running


# -- frames --------------------------------------------------------------------------------------

SPEECH = float_to_pcm16(speech(0.4, seed=7))
QUIET = float_to_pcm16(silence(0.6))
NOISE = float_to_pcm16(np.random.default_rng(3).uniform(-0.5, 0.5, 2400).astype(np.float32))
ids = st.sampled_from(["item_a", "item_b", "resp_x", "", "x" * 80]) | st.text(max_size=6)
leaves = (
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False)
    | st.text(max_size=8)
)  # fmt: skip
json_values = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


audio_data = st.one_of(
    st.sampled_from([b64(SPEECH), b64(QUIET), b64(NOISE), b64(SPEECH[:4802]), ""]),
    st.binary(max_size=64).map(b64),
    st.text(max_size=12),  # not base64, or not whole samples
)
content_parts = st.one_of(
    st.fixed_dictionaries({"type": st.just("input_text"), "text": st.text(max_size=12)}),
    st.fixed_dictionaries({"type": st.just("output_text"), "text": st.text(max_size=12)}),
    st.fixed_dictionaries({"type": st.just("input_audio"), "audio": audio_data}),
    st.fixed_dictionaries({"type": st.sampled_from(["input_image", "output_audio", "nope"])}),
    st.dictionaries(st.sampled_from(["type", "text", "audio", "x"]), json_values, max_size=2),
)
items = st.fixed_dictionaries(
    {"type": st.sampled_from(["message"] * 5 + ["function_call"]),
     "role": st.sampled_from(["user", "user", "assistant", "system", "tool"]),
     "content": st.lists(content_parts, max_size=2)},
    optional={"id": ids, "status": st.sampled_from(["completed", "in_progress", "x"])},
)  # fmt: skip
turn_detection = st.one_of(
    st.none(),
    st.fixed_dictionaries(
        {"type": st.just("server_vad")},
        optional={
            "threshold": st.floats(-0.5, 1.5),
            "silence_duration_ms": st.integers(-10, 800),
            "prefix_padding_ms": st.integers(0, 400),
            "create_response": st.booleans(),
            "interrupt_response": st.booleans(),
        },
    ),
    st.fixed_dictionaries({"type": st.sampled_from(["semantic_vad", "other"])}),
)
sessions = st.fixed_dictionaries(
    {"type": st.sampled_from(["realtime"] * 4 + ["transcription"])},
    optional={
        "instructions": st.text(max_size=12) | st.none(),
        "output_modalities": st.sampled_from([["text"], ["audio"], ["video"], []]),
        "max_output_tokens": st.sampled_from([1, 4, "inf", 0, -1, "lots"]),
        "model": st.sampled_from([MODEL, "gpt-realtime"]),
        "audio": st.fixed_dictionaries(
            {},
            optional={
                "input": st.fixed_dictionaries(
                    {},
                    optional={
                        "format": st.fixed_dictionaries(
                            {"type": st.sampled_from(["audio/pcm", "audio/pcmu"])},
                            optional={"rate": st.sampled_from([24000, 16000])},
                        ),
                        "turn_detection": turn_detection,
                    },
                ),
                "output": st.fixed_dictionaries(
                    {},
                    optional={
                        "voice": st.sampled_from(["ethan", "alloy", ""]),
                        "speed": st.sampled_from([1.0, 1.5, 0.1, 9]),
                    },
                ),
            },
        ),
    },
)
responses = st.fixed_dictionaries(
    {},
    optional={
        "instructions": st.text(max_size=8),
        "output_modalities": st.sampled_from([["text"], ["audio"], ["text", "audio"]]),
        "max_output_tokens": st.sampled_from([2, "inf", 0]),
        "conversation": st.sampled_from(["auto", "none"]),
        "metadata": st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2),
    },
)
events = st.one_of(
    st.builds(lambda s: {"type": "session.update", "session": s}, sessions),
    st.builds(lambda a: {"type": "input_audio_buffer.append", "audio": a}, audio_data),
    st.builds(
        lambda a: {"type": "input_audio_buffer.append", "audio": a},
        st.sampled_from([b64(SPEECH), b64(QUIET)]),
    ),
    st.just({"type": "input_audio_buffer.commit"}),
    st.just({"type": "input_audio_buffer.clear"}),
    st.builds(
        lambda item, prev: {
            "type": "conversation.item.create",
            "item": item,
            **({"previous_item_id": prev} if prev is not None else {}),
        },
        items,
        st.none() | ids | st.just("root"),
    ),
    st.builds(
        lambda i, c, ms: {
            "type": "conversation.item.truncate",
            "item_id": i,
            "content_index": c,
            "audio_end_ms": ms,
        },
        ids,
        st.integers(-1, 2),
        st.integers(-5, 5000),
    ),
    st.builds(lambda i: {"type": "conversation.item.delete", "item_id": i}, ids),
    st.builds(lambda i: {"type": "conversation.item.retrieve", "item_id": i}, ids),
    st.builds(lambda r: {"type": "response.create", "response": r}, responses),
    st.just({"type": "response.create"}),
    st.builds(
        lambda r: {"type": "response.cancel", **r},
        st.fixed_dictionaries({}, optional={"response_id": ids}),
    ),
    st.builds(
        lambda t, v: {"type": t, "x": v},
        st.sampled_from(["output_audio_buffer.clear", "session.frobnicate", ""]),
        json_values,
    ),
)
with_ids = st.builds(
    lambda event, event_id: {**event, **({"event_id": event_id} if event_id else {})},
    events,
    st.none() | st.text(max_size=10),
)
# What a well-behaved client does, so that responses run (and get cancelled) often: a
# spoken turn the server VAD ends (speech, then silence), or a typed turn and a response.
SPOKEN = [
    json.dumps({"type": "input_audio_buffer.append", "audio": b64(SPEECH)}),
    json.dumps({"type": "input_audio_buffer.append", "audio": b64(QUIET)}),
]
TYPED = [
    json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}}),
    json.dumps({"type": "response.create"}),
]  # fmt: skip
frames = st.one_of(
    with_ids.map(lambda event: [json.dumps(event)]),
    with_ids.map(lambda event: [json.dumps(event)]),
    with_ids.map(lambda event: [json.dumps(event)]),
    st.sampled_from([SPOKEN, TYPED]),
    json_values.map(lambda value: [json.dumps(value)]),
    st.text(max_size=30).map(lambda text: [text]),
    st.binary(max_size=30).map(lambda data: [data]),  # a binary WebSocket frame
)
sequences = st.lists(frames, min_size=1, max_size=6).map(
    lambda runs: [f for run in runs for f in run]
)


def _check(event: dict[str, Any], case: Any) -> None:
    parse_server_event(event)
    if event["type"] == "error":
        error = event["error"]
        assert error["type"] and error["code"] and error["message"], (event, case)
        assert error["code"] != "internal_error", (event, case)  # a bug in the session


class Reader:
    """Reads a session's events, checking each, and counts its responses."""

    def __init__(self, ws: Any, case: Any) -> None:
        self.ws = ws
        self.case = case
        self.running = 0  # responses created and not done

    def next(self) -> dict[str, Any]:
        event = json.loads(self.ws.recv(timeout=WAIT))
        _check(event, self.case)
        self.running += {"response.created": 1, "response.done": -1}.get(event["type"], 0)
        return event

    def until_mark(self) -> None:
        while True:
            event = self.next()
            if event["type"] == "error" and event["error"].get("event_id") == MARK:
                return


@given(sequences, st.booleans())
@settings(max_examples=max(1, EXAMPLES // 20))
def test_every_frame_is_answered_on_an_open_socket(
    served: Served, case: list[str | bytes], wait_for_answers: bool
) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    # max_queue=None: the client's reader takes every event, read or not, so its close
    # handshake is never stuck behind events the example did not wait for.
    url = f"{served.url}?model={MODEL}"
    with connect(url, additional_headers=headers, max_size=None, max_queue=None) as ws:
        reader = Reader(ws, case)
        created = reader.next()
        assert created["type"] == "session.created", created
        for frame in case:
            ws.send(frame)
        # Frames are handled in order: once the marker's error comes, every frame before
        # it has been answered (and the socket is still open).
        marker = {"type": "conversation.item.retrieve", "item_id": "nobody", "event_id": MARK}
        ws.send(json.dumps(marker))
        reader.until_mark()
        if wait_for_answers:
            # Half the time the responses run to their end; else the client leaves mid-way.
            while reader.running:
                reader.next()
    assert not served.mesh.problems, served.mesh.problems


def test_handshakes_without_the_token_or_for_another_model(served: Served) -> None:
    with pytest.raises(InvalidStatus) as info:
        with connect(served.url):
            pass
    assert info.value.response.status_code == 401
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with connect(f"{served.url}?model=gpt-4o", additional_headers=headers) as ws:
        error = json.loads(ws.recv(timeout=WAIT))
        assert error["type"] == "error" and error["error"]["code"] == "model_not_found"
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=WAIT)


def test_afterwards_nothing_is_held(served: Served) -> None:
    mesh = served.mesh
    deadline = time.monotonic() + WAIT
    while served.sessions() or mesh.closed != mesh.opened:
        assert time.monotonic() < deadline, (served.sessions(), mesh.opened, mesh.closed)
        time.sleep(0.05)
    assert mesh.conversations <= mesh.closed_conversations
    print(f"\nrealtime fuzz: {mesh.opened} mesh requests, {len(mesh.conversations)} conversations")
    # And the gateway serves on.
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with connect(served.url, additional_headers=headers) as ws:
        assert json.loads(ws.recv(timeout=WAIT))["type"] == "session.created"
        item = {"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "still there?"}]}  # fmt: skip
        ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
        ws.send(json.dumps({"type": "response.create"}))
        while (event := json.loads(ws.recv(timeout=WAIT)))["type"] != "response.done":
            _check(event, "the last session")
        assert event["response"]["status"] == "completed"
    assert not mesh.problems
