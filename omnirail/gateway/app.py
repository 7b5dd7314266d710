"""The gateway's ASGI app: OpenAI routes over one mesh client.

Each HTTP request becomes one mesh request over the client's Session stream (`stream()`:
chunks as the terminal stages make them, then the result). The first event is awaited
before the HTTP status is sent, so a request the mesh refuses gets a real 4xx/5xx rather
than a 200 with an error inside; from then on chunks go out as they come. A client that
disconnects cancels its request through the mesh (the SDK aborts what its caller stopped
reading), streamed or not.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from omnirail.client.sdk import AsyncClient, Chunk, GenerateResult
from omnirail.config import PipelineConfig
from omnirail.config.api import OutputSpec, pick
from omnirail.gateway.audio import FORMATS, pcm16, wav, wav_header
from omnirail.gateway.errors import ApiError, bad, from_mesh
from omnirail.gateway.metrics import GatewayMetrics
from omnirail.gateway.requests import Plan, RequestMapper
from omnirail.telemetry.tracer import KIND_SERVER, Span, Tracer, parse_traceparent
from omnirail.wire.errors import OmniError

MAX_BODY = 64 << 20
AUDIO_TTL_S = 3600
Event = Chunk | GenerateResult


class Gateway:
    """What the routes share: the mesh client, the mapping, tracing and metrics."""

    def __init__(
        self,
        pipeline: PipelineConfig,
        connect: Callable[[], AsyncClient],
        tracer: Tracer | None = None,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.model = pipeline.model_name
        self.api = pipeline.api
        self.mapper = RequestMapper(pipeline.api, self.model)
        oa = pipeline.api.openai
        assert oa is not None  # RequestMapper checked
        self.oa = oa
        self.text_spec = self.api.output(oa.text_output) if oa.text_output else None
        self.audio_spec = self.api.output(oa.audio_output) if oa.audio_output else None
        self._connect = connect
        self.client: AsyncClient | None = None
        self.tracer = tracer or Tracer()
        self.metrics = metrics or GatewayMetrics()
        self.created = int(time.time())

    async def start(self) -> None:
        # grpc.aio channels belong to the loop that made them: made on uvicorn's.
        self.client = self._connect()

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    # ---- mesh events -> text and audio pieces -------------------------------------------

    def text_of_chunk(self, chunk: Chunk) -> str | None:
        spec = self.text_spec
        if spec is None or spec.chunks is None or chunk.stage != spec.stage:
            return None
        return _text(pick(chunk.data, spec.chunks, _at(spec, "chunk")))

    def audio_of_chunk(self, chunk: Chunk) -> tuple[bytes, int] | None:
        spec = self.audio_spec
        if spec is None or spec.chunks is None or chunk.stage != spec.stage:
            return None
        return pcm16(pick(chunk.data, spec.chunks, _at(spec, "chunk"))), self._rate(chunk.data)

    def _rate(self, data: Any) -> int:
        rate = data.get("sample_rate") if isinstance(data, dict) else None
        return int(rate) if isinstance(rate, int) and rate > 0 else self.oa.sample_rate

    def text_of_result(self, result: GenerateResult) -> str | None:
        spec = self.text_spec
        if spec is None or spec.result is None or spec.stage not in result.outputs:
            return None
        return _text(pick(result.outputs[spec.stage], spec.result, _at(spec)))

    def audio_of_result(self, result: GenerateResult) -> tuple[bytes, int] | None:
        spec = self.audio_spec
        if spec is None or spec.result is None or spec.stage not in result.outputs:
            return None
        value = result.outputs[spec.stage]
        return pcm16(pick(value, spec.result, _at(spec))), self._rate(value)

    # ---- one request ------------------------------------------------------------------

    def events(self, plan: Plan, rid: str, traceparent: str | None) -> AsyncGenerator[Event]:
        """The request's chunks, then its result. Closing it (or cancelling a read) aborts
        the request through the mesh, so every consumer closes it when done."""
        assert self.client is not None
        return self.client.stream(plan.inputs, request_id=rid, traceparent=traceparent)


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value if isinstance(value, str) else json.dumps(value)


def _at(spec: OutputSpec, what: str = "result") -> str:
    return f"api output {spec.name!r}: the {what} of stage {spec.stage!r}"


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _first(events: AsyncIterator[Event]) -> Event | None:
    """The stream's first event (mesh errors raised as ApiError); None if it is empty."""
    try:
        return await anext(events)
    except StopAsyncIteration:
        return None
    except OmniError as exc:
        raise from_mesh(exc) from None


