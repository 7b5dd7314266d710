"""The client API's streams: a streaming Generate's chunks, and the Session stream.

A Session carries many requests (and their aborts) over one call: the client writes
batches of Generate and Abort messages; the coordinator answers with batches of chunks,
results and errors, each tagged with its request id. Requests started on a session end
with it: closing the stream aborts those still live.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from omnirail.coordinator.requests import RequestRecord, State
from omnirail.transport.grpc_server import write_until_read_ends
from omnirail.transport.malformed import is_malformed, malformed_message
from omnirail.v1 import client_pb2
from omnirail.wire.errors import Code, OmniError, internal, invalid

if TYPE_CHECKING:
    from omnirail.coordinator.service import Coordinator


async def serve_session(
    coordinator: Coordinator,
    request_iterator: AsyncIterator[client_pb2.SessionRequest],
    context: grpc.aio.ServicerContext,
) -> None:
    events = client_pb2.SessionEvents()
    wake = asyncio.Event()
    mine: set[str] = set()
    # Chunks per request waiting for the client to read the stream (since the last write).
    unread: dict[str, int] = {}
    requests = coordinator.requests

    def emit(event: client_pb2.SessionEvent) -> None:
        events.events.append(event)
        wake.set()

    def emit_chunk(rec: RequestRecord, chunk: client_pb2.Chunk) -> None:
        rid = rec.request_id
        emit(client_pb2.SessionEvent(request_id=rid, chunk=chunk))
        unread[rid] = n = unread.get(rid, 0) + 1
        if n > coordinator.client_buffer:
            coordinator.client_too_slow(rec, n)

    # The call's traceparent parents requests that carry none of their own.
    caller_traceparent = traceparent_of(context)

    def on_done(rec: RequestRecord) -> None:
        mine.discard(rec.request_id)
        if rec.state == State.COMPLETED:
            emit(client_pb2.SessionEvent(request_id=rec.request_id, result=rec.result()))
        else:
            err = rec.error or internal("request ended without a result")
            emit(client_pb2.SessionEvent(request_id=rec.request_id, error=err.to_proto()))

    malformed: list[str] = []

    async def read() -> None:
        while (msg := await context.read()) is not grpc.aio.EOF:
            if is_malformed(msg):  # a broken client: the session ends, requests with it
                malformed.append(malformed_message("/omnirail.v1.Omnirail/Session", msg))
                return
            for request in msg.generate:
                if not request.request_id:
                    error = invalid("request_id: required in a Session")
                    emit(client_pb2.SessionEvent(error=error.to_proto()))
                    continue
                try:
                    rec = coordinator.start(request, None, caller_traceparent)
                except OmniError as exc:
                    emit(
                        client_pb2.SessionEvent(request_id=request.request_id, error=exc.to_proto())
                    )
                    continue
                mine.add(rec.request_id)
                rec.on_done.append(on_done)
                if request.stream:
                    rec.on_chunk.append(lambda chunk, r=rec: emit_chunk(r, chunk))
            for abort in msg.abort:
                coordinator.abort_soon(abort.request_id, abort.reason or "aborted by client")

    def take() -> client_pb2.SessionEvents | None:
        nonlocal events
        if not events.events:
            return None
        batch, events = events, client_pb2.SessionEvents()
        unread.clear()
        return batch

    try:
        await write_until_read_ends(context, read(), wake, take)
        if malformed:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, malformed[0])
    finally:
        for rid in list(mine):
            rec = requests.live.get(rid)
            if rec is not None:
                coordinator.end(
                    rec, State.ABORTED, OmniError(Code.CANCELLED, "client session closed")
                )


async def stream_chunks(
    coordinator: Coordinator, rec: RequestRecord, context: grpc.aio.ServicerContext
) -> None:
    """A streaming Generate: writes the request's chunks as they come, until it ends."""
    chunks: deque[client_pb2.Chunk] = deque()
    wake = asyncio.Event()

    def on_chunk(chunk: client_pb2.Chunk) -> None:
        chunks.append(chunk)
        wake.set()
        if len(chunks) > coordinator.client_buffer:
            coordinator.client_too_slow(rec, len(chunks))

    rec.on_chunk.append(on_chunk)
    rec.on_done.append(lambda _: wake.set())
    while True:
        # A failed request's chunks are moot: its error goes out next.
        while chunks and (not rec.finished or rec.state == State.COMPLETED):
            await context.write(client_pb2.GenerateEvent(chunk=chunks.popleft()))
        if rec.finished:
            return
        wake.clear()
        await wake.wait()


def traceparent_of(context: grpc.aio.ServicerContext) -> str:
    """The call's `traceparent` metadata ("" without one)."""
    for key, value in context.invocation_metadata() or ():
        if key == "traceparent":
            return value if isinstance(value, str) else value.decode()
    return ""
