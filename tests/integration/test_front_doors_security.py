"""Both standard front doors on a secured mesh (`tls="auto"` + a tokens file): KServe v2
gRPC on the coordinator's port and the OpenAI gateway over HTTPS serve callers with TLS
and a token, and refuse the rest the way each protocol says (gRPC UNAUTHENTICATED or
UNAVAILABLE; HTTP 401 in OpenAI's error shape, or no TLS handshake)."""

from __future__ import annotations

import json
import queue
import secrets
import ssl
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from omnirail.config.security import ENV_TOKENS_FILE
from omnirail.models.omni_demo import pipeline_file
from omnirail.ops.launcher import Mesh

tritonclient = pytest.importorskip("tritonclient.grpc")
InferenceServerException = pytest.importorskip("tritonclient.utils").InferenceServerException
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")

pytestmark = pytest.mark.timeout(300)
DEMO = pipeline_file()


class Secured:
    def __init__(self, mesh: Mesh, token: str) -> None:
        self.mesh = mesh
        self.token = token
        self.ca = str(mesh.run_dir / "tls" / "ca.pem")
        self.trust = ssl.create_default_context(cafile=self.ca)


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    token = "tok-" + secrets.token_hex(16)
    tokens_file = tmp_path_factory.mktemp("tokens") / "tokens"
    tokens_file.write_text(f"{token}\n")
    mesh = Mesh(
        DEMO,
        transport="tcp",
        tls="auto",
        env={ENV_TOKENS_FILE: str(tokens_file)},
        http="127.0.0.1:0",
    )
    mesh.start(timeout=240)
    yield Secured(mesh, token)
    mesh.stop()


def _inputs() -> list[Any]:
    text = tritonclient.InferInput("text", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"hello"], dtype=object))
    n = tritonclient.InferInput("max_new_tokens", [1], "INT64")
    n.set_data_from_numpy(np.array([3], dtype=np.int64))
    return [text, n]


def _triton(secured: Secured, ssl: bool = True) -> Any:
    return tritonclient.InferenceServerClient(
        secured.mesh.address or "", ssl=ssl, root_certificates=secured.ca if ssl else None
    )


def _status(call: Any) -> str:
    with pytest.raises(InferenceServerException) as info:
        call()
    return str(info.value.status())


def test_kserve_needs_tls_and_a_token(secured: Secured) -> None:
    client = _triton(secured)
    good = {"authorization": f"Bearer {secured.token}"}
    result = client.infer("omni-demo", _inputs(), headers=good)
    assert result.as_numpy("text")[0]
    assert _status(lambda: client.infer("omni-demo", _inputs())) == "StatusCode.UNAUTHENTICATED"
    wrong = {"authorization": "Bearer not-the-token"}
    assert _status(lambda: client.infer("omni-demo", _inputs(), headers=wrong)) == (
        "StatusCode.UNAUTHENTICATED"
    )
    assert _status(lambda: client.get_model_metadata("omni-demo")) == ("StatusCode.UNAUTHENTICATED")
    plain = _triton(secured, ssl=False)
    assert _status(lambda: plain.infer("omni-demo", _inputs(), headers=good)) == (
        "StatusCode.UNAVAILABLE"
    )
    # A stream without a token is refused as a whole.
    errors: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: errors.put(error))
    try:
        client.async_stream_infer("omni-demo", _inputs())
    except InferenceServerException:
        pass  # the refusal came first: the stream is already closed
    error = errors.get(timeout=30)
    client.stop_stream()
    assert error is not None and "UNAUTHENTICATED" in str(error.status())


def _openai(secured: Secured, token: str, verify: Any = None, scheme: str = "https") -> Any:
    url = (secured.mesh.http_address or "").replace("https://", f"{scheme}://")
    return openai.OpenAI(
        base_url=f"{url}/v1",
        api_key=token,
        max_retries=0,
        timeout=30,
        http_client=openai.DefaultHttpxClient(verify=secured.trust if verify is None else verify),
    )


def test_the_gateway_needs_https_and_a_token(secured: Secured) -> None:
    assert (secured.mesh.http_address or "").startswith("https://")
    messages = [{"role": "user", "content": "hello"}]
    ok = _openai(secured, secured.token).chat.completions.create(
        model="omni-demo", messages=messages, max_tokens=3
    )
    assert ok.choices[0].message.content
    with pytest.raises(openai.AuthenticationError) as info:
        _openai(secured, "not-the-token").chat.completions.create(
            model="omni-demo", messages=messages
        )
    assert info.value.status_code == 401 and "invalid bearer token" in str(info.value)
    with pytest.raises(openai.AuthenticationError):
        _openai(secured, "not-the-token").audio.speech.create(
            model="omni-demo", voice="default", input="hi"
        )
    reply = httpx.get(f"{secured.mesh.http_address}/v1/models", verify=secured.trust, timeout=10)
    assert reply.status_code == 401 and reply.headers["www-authenticate"] == "Bearer"
    assert reply.json()["error"]["code"] == "invalid_api_key"
    # Probes need no token.
    health = httpx.get(f"{secured.mesh.http_address}/health", verify=secured.trust, timeout=10)
    assert health.status_code == 200
    # Plain HTTP to the HTTPS port, and a client that does not trust the mesh's CA.
    with pytest.raises(openai.APIConnectionError):
        _openai(secured, secured.token, scheme="http").models.list()
    with pytest.raises(openai.APIConnectionError):
        _openai(secured, secured.token, verify=True).models.list()
    logs = "".join(p.read_text() for p in (secured.mesh.run_dir / "logs").glob("*.log"))
    assert secured.token not in logs


def test_the_realtime_handshake_needs_wss_and_a_token(secured: Secured) -> None:
    """`/v1/realtime` is behind the same TLS and tokens: refused with 401 without the
    token; with it, the omni demo (no `api.openai.realtime`) answers 404 at the handshake."""
    websockets_client = pytest.importorskip("websockets.sync.client")
    from websockets.exceptions import InvalidStatus

    url = (secured.mesh.http_address or "").replace("https://", "wss://", 1) + "/v1/realtime"
    for headers, status, code in (
        ({}, 401, "invalid_api_key"),
        ({"Authorization": "Bearer not-the-token"}, 401, "invalid_api_key"),
        ({"Authorization": f"Bearer {secured.token}"}, 404, "realtime_not_served"),
    ):
        with pytest.raises(InvalidStatus) as info:
            with websockets_client.connect(url, additional_headers=headers, ssl=secured.trust):
                pass
        response = info.value.response
        assert response.status_code == status
        assert json.loads(response.body)["error"]["code"] == code