async def _rest(first: Event | None, events: AsyncGenerator[Event]) -> AsyncGenerator[Event]:
    """The stream again from its first event; closing it closes (and so aborts) `events`."""
    try:
        if first is not None:
            yield first
        async for event in events:
            yield event
    finally:
        await events.aclose()


async def _body(request: Request) -> Any:
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


async def _until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """`work`'s result, or cancels it (aborting its mesh request) when the client leaves."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
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

        async def gone() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        producer = asyncio.ensure_future(produce())
        watcher = asyncio.ensure_future(gone())
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
        plan = gateway.mapper.chat(await _body(request))
        rid = uuid.uuid4().hex
        span = _span(gateway.tracer, request, "POST /v1/chat/completions", rid)
        events = gateway.events(plan, rid, span.traceparent if span else _tp(request))
        headers = {"x-request-id": rid, "cache-control": "no-cache"}
        if plan.stream:
            body = _chat_stream(gateway, plan, rid, events, span)
            return EventStream(body, "text/event-stream", headers)
        try:
            answer = await _until_disconnect(request, _chat_whole(gateway, plan, rid, events))
        except BaseException as exc:
            _end(span, exc)
            raise
        finally:
            await events.aclose()
        _end(span, None)
        return JSONResponse(answer, headers=headers)

    async def speech(request: Request) -> Response:
        plan = gateway.mapper.speech(await _body(request))
        rid = uuid.uuid4().hex
        span = _span(gateway.tracer, request, "POST /v1/audio/speech", rid)
        events = gateway.events(plan, rid, span.traceparent if span else _tp(request))
        body = _speech_stream(gateway, plan, events, span)
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
        ],
        exception_handlers={ApiError: api_error, 404: not_found, 405: not_found},
        lifespan=lifespan,
    )


def _tp(request: Request) -> str | None:
    return request.headers.get("traceparent")


def _span(tracer: Tracer, request: Request, name: str, rid: str) -> Span | None:
    return tracer.start(
        name,
        parse_traceparent(_tp(request)),
        {
            "omnirail.request_id": rid,
            "http.route": request.url.path,
            "omnirail.front_door": "openai",
        },
        kind=KIND_SERVER,
    )


def _end(span: Span | None, error: BaseException | None) -> None:
    if span is None:
        return
    if isinstance(error, asyncio.CancelledError):
        span.error("client disconnected")
    elif isinstance(error, ApiError):
        span.error(f"{error.status}: {error.message}")
    elif error is not None:
        span.error(f"{type(error).__name__}: {error}")
    span.end()


async def _chat_whole(
    gateway: Gateway, plan: Plan, rid: str, events: AsyncIterator[Event]
) -> dict[str, Any]:
    pieces: list[str] = []
    audio: list[bytes] = []
    rate = gateway.oa.sample_rate
    text: str | None = None
    try:
        async for event in events:
            if isinstance(event, GenerateResult):
                text = gateway.text_of_result(event)
                whole = gateway.audio_of_result(event) if plan.want_audio else None
                if whole is not None:
                    audio, rate = [whole[0]], whole[1]
                continue
            piece = gateway.text_of_chunk(event)
            if piece:
                pieces.append(piece)
            sound = gateway.audio_of_chunk(event) if plan.want_audio else None
            if sound is not None:
                audio.append(sound[0])
                rate = sound[1]
    except OmniError as exc:
        raise from_mesh(exc) from None
    if text is None:
        text = "".join(pieces)
    created = int(time.time())
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if plan.want_audio:
        pcm = b"".join(audio)
        data = wav(pcm, rate) if plan.audio_format == "wav" else pcm
        message["audio"] = {
            "id": f"audio_{rid}",
            "data": base64.b64encode(data).decode(),
            "expires_at": created + AUDIO_TTL_S,
            "transcript": text,
        }
    gateway.metrics.audio_seconds(len(b"".join(audio)) / 2 / rate if audio else 0.0)
    return {
        "id": f"chatcmpl-{rid}",
        "object": "chat.completion",
        "created": created,
        "model": gateway.model,
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
    }


async def _opened(source: AsyncGenerator[Event], span: Span | None) -> AsyncGenerator[Event]:
    """`source` from its first event, awaited now (ApiError when the mesh refused the
    request, which then ends the span and closes the source)."""
    try:
        first = await _first(source)
    except BaseException as exc:
        _end(span, exc)
        await source.aclose()
        raise
    return _rest(first, source)


async def _chat_stream(
    gateway: Gateway, plan: Plan, rid: str, source: AsyncGenerator[Event], span: Span | None
) -> AsyncGenerator[bytes]:
    events = await _opened(source, span)
    created = int(time.time())
    base = {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": created,
            "model": gateway.model}  # fmt: skip

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return _sse({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

    error: BaseException | None = None
    header_sent = False
    samples = 0
    rate = gateway.oa.sample_rate

    def audio_delta(pcm: bytes, sample_rate: int) -> bytes:
        nonlocal header_sent, samples, rate
        samples += len(pcm) // 2
        rate = sample_rate
        if plan.audio_format == "wav" and not header_sent:
            pcm = wav_header(sample_rate) + pcm
        header_sent = True
        audio = {"id": f"audio_{rid}", "data": base64.b64encode(pcm).decode(),
                 "expires_at": created + AUDIO_TTL_S}  # fmt: skip
        return chunk({"audio": audio})

    streamed_text = False
    # The role preamble goes out in one write with the first event's deltas.
    out = chunk({"role": "assistant", "content": ""})
    try:
        async for event in events:
            if isinstance(event, GenerateResult):
                text = gateway.text_of_result(event)
                if text and not streamed_text:
                    out += chunk({"content": text})
                whole = gateway.audio_of_result(event) if plan.want_audio else None
                if whole is not None and not header_sent:
                    out += audio_delta(*whole)
            else:
                piece = gateway.text_of_chunk(event)
                if piece:
                    streamed_text = True
                    out += chunk({"content": piece})
                sound = gateway.audio_of_chunk(event) if plan.want_audio else None
                if sound is not None:
                    out += audio_delta(*sound)
            if out:
                yield out
                out = b""
        yield out + chunk({}, "stop") + b"data: [DONE]\n\n"
    except OmniError as exc:
        error = exc
        yield _sse(from_mesh(exc).body())
    except BaseException as exc:  # the client went away (cancelled), or a bug
        error = exc
        raise
    finally:
        await events.aclose()  # a client that left: aborts the request through the mesh
        gateway.metrics.audio_seconds(samples / rate if samples else 0.0)
        _end(span, error)


async def _speech_stream(
    gateway: Gateway, plan: Plan, source: AsyncGenerator[Event], span: Span | None
) -> AsyncGenerator[bytes]:
    events = await _opened(source, span)
    error: BaseException | None = None
    started = False
    samples = 0
    rate = gateway.oa.sample_rate

    def out(pcm: bytes, sample_rate: int) -> bytes:
        nonlocal started, samples, rate
        samples += len(pcm) // 2
        rate = sample_rate
        if plan.audio_format == "wav" and not started:
            pcm = wav_header(sample_rate) + pcm
        started = True
        if plan.sse:
            return _sse({"type": "speech.audio.delta", "audio": base64.b64encode(pcm).decode()})
        return pcm

    try:
        async for event in events:
            sound = (
                gateway.audio_of_result(event)
                if isinstance(event, GenerateResult)
                else gateway.audio_of_chunk(event)
            )
            if sound is not None and not (isinstance(event, GenerateResult) and started):
                yield out(*sound)
        if not started and plan.audio_format == "wav":
            yield out(b"", rate)  # no audio at all: still a valid (empty) WAV
        if plan.sse:
            yield _sse({"type": "speech.audio.done"})
    except OmniError as exc:
        # Headers are gone: an SSE stream says why; a raw audio stream can only stop short.
        error = exc
        if plan.sse:
            yield _sse(from_mesh(exc).body())
    except BaseException as exc:
        error = exc
        raise
    finally:
        await events.aclose()  # a client that left: aborts the request through the mesh
        gateway.metrics.audio_seconds(samples / rate if samples else 0.0)
        _end(span, error)


class CountRequests:
    """ASGI middleware counting answers by route and status (a pure ASGI layer: Starlette's
    `BaseHTTPMiddleware` would relay every streamed chunk through a task of its own)."""

    def __init__(self, app: Any, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
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
