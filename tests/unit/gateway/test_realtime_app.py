"""`/v1/realtime` mounted in the gateway app, as `omnirail gateway` stacks it (request
counting, bearer tokens, the app), under a real uvicorn on 127.0.0.1 with a fake mesh
client: pipelines without `api.openai.realtime` refuse the handshake with 404, tokens are
checked, sessions and refusals are counted, the session limit comes from the config, and
a session's conversation is closed in the mesh when it ends."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from omnirail.client.sdk import Chunk, GenerateResult
from omnirail.config import PipelineConfig, load_pipeline
from omnirail.gateway.app import create_app
from omnirail.gateway.asgi import CountRequests
from omnirail.gateway.mesh import Gateway
from omnirail.gateway.server import TokenAuth
from omnirail.transport.security import SecretSet
from tests.unit.gateway.realtime.sdk_types import parse_server_event
from tests.unit.gateway.test_realtime_mesh import FakeClient

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("websockets") is None, reason="needs the realtime extra (websockets)"
)
ROOT = Path(__file__).resolve().parents[3]
QWEN = load_pipeline(ROOT / "omnirail/models/qwen3_omni/pipeline.yaml", resolve=False)
DEMO = load_pipeline(ROOT / "omnirail/models/omni_demo/pipeline.yaml", resolve=False)
TOKEN = "s3cret"
WAIT = 30.0


def _limited(pipeline: PipelineConfig, max_sessions: int) -> PipelineConfig:
    data = pipeline.model_dump(mode="json", exclude_unset=True)
    data["api"]["openai"]["realtime"] = {"max_sessions": max_sessions}
    return PipelineConfig.model_validate(data)


class Served:
    def __init__(self, port: int, gateway: Gateway, clients: list[FakeClient]) -> None:
        self.url = f"ws://127.0.0.1:{port}/v1/realtime"
        self.http = f"http://127.0.0.1:{port}"
        self.gateway = gateway
        self.clients = clients

    def metric(self, name: str, **labels: str) -> float:
        text = generate_latest(self.gateway.metrics.registry).decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and sample.labels == labels:
                    return sample.value
        return 0.0


@contextlib.asynccontextmanager
async def _serve(pipeline: PipelineConfig, events: list[Any]) -> AsyncIterator[Served]:
    clients: list[FakeClient] = []

    def connect() -> Any:
        clients.append(FakeClient(events))
        return clients[-1]

    gateway = Gateway(pipeline, connect)
    app = CountRequests(
        TokenAuth(create_app(gateway), SecretSet([TOKEN.encode()])), gateway.metrics
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            assert not task.done(), "uvicorn did not start"
            await asyncio.sleep(0.01)
        yield Served(sock.getsockname()[1], gateway, clients)
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, WAIT)
        sock.close()


async def _refused(url: str, **options: Any) -> tuple[int, dict[str, Any]]:
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    with pytest.raises(InvalidStatus) as info:
        async with connect(url, **options):
            pass
    response = info.value.response
    return response.status_code, json.loads(response.body or b"{}")


async def _recv(ws: Any) -> dict[str, Any]:
    event = json.loads(await asyncio.wait_for(ws.recv(), WAIT))
    parse_server_event(event)
    return event


async def test_a_pipeline_without_realtime_refuses_the_handshake_with_404() -> None:
    async with _serve(DEMO, []) as served:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        status, body = await _refused(served.url, additional_headers=auth)
        assert status == 404
        assert body["error"]["code"] == "realtime_not_served"
        assert "declares no api.openai.realtime" in body["error"]["message"]
        assert served.metric("omnirail_gateway_realtime_refused_total", reason="not_served") == 1
        assert (
            served.metric("omnirail_gateway_requests_total", route="/v1/realtime", code="404") == 1
        )


async def test_tokens_sessions_limits_and_metrics() -> None:
    from websockets.asyncio.client import connect

    events = [
        Chunk("rid", "decode", 0, "text", "Hi"),
        GenerateResult("rid", {"decode": {"text": "Hi", "token_ids": [1]}}),
    ]
    async with _serve(_limited(QWEN, 1), events) as served:
        status, body = await _refused(served.url)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert served.metric("omnirail_gateway_realtime_refused_total", reason="unauthenticated")

        auth = {"Authorization": f"Bearer {TOKEN}"}
        async with connect(served.url + "?model=qwen3-omni", additional_headers=auth) as ws:
            created = await _recv(ws)
            assert created["type"] == "session.created"
            assert created["session"]["model"] == "qwen3-omni"
            assert served.metric("omnirail_gateway_realtime_sessions") == 1

            # One session at most: the next is told so, then closed.
            async with connect(served.url, additional_headers=auth) as other:
                error = await _recv(other)
                assert error["error"]["code"] == "session_limit_reached"
            assert served.metric(
                "omnirail_gateway_realtime_refused_total", reason="session_limit_reached"
            )

            item = {"type": "message", "role": "user",
                    "content": [{"type": "input_text", "text": "hello"}]}  # fmt: skip
            await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
            await ws.send(json.dumps({"type": "response.create"}))
            kinds: list[str] = []
            while not kinds or kinds[-1] != "response.done":
                event = await _recv(ws)
                kinds.append(event["type"])
            assert event["response"]["status"] == "completed"
            assert "response.output_audio_transcript.delta" in kinds
            (client,) = served.clients
            (call,) = client.calls
            assert call["conversation_id"].startswith("conv_")
            assert call["inputs"]["messages"] == [
                {"role": "user", "content": [{"type": "text", "text": "hello"}]}
            ]

        async def closed() -> None:
            while client.closed_conversations != [call["conversation_id"]]:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(closed(), WAIT)
        assert served.metric("omnirail_gateway_realtime_sessions") == 0
        assert served.metric("omnirail_gateway_realtime_sessions_opened_total") == 1
        counted = served.metric("omnirail_gateway_requests_total", route="/v1/realtime", code="101")
        assert counted == 2  # the session and the one refused after accepting
