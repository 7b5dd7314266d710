"""The client API's streams: a streaming Generate's chunks, and the Session stream.

A Session carries many requests (and their aborts) over one call: the client writes
batches of Generate and Abort messages; the coordinator answers with batches of chunks,
results and errors, each tagged with its request id. A half-close means "no more
requests": every request sent is answered, then the call ends OK. A cancel (the SDK's
close, a client that goes away) aborts those still live.

What waits to be written to the client is bounded (coordinator/outbox.py): a Session
whose client does not read stops reading its new requests. Input chunks of its requests
(coordinator/input_stream.py) are forwarded to the entry stage with credit per request: a
request at its credit makes the Session stop reading until the entry stage takes a chunk.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from omnirail.coordinator.outbox import ClientOutbox
from omnirail.coordinator.requests import RequestRecord, State
from omnirail.transport.malformed import is_malformed, malformed_message
from omnirail.v1 import client_pb2
from omnirail.wire.errors import Code, OmniError, internal, invalid

if TYPE_CHECKING:
    from omnirail.coordinator.service import Coordinator

# How many ended input-streaming requests a Session remembers (their late chunks are
# dropped quietly; an id it forgot gets NOT_FOUND).
_ENDED_KEPT = 1024


async def serve_session(
    coordinator: Coordinator,
    request_iterator: AsyncIterator[client_pb2.SessionRequest],
    context: grpc.aio.ServicerContext,
) -> None:
    mine: set[str] = set()
    requests = coordinator.requests
    outbox: ClientOutbox[client_pb2.SessionEvent] = coordinator.client_outbox(
        "session", lambda events: client_pb2.SessionEvents(events=events)
    )

    def emit_chunk(rec: RequestRecord, chunk: client_pb2.Chunk) -> None:
        # Twice the bound: the client reads nothing, even now that no request starts.
        event = client_pb2.SessionEvent(request_id=rec.request_id, chunk=chunk)
        coordinator.push_chunk(outbox, rec, event, slack=2)

    # The call's traceparent parents requests that carry none of their own.
    caller_traceparent = traceparent_of(context)
    # The call's own principal (its token's) is the same for every request it starts; only
    # a request naming another (`on_behalf_of`, front doors) is checked on its own.
    metadata = tuple(context.invocation_metadata() or ())
    own_principal = coordinator.security.caller(metadata)

    def on_done(rec: RequestRecord) -> None:
        mine.discard(rec.request_id)
        if rec.state == State.COMPLETED:
            outbox.push(client_pb2.SessionEvent(request_id=rec.request_id, result=rec.result()))
        else:
            err = rec.error or internal("request ended without a result")
            outbox.push(client_pb2.SessionEvent(request_id=rec.request_id, error=err.to_proto()))

    malformed: list[str] = []

    async def read() -> None:
        while True:
            # A client that does not read what it asked for gets no new work started:
            # its sends wait at HTTP/2 flow control until it reads (coordinator/outbox.py).
            await outbox.room.wait()
            msg = await context.read()
            if msg is grpc.aio.EOF:
                # A half-close: no more requests. What was sent is answered (the writer
                # ends the call once `mine` is empty); only a cancel aborts it.
                return
            if is_malformed(msg):  # a broken client: the session ends, requests with it
                malformed.append(malformed_message("/omnirail.v1.Omnirail/Session", msg))
                return
            for request in msg.generate:
                if not request.request_id:
                    error = invalid("request_id: required in a Session")
                    outbox.push(client_pb2.SessionEvent(error=error.to_proto()))
                    continue
                try:
                    principal = (
                        coordinator.security.caller(metadata, request.on_behalf_of)
                        if request.on_behalf_of
                        else own_principal
                    )
                    rec = coordinator.start(request, None, caller_traceparent, principal)
                except OmniError as exc:
                    outbox.push(
                        client_pb2.SessionEvent(request_id=request.request_id, error=exc.to_proto())
                    )
                    continue
                mine.add(rec.request_id)
                rec.on_done.append(on_done)
                if rec.input is not None:
                    rec.on_done.append(forget)
                if request.stream:
                    rec.on_chunk.append(lambda chunk, r=rec: emit_chunk(r, chunk))
            for chunk in msg.input:
                await take_input(chunk)
            for abort in msg.abort:
                coordinator.abort_soon(abort.request_id, abort.reason or "aborted by client")

    # Requests this Session started that ended: their late input chunks are dropped quietly
    # (a client streams on until it hears of the end). Bounded: older ids are forgotten.
    ended_mine: OrderedDict[str, None] = OrderedDict()

    def forget(rec: RequestRecord) -> None:
        ended_mine[rec.request_id] = None
        while len(ended_mine) > _ENDED_KEPT:
            ended_mine.popitem(last=False)

    async def take_input(chunk: client_pb2.InputChunk) -> None:
        rid = chunk.request_id
        rec = requests.live.get(rid) if rid in mine else None
        if rec is None:
            if rid not in ended_mine:
                error = OmniError(
                    Code.NOT_FOUND,
                    f"input chunk for {rid[:128]!r}, which is not a live request of this Session",
                )
                outbox.push(client_pb2.SessionEvent(request_id=rid, error=error.to_proto()))
            return
        stream = rec.input
        if stream is None:
            coordinator.end(
                rec,
                State.FAILED,
                invalid("input chunk for a request not started with input_stream"),
            )
            return
        try:
            stream.check(chunk)
        except OmniError as exc:
            coordinator.end(rec, State.FAILED, exc)
            return
        nbytes = 0 if chunk.done else chunk.data.ByteSize()
        if not chunk.done and not stream.has_room(nbytes):
            began = time.monotonic()
            while not stream.has_room(nbytes) and not rec.finished:
                stream.room.clear()
                await stream.room.wait()
            coordinator.metrics.input_waited(time.monotonic() - began)
        if not rec.finished:
            coordinator.send_input(rec, chunk)

    reader = asyncio.get_running_loop().create_task(read())
    try:
        await outbox.pump(context.write, reader, lambda: bool(malformed) or not mine)
        if malformed:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, malformed[0])
    finally:
        reader.cancel()
        for rid in list(mine):
            rec = requests.live.get(rid)
            if rec is not None:
                coordinator.end(
                    rec, State.ABORTED, OmniError(Code.CANCELLED, "client session closed")
                )


async def stream_chunks(
    coordinator: Coordinator, rec: RequestRecord, context: grpc.aio.ServicerContext
) -> None:
    """A streaming Generate: writes the request's chunks as they come, until it ends. A
    chunk that finds the call full fails the request (there is nothing else to hold back)."""
    outbox: ClientOutbox[client_pb2.GenerateEvent] = coordinator.client_outbox("generate")

    def on_chunk(chunk: client_pb2.Chunk) -> None:
        coordinator.push_chunk(outbox, rec, client_pb2.GenerateEvent(chunk=chunk))

    rec.on_chunk.append(on_chunk)
    rec.on_done.append(lambda _: outbox.wake.set())
    while True:
        # A failed request's chunks are moot: its error goes out next.
        if not rec.finished or rec.state == State.COMPLETED:
            if await outbox.write_next(context.write):
                continue
        if rec.finished:
            return
        outbox.wake.clear()
        await outbox.wake.wait()


def traceparent_of(context: grpc.aio.ServicerContext) -> str:
    """The call's `traceparent` metadata ("" without one)."""
    for key, value in context.invocation_metadata() or ():
        if key == "traceparent":
            return value if isinstance(value, str) else value.decode()
    return ""
