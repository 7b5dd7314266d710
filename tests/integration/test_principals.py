"""Principals end to end: a request through the HTTP gateway is the HTTP caller's in the
coordinator's spans and metrics (the gateway forwards the principal it verified, showing
the mesh secret), a direct client's is its own token's, and a client may not name another
principal."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from omnirail.client.sdk import AsyncClient, Client
from omnirail.config.security import ENV_MESH_SECRET_FILE, ENV_TOKENS_FILE
from omnirail.models.omni_demo import pipeline_file
from omnirail.ops.launcher import Mesh
from omnirail.telemetry.export import read_span_files
from omnirail.tuning import aio
from omnirail.wire.errors import Code, OmniError
from tests.integration.test_metrics import scrape, value

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(300)
TOKENS = {name: f"tok-{name}-{secrets.token_hex(8)}" for name in ("front", "alice", "bob")}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    folder = tmp_path_factory.mktemp("principals")
    # The first token is the one the mesh's own processes (the gateway) call with.
    tokens = Path(folder, "tokens")
    tokens.write_text("".join(f"{token},{name}\n" for name, token in TOKENS.items()))
    secret = Path(folder, "mesh")
    secret.write_text(secrets.token_hex(16) + "\n")
    env = {
        ENV_TOKENS_FILE: str(tokens),
        ENV_MESH_SECRET_FILE: str(secret),
        "OTEL_SDK_DISABLED": "false",
        "OTEL_TRACES_SAMPLER": "always_on",
    }
    with Mesh(pipeline_file(), http="127.0.0.1:0", env=env) as running:
        yield running


def _request_span(mesh: Mesh, rid: str) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while True:
        spans = read_span_files(sorted(mesh.span_dir.glob("*.otlp")))
        found = [
            s
            for s in spans
            if s.get("name") == "omnirail.request"
            and s["attributes"].get("omnirail.request_id") == rid
        ]
        if found:
            return found[0]
        assert time.monotonic() < deadline, f"no omnirail.request span for {rid}"
        time.sleep(0.3)


def _completed(metrics: str, principal: str) -> float:
    return value(
        scrape(metrics), "omnirail_principal_requests_total", principal=principal, state="completed"
    )


def test_a_request_through_the_gateway_is_the_http_caller_s(mesh: Mesh) -> None:
    with Client(mesh.address or "", token=TOKENS["alice"], timeout=30) as client:
        metrics = client.describe().metrics_address
    before = {p: _completed(metrics, p) for p in TOKENS}
    oai = openai.OpenAI(
        base_url=f"{mesh.http_address}/v1", api_key=TOKENS["bob"], max_retries=0, timeout=60
    )
    reply = oai.chat.completions.with_raw_response.create(
        model="omni-demo", messages=[{"role": "user", "content": "whose am I"}], max_tokens=2
    )
    assert reply.parse().choices[0].message.content
    rid = reply.headers["x-request-id"]
    span = _request_span(mesh, rid)
    assert span["attributes"]["omnirail.principal"] == "bob"
    after = {p: _completed(metrics, p) for p in TOKENS}
    # bob's, not the gateway's own ("front"): the coordinator saw who the caller was.
    assert after["bob"] == before["bob"] + 1
    assert after["front"] == before["front"] and after["alice"] == before["alice"]
    # The gateway's own span of it names the caller too.
    deadline = time.monotonic() + 30
    while True:
        spans = read_span_files(sorted(mesh.span_dir.glob("*.otlp")))
        http = [s for s in spans if s.get("name") == "POST /v1/chat/completions"]
        mine = [s for s in http if s["attributes"].get("omnirail.request_id") == rid]
        if mine:
            assert mine[0]["attributes"]["omnirail.principal"] == "bob"
            break
        assert time.monotonic() < deadline
        time.sleep(0.3)


def test_a_direct_client_is_its_token_s_and_cannot_name_another(mesh: Mesh) -> None:
    with Client(mesh.address or "", token=TOKENS["alice"], timeout=30) as client:
        metrics = client.describe().metrics_address
        before = _completed(metrics, "alice")
        client.generate({"text": "mine", "max_new_tokens": 2}, request_id="alice-direct")
        assert _completed(metrics, "alice") == before + 1
        assert _request_span(mesh, "alice-direct")["attributes"]["omnirail.principal"] == "alice"

    async def impersonate() -> OmniError:
        async with AsyncClient(mesh.address or "", token=TOKENS["alice"], timeout=30) as c:
            with pytest.raises(OmniError) as ei:
                await c.generate({"text": "x", "max_new_tokens": 2}, on_behalf_of="bob")
            return ei.value

    error = aio.run(impersonate())
    assert error.code == Code.PERMISSION_DENIED and "on_behalf_of" in error.message
