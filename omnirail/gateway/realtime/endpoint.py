"""The `/v1/realtime` WebSocket endpoint: one `Session` per connection.

How the official SDK connects (openai 3.57, `client.realtime.connect(model=...)`): a plain
WebSocket to `{websocket_base_url}/realtime?model=...` with `Authorization: Bearer <key>`,
no subprotocol and no `OpenAI-Beta` header (GA); JSON text frames both ways. Browsers,
which cannot set headers, offer subprotocols instead: `realtime` and
`openai-insecure-api-key.<key>`; the endpoint accepts `realtime` then and takes the key
from there.

What holds:
- A caller `authenticate` refuses (it returns None) gets HTTP 401 with OpenAI's error body
  at the handshake (a 403 where the server has no denial responses); no session exists.
- A `model` query parameter other than the served model, or a connection over
  `max_sessions`, is accepted, told why in an `error` event, and closed (1008 policy,
  1013 try again later): a client sees the reason instead of a dropped TCP socket.
- Otherwise `session.created` comes first; frames are handled in order; the session's
  events are written in order by one writer task.
- When the client goes away (or the socket fails), a running response is cancelled, so
  the responder aborts its work (the mesh request); then the responder's `aclose()` (if
  it has one) is awaited, once per session.
- An `observer` hears of every session opened and closed, and of every connection
  refused after the handshake (`session_limit_reached`, `model_not_found`), for metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.responses import JSONResponse
from starlette.websockets import WebSocket

from omnirail.gateway.realtime import events as ev
from omnirail.gateway.realtime.session import (
    Limits,
    Outbox,
    Responder,
    Session,
    VadFactory,
    silero_vad,
)

log = logging.getLogger(__name__)

KEY_PROTOCOL = "openai-insecure-api-key."
CLOSE_POLICY = 1008
CLOSE_TRY_LATER = 1013


@dataclass(frozen=True)
class Caller:
    """Who a session serves: what `authenticate` returned, and the model."""

    principal: Any
    model: str


Authenticate = Callable[[str | None], Any]  # token -> principal, None to refuse (may be async)
# The ASGI scope key where a middleware that authenticated the caller puts its principal
# (the gateway's TokenAuth); sessions take it when the endpoint authenticates nobody itself.
PRINCIPAL_SCOPE_KEY = "omnirail.principal"
ResponderFactory = Callable[[Caller], Responder]


class Observer(Protocol):
    """What the endpoint reports (the gateway's metrics implement it)."""

    def session_opened(self) -> None: ...

    def session_closed(self) -> None: ...

    def session_refused(self, reason: str) -> None: ...


def realtime_endpoint(
    responder_factory: ResponderFactory,
    *,
    authenticate: Authenticate | None = None,
    max_sessions: int = 64,
    model: str = "omnirail",
    limits: Limits | None = None,
    vad_factory: VadFactory = silero_vad,
    vad_executor: Executor | None = None,
    max_frame_chars: int = ev.MAX_FRAME_CHARS,
    observer: Observer | None = None,
) -> Callable[[WebSocket], Awaitable[None]]:
    """A Starlette WebSocket route handler (`WebSocketRoute("/v1/realtime", ...)`).

    `responder_factory` makes each session's responder; `authenticate(token)` (sync or
    async) returns the caller's principal or None to refuse; without it every caller is
    let in, with the principal a middleware put at `PRINCIPAL_SCOPE_KEY` (else None).
    `vad_executor` runs the VAD off the event loop (one
    thread is plenty: 0.13 ms of CPU per 32 ms of audio per session with onnxruntime).
    """
    active = 0

    async def endpoint(websocket: WebSocket) -> None:
        nonlocal active
        offered = list(websocket.scope.get("subprotocols") or [])
        subprotocol = "realtime" if "realtime" in offered else None
        principal = websocket.scope.get(PRINCIPAL_SCOPE_KEY)
        if authenticate is not None:
            principal = authenticate(_token(websocket, offered))
            if inspect.isawaitable(principal):
                principal = await principal
            if principal is None:
                await _deny(websocket)
                return
        wanted = websocket.query_params.get("model")
        if wanted is not None and wanted != model:
            message = f"The model '{wanted[:64]}' does not exist; this server serves '{model}'."
            await _refuse(websocket, subprotocol, "model_not_found", message, CLOSE_POLICY)
            if observer is not None:
                observer.session_refused("model_not_found")
            return
        if active >= max_sessions:
            message = (
                f"This server holds {max_sessions} realtime sessions at most; try again later."
            )
            await _refuse(websocket, subprotocol, "session_limit_reached", message, CLOSE_TRY_LATER)
            if observer is not None:
                observer.session_refused("session_limit_reached")
            return
        active += 1  # no await since the check: the count cannot be passed
        if observer is not None:
            observer.session_opened()
        try:
            await websocket.accept(subprotocol)
            responder = responder_factory(Caller(principal, model))
            session = Session(
                responder,
                model=model,
                limits=limits,
                vad_factory=vad_factory,
                vad_executor=vad_executor,
                max_frame_chars=max_frame_chars,
            )
            try:
                await _serve(websocket, session)
            finally:
                await _close_responder(responder)
        finally:
            active -= 1
            if observer is not None:
                observer.session_closed()

    return endpoint


def _token(websocket: WebSocket, offered: list[str]) -> str | None:
    return offered_token(websocket.headers.get("authorization", ""), offered)


def offered_token(authorization: str, subprotocols: list[str]) -> str | None:
    """The token a WebSocket client shows: `Authorization: Bearer <token>`, or (browsers)
    the `openai-insecure-api-key.<token>` subprotocol; None when it shows none."""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    for protocol in subprotocols:
        if protocol.startswith(KEY_PROTOCOL):
            return protocol[len(KEY_PROTOCOL) :] or None
    return None


async def _deny(websocket: WebSocket) -> None:
    message = "missing or invalid bearer token: send Authorization: Bearer <token>"
    error = {"message": message, "type": "authentication_error", "param": None,
             "code": "invalid_api_key"}  # fmt: skip
    await deny(websocket, 401, {"error": error}, {"www-authenticate": "Bearer"})


async def deny(
    websocket: WebSocket,
    status: int,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> None:
    """Refuses the handshake with an HTTP answer (`status`, JSON `body`) where the server
    can send one (uvicorn with `websockets` can); elsewhere closes before accepting, which
    the server answers with 403."""
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        await websocket.send_denial_response(JSONResponse(body, status, headers=headers))
    else:
        await websocket.close(CLOSE_POLICY)


async def _refuse(
    websocket: WebSocket, subprotocol: str | None, code: str, message: str, close: int
) -> None:
    await websocket.accept(subprotocol)
    error = ev.ProtocolError(code, message, type="invalid_request_error")
    event = {"event_id": "event_refused", **ev.error_event(error)}
    with contextlib.suppress(Exception):  # the client may be gone already
        await websocket.send_text(json.dumps(event))
        await websocket.close(close, reason=code)


async def _close_responder(responder: Responder) -> None:
    close = getattr(responder, "aclose", None)
    if close is None:
        return
    try:
        await close()
    except Exception:  # the session is over either way; its state expires on its own
        log.warning("realtime: closing the session's responder failed", exc_info=True)


async def _serve(websocket: WebSocket, session: Session) -> None:
    """Runs a session until the client leaves: frames in, events out."""
    session.start()
    reader = asyncio.create_task(_read(websocket, session))
    writer = asyncio.create_task(_write(websocket, session.outbox))
    try:
        await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (reader, writer):
            task.cancel()
        await asyncio.wait({reader, writer})
        await session.close()  # cancels a running response: the responder aborts
        for task in (reader, writer):
            if not task.cancelled() and (exc := task.exception()) is not None:
                log.debug("realtime: connection ended: %r", exc)


async def _read(websocket: WebSocket, session: Session) -> None:
    while True:
        message = await websocket.receive()
        if message["type"] == "websocket.disconnect":
            return
        text = message.get("text")
        if text is None:
            error = ev.ProtocolError(
                "invalid_frame", "binary frames are not part of the Realtime API: send JSON text"
            )
            session.outbox.put(ev.error_event(error))
            continue
        await session.receive(text)


async def _write(websocket: WebSocket, outbox: Outbox) -> None:
    while (event := await outbox.get()) is not None:
        await websocket.send_text(json.dumps(event, separators=(",", ":")))
