"""The gateway's bearer tokens (TokenAuth), its --listen parsing and OpenAI's error shape."""

from __future__ import annotations

import json
from typing import Any

import pytest

from omnirail.gateway.errors import ApiError, bad, from_mesh
from omnirail.gateway.server import TokenAuth, parse_listen
from omnirail.transport.security import SecretSet
from omnirail.wire.errors import Code, OmniError

TOKENS = SecretSet([b"s3cret", b"other-token"])


async def _ok_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


async def _call(
    path: str = "/v1/models",
    authorization: bytes | None = None,
    tokens: SecretSet = TOKENS,
    kind: str = "http",
) -> tuple[int, dict[bytes, bytes], bytes]:
    headers = [(b"host", b"gw")]
    if authorization is not None:
        headers.append((b"authorization", authorization))
    scope = {"type": kind, "method": "GET", "path": path, "headers": headers}
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await TokenAuth(_ok_app, tokens)(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], dict(start["headers"]), body


def _error(body: bytes) -> dict[str, Any]:
    return json.loads(body)["error"]


# -- TokenAuth ----------------------------------------------------------------------------------


async def test_missing_header_is_401() -> None:
    status, headers, body = await _call()
    assert status == 401 and headers[b"www-authenticate"] == b"Bearer"
    assert _error(body) == {
        "message": "missing bearer token: send Authorization: Bearer <token>",
        "type": "authentication_error",
        "param": None,
        "code": "invalid_api_key",
    }


@pytest.mark.parametrize("header", [b"Bearer", b"Bearer   ", b"Basic s3cret", b"s3cret"])
async def test_malformed_header_is_missing_token(header: bytes) -> None:
    status, _, body = await _call(authorization=header)
    assert status == 401 and _error(body)["message"].startswith("missing bearer token")


async def test_wrong_token_is_401() -> None:
    status, headers, body = await _call(authorization=b"Bearer nope")
    assert status == 401 and headers[b"www-authenticate"] == b"Bearer"
    assert _error(body)["message"] == "invalid bearer token"
    assert _error(body)["code"] == "invalid_api_key"


@pytest.mark.parametrize("header", [b"Bearer s3cret", b"bearer other-token", b"BEARER  s3cret "])
async def test_right_token_passes(header: bytes) -> None:
    assert await _call(authorization=header) == (200, {}, b"ok")


@pytest.mark.parametrize("path", ["/health", "/metrics"])
async def test_probes_pass_without_a_token(path: str) -> None:
    assert (await _call(path))[0] == 200


async def test_other_paths_under_probes_need_a_token() -> None:
    assert (await _call("/health/x"))[0] == 401


async def test_no_tokens_configured_passes_everything() -> None:
    assert (await _call(tokens=SecretSet([])))[0] == 200
    assert (await _call(authorization=b"Bearer anything", tokens=SecretSet([])))[0] == 200


