"""The gateway's ASGI app: OpenAI routes over one mesh client.

Each HTTP request becomes one mesh request over the client's Session stream (`stream()`:
chunks as the terminal stages make them, then the result). The first event is awaited
before the HTTP status is sent, so a request the mesh refuses gets a real 4xx/5xx rather
than a 200 with an error inside; from then on chunks go out as they come. A client that
disconnects cancels its request through the mesh (the SDK aborts what its caller stopped
reading), streamed or not.

`/v1/realtime` is the OpenAI Realtime API over WebSocket (`realtime_mesh`: each response a
mesh request, a turn of the session's conversation) where the pipeline declares
`api.openai.realtime`; elsewhere its handshake is refused with 404 and OpenAI's error body.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from omnirail.gateway.answers import chat_stream, chat_whole, end_span, speech_stream
from omnirail.gateway.asgi import EventStream, read_json, until_disconnect
from omnirail.gateway.audio import FORMATS
from omnirail.gateway.errors import ApiError
from omnirail.gateway.mesh import Gateway
from omnirail.gateway.realtime.endpoint import PRINCIPAL_SCOPE_KEY, deny, realtime_endpoint
from omnirail.gateway.realtime.session import Limits
from omnirail.gateway.realtime_mesh import responder_factory
from omnirail.telemetry.tracer import KIND_SERVER, Span, Tracer, parse_traceparent
from omnirail.wire.errors import OmniError


def create_app(gateway: Gateway) -> Starlette:
    metrics = gateway.metrics

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.close()

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return exc.response()

    async def health(request: Request) -> Response:
        assert gateway.client is not None
        try:
            info = await gateway.client.describe()
        except OmniError as exc:
            return JSONResponse({"status": "unavailable", "reason": exc.message}, 503)
        if not info.ready:
            return JSONResponse({"status": "starting", "reason": "stages not all live"}, 503)
        return JSONResponse({"status": "ok", "model": gateway.model})

    async def prometheus(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict[str, Any]:
        return {"id": gateway.model, "object": "model", "created": gateway.created,
                "owned_by": "omnirail"}  # fmt: skip

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model(request: Request) -> Response:
        name = request.path_params["model"]
        if name != gateway.model:
            raise ApiError(404, f"The model {name[:64]!r} does not exist", "model",
                           "model_not_found")  # fmt: skip
        return JSONResponse(model_card())

    async def chat(request: Request) -> Response:
        plan = gateway.mapper.chat(await read_json(request))
        rid = uuid.uuid4().hex
        span = _span(gateway.tracer, request, "POST /v1/chat/completions", rid)
        events = gateway.events(
            plan, rid, span.traceparent if span else _tp(request), _principal(request)
        )
        headers = {"x-request-id": rid, "cache-control": "no-cache"}
        if plan.stream:
            body = chat_stream(gateway, plan, rid, events, span)
            return EventStream(body, "text/event-stream", headers)
        try:
            answer = await until_disconnect(request, chat_whole(gateway, plan, rid, events))
        except BaseException as exc:
            end_span(span, exc)
            raise
        finally:
            await events.aclose()
        end_span(span, None)
        return JSONResponse(answer, headers=headers)

    async def speech(request: Request) -> Response:
        plan = gateway.mapper.speech(await read_json(request))
        rid = uuid.uuid4().hex
        span = _span(gateway.tracer, request, "POST /v1/audio/speech", rid)
        events = gateway.events(
            plan, rid, span.traceparent if span else _tp(request), _principal(request)
        )
        body = speech_stream(gateway, plan, events, span)
        media = "text/event-stream" if plan.sse else FORMATS[plan.audio_format]
        return EventStream(body, media, {"x-request-id": rid})

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        if status == 405:
            return ApiError(
                405, f"{request.method} is not allowed on {request.url.path}"
            ).response()
        return ApiError(404, f"no route {request.url.path[:100]!r}").response()

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/metrics", prometheus),
            Route("/v1/models", models),
            Route("/v1/models/{model}", model),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/audio/speech", speech, methods=["POST"]),
            WebSocketRoute("/v1/realtime", _realtime(gateway)),
        ],
        exception_handlers={ApiError: api_error, 404: not_found, 405: not_found},
        lifespan=lifespan,
    )


def _realtime(gateway: Gateway) -> Any:
    """The `/v1/realtime` handler: the Realtime API as the pipeline declares it, or a
    refusal of every handshake."""
    config = gateway.realtime
    if config is None:
        message = (
            f"The model {gateway.model!r} does not serve the Realtime API (its pipeline "
            "declares no api.openai.realtime)"
        )
        body = ApiError(404, message, code="realtime_not_served").body()

        async def not_served(websocket: WebSocket) -> None:
            await deny(websocket, 404, body)

        return not_served
    limits = Limits(
        max_items=config.max_items,
        max_buffer_seconds=config.max_buffer_s,
        max_item_audio_seconds=config.max_audio_s,
    )
    return realtime_endpoint(
        responder_factory(gateway),
        max_sessions=config.max_sessions,
        model=gateway.model,
        limits=limits,
        vad_executor=gateway.vad_executor,
        observer=gateway.metrics,
    )


def _tp(request: Request) -> str | None:
    return request.headers.get("traceparent")


def _principal(request: Request) -> str | None:
    """The caller's principal, as the token middleware found it (None without tokens)."""
    return request.scope.get(PRINCIPAL_SCOPE_KEY)


def _span(tracer: Tracer, request: Request, name: str, rid: str) -> Span | None:
    return tracer.start(
        name,
        parse_traceparent(_tp(request)),
        {
            "omnirail.request_id": rid,
            "http.route": request.url.path,
            "omnirail.front_door": "openai",
            "omnirail.principal": _principal(request) or "",
        },
        kind=KIND_SERVER,
    )
