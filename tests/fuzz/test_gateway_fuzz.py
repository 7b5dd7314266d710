"""Fuzzing the OpenAI HTTP gateway of a real mesh (the omni demo with `--http`).

Each example is one HTTP request on a keep-alive connection: chat completion and speech
bodies near what clients send (messages with random roles and content parts, modalities,
audio options, token limits, seeds, temperatures, streaming), JSON of any shape, bytes
that are not JSON, and random paths and methods. What may come back: 200 (a whole answer,
or a stream ending with its end event or an error event), or 400 / 404 / 405 / 413 / 429
with OpenAI's error object; never a 5xx, never a hang, never a dropped connection.
Afterwards nothing is in flight and the gateway serves on.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from omnirail.client.sdk import Client
from omnirail.models.omni_demo import pipeline_file
from omnirail.ops.launcher import Mesh
from tests.integration.conftest import wait_nothing_in_flight

pytestmark = pytest.mark.timeout(1500)
ALLOWED = {200, 400, 404, 405, 413, 429}
MODEL = "omni-demo"
# A 1x1 PNG, for image parts that decode.
PNG = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AA"
    "AAMBAQDJ/pLvAAAAAElFTkSuQmCC"
)


@pytest.fixture(scope="module")
def mesh() -> Iterator[Mesh]:
    with Mesh(pipeline_file(), http="127.0.0.1:0") as running:
        yield running


class Connection:
    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.host, self.port = host, int(port)
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=60)

    def send(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        headers = {"Content-Type": "application/json"}
        self.conn.request(method, path, body, headers)
        response = self.conn.getresponse()
        return response.status, response.read()


@pytest.fixture(scope="module")
def connection(mesh: Mesh) -> Connection:
    return Connection(mesh.http_address or "")


leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=12)
)
json_values = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
parts = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20) | json_values}),
    st.fixed_dictionaries(
        {
            "type": st.just("image_url"),
            "image_url": st.fixed_dictionaries(
                {
                    "url": st.sampled_from([PNG, "data:image/png;base64,xx", "https://a/b"])
                    | st.text(max_size=20)
                }
            ),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("input_audio"),
            "input_audio": st.fixed_dictionaries(
                {"data": st.text(max_size=16), "format": st.sampled_from(["wav", "mp3"])}
            ),
        }
    ),
    st.dictionaries(st.sampled_from(["type", "text", "x"]), json_values, max_size=2),
)
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "user", "system", "assistant", "developer", "tool"])
            | json_values,
            "content": st.text(min_size=1, max_size=30) | st.lists(parts, max_size=2) | json_values,
        }
    ),
    max_size=3,
)
chat_bodies = st.fixed_dictionaries(
    {"model": st.sampled_from([MODEL] * 8 + ["gpt-4o"]) | json_values, "messages": messages},
    optional={
        # Small limits: every valid request is a few thinker steps, not a story.
        "max_tokens": st.integers(-2, 4) | json_values,
        "max_completion_tokens": st.integers(0, 4),
        "seed": st.integers(-5, 2**70) | json_values,
        "temperature": st.floats(-1, 3) | st.integers(-2, 10**30),
        "stream": st.booleans() | json_values,
        "modalities": st.lists(st.sampled_from(["text", "audio", "video"]), max_size=2)
        | json_values,
        "audio": st.fixed_dictionaries(
            {
                "voice": st.sampled_from(["default", "alloy"]),
                "format": st.sampled_from(["wav", "pcm16", "mp3"]),
            }
        )
        | json_values,
        "n": st.integers(0, 3),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
    },
)
speech_bodies = st.fixed_dictionaries(
    {
        "model": st.sampled_from([MODEL] * 8 + ["tts-1"]),
        "input": st.text(max_size=20) | json_values,
    },
    optional={
        "voice": st.sampled_from(["default", "nova"]) | json_values,
        "response_format": st.sampled_from(["wav", "pcm", "pcm16", "mp3"]) | json_values,
        "speed": st.sampled_from([1, 1.0, 2]) | json_values,
        "stream_format": st.sampled_from(["audio", "sse", "x"]),
    },
)


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, str, bytes]:
    kind = draw(st.sampled_from(["chat"] * 6 + ["speech"] * 2 + ["json", "bytes", "path"]))
    if kind == "chat":
        body = draw(chat_bodies)
        if isinstance(body.get("modalities"), list) and "audio" in body["modalities"]:
            body["max_tokens"] = 2  # audio for a story would take a while
        return "POST", "/v1/chat/completions", json.dumps(body).encode()
    if kind == "speech":
        # The toy model answers the prompt at the pipeline's default length: a few of these.
        return "POST", "/v1/audio/speech", json.dumps(draw(speech_bodies)).encode()
    if kind == "json":
        path = draw(st.sampled_from(["/v1/chat/completions", "/v1/audio/speech"]))
        return "POST", path, json.dumps(draw(json_values)).encode()
    if kind == "bytes":
        path = draw(st.sampled_from(["/v1/chat/completions", "/v1/audio/speech"]))
        return "POST", path, draw(st.binary(max_size=64))
    method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE"]))
    path = "/" + draw(st.text(alphabet="abcv1/-_.%", max_size=20))
    return method, path, b""


def _check(status: int, body: bytes, case: Any) -> None:
    assert status in ALLOWED, f"{status} {body[:300]!r} for {case!r:.400}"
    if status != 200:
        error = json.loads(body)["error"]
        assert error["message"] and error["type"], body
    elif body.startswith(b"data: "):  # a stream: ends with its end event or an error event
        ends = (b"data: [DONE]", b'data: {"type":"speech.audio.done"}')
        assert body.rstrip().endswith(ends) or b'"error"' in body, body[-300:]


@given(cases())
def test_the_gateway_answers_only_with_openai_errors(
    connection: Connection, case: tuple[str, str, bytes]
) -> None:
    method, path, body = case
    try:
        status, reply = connection.send(method, path, body)
    except (http.client.HTTPException, OSError):
        # The gateway closed the connection: that must not happen for any input.
        connection.conn.close()
        raise
    _check(status, reply, case)


def test_after_the_campaign_nothing_is_in_flight(mesh: Mesh, connection: Connection) -> None:
    with Client(mesh.address or "", timeout=60) as client:
        wait_nothing_in_flight(client, timeout=60)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "still?"}], "max_tokens": 2}
    status, reply = connection.send("POST", "/v1/chat/completions", json.dumps(body).encode())
    assert status == 200 and json.loads(reply)["choices"][0]["message"]["content"]
