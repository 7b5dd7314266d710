"""Bodies that are not the method's protobuf get INVALID_ARGUMENT, not grpc's UNKNOWN.

grpc turns a deserializer's exception into UNKNOWN with the Python exception's text. This
interceptor gives every method a deserializer that returns a `Malformed` marker instead,
and a behaviour that answers INVALID_ARGUMENT when it meets one: before the handler for a
unary request, at the bad message for a request stream read by iteration. Servicers that
read with ``context.read()`` check `is_malformed` themselves (see coordinator/session.py).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc


class Malformed:
    """Stands in for a message that did not parse."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def is_malformed(message: object) -> bool:
    return isinstance(message, Malformed)


def malformed_message(method: str, message: Malformed) -> str:
    return f"{method}: the request is not a valid protobuf message ({message.reason})"


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # protobuf's DecodeError, or anything a parser raises
            return Malformed(str(exc)[:200] or type(exc).__name__)

    return parse


def _guard_unary(behavior: Callable[..., Any], method: str) -> tuple[Any, Any]:
    """`behavior` (a unary request's handler, sync or async) behind the check."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Malformed):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, malformed_message(method, request)
            )
        result = behavior(request, context)
        return await result if inspect.isawaitable(result) else result

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, Malformed):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, malformed_message(method, request)
            )
        result = behavior(request, context)
        if hasattr(result, "__aiter__"):
            async for response in result:
                yield response
        elif inspect.isawaitable(result):
            await result  # writes its responses with context.write()
        elif result is not None:
            for response in result:
                yield response

    return unary, streaming


def _checked(requests: Any, context: grpc.aio.ServicerContext, method: str) -> Any:
    async def each() -> AsyncIterator[Any]:
        async for request in requests:
            if isinstance(request, Malformed):
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, malformed_message(method, request)
                )
            yield request

    return each()


def _guard(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    deserializer = _lenient(handler.request_deserializer)
    serializer = handler.response_serializer
    if not handler.request_streaming:
        unary, streaming = _guard_unary(
            handler.unary_stream if handler.response_streaming else handler.unary_unary, method
        )
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                streaming, request_deserializer=deserializer, response_serializer=serializer
            )
        return grpc.unary_unary_rpc_method_handler(
            unary, request_deserializer=deserializer, response_serializer=serializer
        )
    inner = handler.stream_stream if handler.response_streaming else handler.stream_unary
    wrapped = _guard_stream(inner, method)
    make = (
        grpc.stream_stream_rpc_method_handler
        if handler.response_streaming
        else grpc.stream_unary_rpc_method_handler
    )
    return make(wrapped, request_deserializer=deserializer, response_serializer=serializer)


def _guard_stream(inner: Callable[..., Any], method: str) -> Callable[..., Any]:
    """A request-streaming handler whose requests are checked as it iterates them. grpc.aio
    runs a handler by its kind (coroutine function, async generator function, or a plain
    one on a thread), so the wrapper has the kind of `inner`."""
    if inspect.isasyncgenfunction(inner):

        async def generator(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            async for response in inner(_checked(requests, context, method), context):
                yield response

        return generator
    if inspect.iscoroutinefunction(inner):

        async def coroutine(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            return await inner(_checked(requests, context, method), context)

        return coroutine
    return inner  # a sync handler's requests come from a sync iterator: left as they are


class MalformedGuard(grpc.aio.ServerInterceptor):
    """Installs the lenient deserializer and its check on every method (cached per method:
    handlers do not change while a server runs)."""

    def __init__(self) -> None:
        self._guarded: dict[str, grpc.RpcMethodHandler | None] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method: str = details.method  # type: ignore[attr-defined]
        handler = await continuation(details)
        if handler is None:
            return None
        cached = self._guarded.get(method)
        if cached is None:
            cached = self._guarded[method] = _guard(handler, method)
        return cached
