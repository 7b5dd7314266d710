"""Requests that take input while they run: `Client.input_stream` / `AsyncClient.input_stream`.

The request starts with its inputs (what the pipeline needs up front); then `send()`
streams chunks into it, numbered from 0, and `end()` marks the end of the input. The entry
stage sees them as a stream from source "@client" as they arrive, so a stage may answer
before the input has ended. Its events (chunks, then the result) are read by iterating the
request, at the same time as the sending (another task or thread).

`send()` waits when the input outruns the pipeline (the coordinator holds each request to
its `input_stream` credit and stops reading the Session; the session holds a bounded
queue, then blocks): memory stays bounded on both sides. Leaving the `with` block, or
`abort()`, before the request ended aborts it everywhere.
"""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

from omnirail.client.span import ClientSpan
from omnirail.v1 import client_pb2
from omnirail.wire.errors import Code, OmniError, invalid
from omnirail.wire.payload import PayloadError, encode_inline

if TYPE_CHECKING:
    from omnirail.client.sdk import StreamEvent
    from omnirail.client.session import AsyncSession, SyncSession

SessionEvent = client_pb2.SessionEvent | OmniError
# Turns a request's event into what the caller gets (a Chunk or the result; raises its
# error): the SDK's `stream_event`, bound to the request and its tensor choice.
Parse = Callable[[SessionEvent], "StreamEvent"]


def _is_end(event: SessionEvent) -> bool:
    return isinstance(event, OmniError) or not event.HasField("chunk")


class _Chunks:
    """The input side both kinds share: chunk ids, the end mark, what may still be sent."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.sent = 0
        self.ended_input = False

    def chunk(self, data: Any, modality: str) -> client_pb2.InputChunk:
        if self.ended_input:
            raise OmniError(Code.FAILED_PRECONDITION, "send() after end(): the input has ended")
        if not isinstance(modality, str):
            raise invalid(f"modality: expected a string, got {type(modality).__name__}")
        try:
            payload = encode_inline(data)
        except PayloadError as exc:
            raise invalid(f"input chunk {self.sent}: {exc}") from None
        chunk = client_pb2.InputChunk(
            request_id=self.request_id, chunk_id=self.sent, data=payload, modality=modality
        )
        self.sent += 1
        return chunk

    def end(self) -> client_pb2.InputChunk | None:
        """The done mark (None if it was sent already)."""
        if self.ended_input:
            return None
        self.ended_input = True
        return client_pb2.InputChunk(request_id=self.request_id, chunk_id=self.sent, done=True)


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _gone() -> OmniError:
    return OmniError(
        Code.FAILED_PRECONDITION,
        "the request has ended: its events say how (iterate it for its result or error)",
    )


class _InputRequest:
    """What both kinds share: the session, the request's events and deadline, its span,
    its chunk ids, and how it ends here (read to its end, aborted, timed out)."""

    def __init__(
        self,
        session: Any,
        request_id: str,
        events: Any,
        deadline: float | None,
        timeout: float | None,
        span: ClientSpan,
        parse: Parse,
    ) -> None:
        self.request_id = request_id
        self._session = session
        self._events = events
        self._deadline = deadline
        self._timeout = timeout
        self._span = span
        self._parse = parse
        self._chunks = _Chunks(request_id)
        self._finished = False  # its end event was read, or it was aborted here

    def abort(self, reason: str = "aborted by the client") -> None:
        """Aborts the request everywhere (nothing of it is left in the mesh)."""
        if not self._finished:
            self._finished = True
            self._session.abort(self.request_id, reason)
            self._span.end(OmniError(Code.CANCELLED, reason))

    def _live(self) -> bool:
        return not self._finished and self._session.live(self.request_id)

    def _taken(self, event: SessionEvent) -> StreamEvent:
        """An event read: the caller's chunk or result (raises its error)."""
        if _is_end(event):
            self._finished = True
            self._span.end(event if isinstance(event, OmniError) else None)
        return self._parse(event)

    def _too_late(self) -> OmniError:
        self.abort("the client stopped waiting")
        return OmniError(Code.DEADLINE_EXCEEDED, f"no answer within {self._timeout}s")


class AsyncInputStream(_InputRequest):
    """A running request of `AsyncClient.input_stream`: `await send(x)`, `await end()`, and
    `async for event in request` (each `Chunk`, then the `GenerateResult`; raises its
    error)."""

    _session: AsyncSession
    _events: asyncio.Queue[SessionEvent]

    async def send(self, data: Any, *, modality: str = "") -> None:
        """Sends one input chunk (any value a payload holds: arrays, tensors, text, maps);
        waits while the pipeline is behind. Raises OmniError(FAILED_PRECONDITION) once the
        request ended."""
        if not self._live():
            raise _gone()
        await self._session.send_input(self._chunks.chunk(data, modality))

    async def end(self) -> None:
        """Marks the end of the input (the entry stage gets `stream_done`)."""
        chunk = self._chunks.end()
        if chunk is not None and self._live():
            await self._session.send_input(chunk)

    async def __aenter__(self) -> AsyncInputStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.abort("the client left the request before it ended")

    def __aiter__(self) -> AsyncIterator[StreamEvent]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[StreamEvent]:
        while not self._finished:
            try:
                event = await asyncio.wait_for(self._events.get(), _remaining(self._deadline))
            except TimeoutError:
                raise self._too_late() from None
            yield self._taken(event)


class InputStream(_InputRequest):
    """A running request of `Client.input_stream`: `send(x)`, `end()`, and iteration over
    its events (each `Chunk`, then the `GenerateResult`; raises its error)."""

    _session: SyncSession
    _events: queue.SimpleQueue[SessionEvent]

    def send(self, data: Any, *, modality: str = "") -> None:
        """Sends one input chunk; blocks while the pipeline is behind. Raises
        OmniError(FAILED_PRECONDITION) once the request ended."""
        if not self._live():
            raise _gone()
        self._session.send_input(self._chunks.chunk(data, modality), _remaining(self._deadline))

    def end(self) -> None:
        """Marks the end of the input (the entry stage gets `stream_done`)."""
        chunk = self._chunks.end()
        if chunk is not None and self._live():
            self._session.send_input(chunk, _remaining(self._deadline))

    def __enter__(self) -> InputStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort("the client left the request before it ended")

    def __iter__(self) -> Iterator[StreamEvent]:
        while not self._finished:
            try:
                event = self._events.get(timeout=_remaining(self._deadline))
            except queue.Empty:
                raise self._too_late() from None
            yield self._taken(event)