async def _handshake(
    headers: list[tuple[bytes, bytes]],
    subprotocols: list[str] | None = None,
    denials: bool = True,
) -> list[dict[str, Any]]:
    """What TokenAuth sends for a WebSocket handshake to `/v1/realtime` (the app accepts)."""
    scope = {
        "type": "websocket",
        "path": "/v1/realtime",
        "headers": [(b"host", b"gw"), *headers],
        "subprotocols": subprotocols or [],
        "extensions": {"websocket.http.response": {}} if denials else {},
    }
    sent: list[dict[str, Any]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "websocket.accept"})

    async def receive() -> dict[str, Any]:
        return {"type": "websocket.connect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await TokenAuth(app, TOKENS)(scope, receive, send)
    return sent


@pytest.mark.parametrize(
    ("headers", "problem"),
    [
        ([], "missing bearer token"),
        ([(b"authorization", b"Bearer nope")], "invalid bearer token"),
    ],
)
async def test_websocket_handshakes_need_a_token(
    headers: list[tuple[bytes, bytes]], problem: str
) -> None:
    start, body = await _handshake(headers)
    assert start["type"] == "websocket.http.response.start" and start["status"] == 401
    assert (b"www-authenticate", b"Bearer") in start["headers"]
    assert _error(body["body"])["message"].startswith(problem)
    assert _error(body["body"])["code"] == "invalid_api_key"


async def test_websocket_refusal_without_denial_responses_closes() -> None:
    (close,) = await _handshake([], denials=False)
    assert close["type"] == "websocket.close"  # the server answers 403


@pytest.mark.parametrize(
    ("headers", "subprotocols"),
    [
        ([(b"authorization", b"Bearer s3cret")], []),
        # Browsers cannot set headers: the key rides in a subprotocol.
        ([], ["realtime", "openai-insecure-api-key.other-token"]),
    ],
)
async def test_websocket_handshakes_with_a_token_pass(
    headers: list[tuple[bytes, bytes]], subprotocols: list[str]
) -> None:
    assert await _handshake(headers, subprotocols) == [{"type": "websocket.accept"}]


async def test_non_http_scopes_pass() -> None:
    seen: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append(scope["type"])

    await TokenAuth(app, TOKENS)({"type": "lifespan"}, None, None)
    assert seen == ["lifespan"]


# -- parse_listen -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("listen", "want"),
    [
        ("0.0.0.0:8080", ("0.0.0.0", 8080)),
        (":9000", ("127.0.0.1", 9000)),
        ("[::1]:443", ("::1", 443)),
        ("localhost:0", ("localhost", 0)),
        ("h:65535", ("h", 65535)),
    ],
)
def test_parse_listen(listen: str, want: tuple[str, int]) -> None:
    assert parse_listen(listen) == want


@pytest.mark.parametrize("listen", ["8080", "host:", "host:http", "host:65536", "host:-1"])
def test_parse_listen_refuses(listen: str) -> None:
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        parse_listen(listen)


# -- OpenAI's error shape -----------------------------------------------------------------------


def test_api_error_body() -> None:
    err = bad("n: only 1 is supported", "n")
    assert err.status == 400
    assert err.body() == {
        "error": {
            "message": "n: only 1 is supported",
            "type": "invalid_request_error",
            "param": "n",
            "code": None,
        }
    }


def test_api_error_response() -> None:
    response = ApiError(404, "gone", "model", "model_not_found").response()
    assert response.status_code == 404
    assert json.loads(bytes(response.body))["error"]["type"] == "not_found_error"


@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [
        (Code.INVALID_ARGUMENT, 400, "invalid_request_error"),
        (Code.FAILED_PRECONDITION, 400, "invalid_request_error"),
        (Code.UNAUTHENTICATED, 401, "authentication_error"),
        (Code.NOT_FOUND, 404, "not_found_error"),
        (Code.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
        (Code.CANCELLED, 499, "invalid_request_error"),
        (Code.INTERNAL, 500, "server_error"),
        (Code.UNAVAILABLE, 503, "server_error"),
        (Code.DEADLINE_EXCEEDED, 504, "server_error"),
    ],
)
def test_from_mesh_status(code: int, status: int, kind: str) -> None:
    err = from_mesh(OmniError(code, "boom"))
    assert (err.status, err.kind, err.message) == (status, kind, "boom")
    assert err.code == Code.Name(code).lower() and err.param is None


def test_from_mesh_names_the_stage() -> None:
    err = from_mesh(OmniError(Code.RESOURCE_EXHAUSTED, "queue full", stage="thinker"))
    assert err.message == "queue full (stage thinker)"
    assert err.body()["error"]["code"] == "resource_exhausted"


def test_from_mesh_unmapped_code_is_500() -> None:
    err = from_mesh(OmniError(Code.ERROR_CODE_UNSPECIFIED, "?"))
    assert (err.status, err.kind) == (500, "server_error")
