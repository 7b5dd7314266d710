"""ASGI pieces of the gateway: a lean streamed response, request counting, body reading
and cancelling work whose client went away."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, Awaitable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from omnirail.gateway.errors import ApiError, bad
from omnirail.gateway.metrics import GatewayMetrics

MAX_BODY = 64 << 20


async def read_json(request: Request) -> Any:
    length = request.headers.get("content-length") or "0"
    if not length.isdigit() or int(length) > MAX_BODY:
        raise ApiError(413, f"request body: {length[:20]} bytes; at most {MAX_BODY}")
    data = b""
    async for piece in request.stream():
        data += piece
        if len(data) > MAX_BODY:
            raise ApiError(413, f"request body: more than {MAX_BODY} bytes")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise bad(f"request body: not valid JSON ({str(exc)[:80]})") from None


async def disconnected(receive: Any) -> None:
    """Returns when the client has gone (once the request body was read, ASGI's `receive`
    has nothing else to say)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """`work`'s result, or cancels it (aborting its mesh request) when the client leaves."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            # Its cleanup (the SDK aborting the mesh request) runs now, and only a done
            # task has a result to ask for.
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return task.result()  # CancelledError when the client went away


class EventStream(Response):
    """A streamed answer sent straight through ASGI: each piece is one body message, and a
    client that disconnects (also before the first piece) cancels the producer, whose
    `finally` aborts the request in the mesh. The first piece may raise ApiError instead.
    Starlette's StreamingResponse does the same through an anyio task group, at a few
    hundred microseconds more per answer; time to first chunk is what users feel."""

    def __init__(
        self, body: AsyncGenerator[bytes], media_type: str, headers: dict[str, str]
    ) -> None:
        # Not Response.__init__: it would render an empty body and say content-length: 0.
        self.status_code = 200
        self.media_type = media_type
        self.background = None
        self.pieces = body
        self.init_headers(headers)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def produce() -> None:
            # The first piece before the status line: a request the mesh refuses at once
            # gets its own status (400, 429, 503, ...), not a 200 with an error inside.
            try:
                first = await anext(self.pieces, b"")
            except ApiError as exc:
                await exc.response()(scope, receive, send)
                return
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            await send({"type": "http.response.body", "body": first, "more_body": True})
            async for piece in self.pieces:
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        producer = asyncio.ensure_future(produce())
        watcher = asyncio.ensure_future(disconnected(receive))
        try:
            await asyncio.wait({producer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not producer.done():
                producer.cancel()  # the client left: stop making what nobody reads
                with contextlib.suppress(asyncio.CancelledError):
                    await producer
            elif (exc := producer.exception()) is not None:
                raise exc
            close = getattr(self.pieces, "aclose", None)
            if close is not None:
                await close()


class CountRequests:
    """ASGI middleware counting answers by route and status (a pure ASGI layer: Starlette's
    `BaseHTTPMiddleware` would relay every streamed chunk through a task of its own).

    A WebSocket handshake counts as a request too: 101 when accepted, else the status of
    its refusal (a denial response's, or 403 for a close before accepting); a refused
    `/v1/realtime` handshake also counts as a refused realtime session (401:
    unauthenticated, 404: not_served)."""

    def __init__(self, app: Any, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()

        async def counted(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                seconds = time.perf_counter() - start
                self.metrics.request(scope["path"], message["status"], seconds)
            await send(message)

        await self.app(scope, receive, counted)

    async def _websocket(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        start = time.perf_counter()
        answered = False

        async def counted(message: dict[str, Any]) -> None:
            nonlocal answered
            if not answered:
                kind = message["type"]
                code = {"websocket.accept": 101, "websocket.close": 403}.get(kind)
                if kind == "websocket.http.response.start":
                    code = message["status"]
                if code is not None:
                    answered = True
                    self.metrics.request(scope["path"], code, time.perf_counter() - start)
                    if scope["path"] == "/v1/realtime" and code != 101:
                        reason = {401: "unauthenticated", 404: "not_served"}.get(code, "other")
                        self.metrics.session_refused(reason)
            await send(message)

        await self.app(scope, receive, counted)
