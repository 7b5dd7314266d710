"""Client side of the `Session` stream: many requests multiplexed over one call.

Requests queued while a write is in flight go out together; each request's result or
error comes back tagged with its id and resolves that request's future. A streaming
request gets a queue instead, fed with its chunk events and then its result or error.
When the stream breaks, every waiting request fails with UNAVAILABLE and the next call
opens a new one.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import queue
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import grpc

from omnirail.transport.batching import take_batch, wait_until
from omnirail.v1 import client_pb2
from omnirail.wire.errors import Code, OmniError

# Bounds on one write: a burst of requests goes out as one message, but never one the
# channel would refuse (grpc fails the whole stream, and every request on it, for one
# message over its limit).
_MAX_BATCH = 64
Metadata = tuple[tuple[str, str], ...]
# Room for the batch's own framing next to its requests' bytes.
_BATCH_SLACK = 1 << 10
# Input chunk bytes a session queues before `send_input` waits for its writer: what the
# coordinator does not read yet waits here, bounded (it holds back a request's chunks at
# the pipeline's input_stream credit).
_MAX_QUEUED_INPUT = 1 << 20


def too_large(request: client_pb2.GenerateRequest, size: int, max_bytes: int) -> OmniError:
    """The error of a request that cannot be sent at all: it fails alone."""
    return OmniError(
        Code.RESOURCE_EXHAUSTED,
        f"request {request.request_id[:80]!r}: {size} bytes exceed the client's message limit"
        f" of {max_bytes} bytes (max_message_mb); send large inputs in parts or raise the"
        " limit on both the client and the pipeline (endpoints.max_message_mb)",
    )


# Why a session can end that is the caller's to fix, not a passing outage: these keep their
# code (a missing token is UNAUTHENTICATED on every request that waited, not UNAVAILABLE).
_KEPT = (Code.UNAUTHENTICATED,)


def _broken(err: BaseException | None) -> OmniError:
    if isinstance(err, grpc.RpcError):
        error = OmniError.from_rpc_error(err)
        code = error.code if error.code in _KEPT else Code.UNAVAILABLE
        return OmniError(code, f"session to the coordinator ended: {error.message}")
    return OmniError(Code.UNAVAILABLE, "session to the coordinator ended")


# Sessions of clients not closed by exit are closed by atexit, before the interpreter
# stops grpc's daemon threads (see `SyncSession._read`).
_OPEN: weakref.WeakSet[SyncSession] = weakref.WeakSet()


@atexit.register
def _close_open_sessions() -> None:
    for session in list(_OPEN):
        session.close()


class SyncSession:
    """For the blocking `Client`: a writer fed by a queue, a reader thread."""

    def __init__(self, stub: Any, max_bytes: int, metadata: Metadata = ()) -> None:
        self._max_bytes = max_bytes - _BATCH_SLACK
        # What waits for the writer (grpc's thread iterating `_requests`), each a request or
        # an abort; `_wake` is notified as something is queued or the session closes.
        # (message, its size: measured once, when it is queued).
        self._outgoing: collections.deque[tuple[client_pb2.SessionRequest, int, int]] = (
            collections.deque()
        )
        # Bytes of input chunks queued and not yet taken by the writer (`send_input` waits
        # while they are at the bound).
        self._queued_input = 0
        self._wake = threading.Condition()
        self._ended = False
        self._futures: dict[str, concurrent.futures.Future[client_pb2.SessionEvent]] = {}
        self._streams: dict[str, queue.SimpleQueue[client_pb2.SessionEvent | OmniError]] = {}
        self._lock = threading.Lock()
        self.broken = False
        # Why the stream ended (what requests sent after that fail with).
        self.failure: OmniError | None = None
        self._closing = False
        self._call = stub.Session(self._requests(), metadata=metadata)
        self._reader = threading.Thread(target=self._read, name="omnirail-session", daemon=True)
        self._reader.start()
        _OPEN.add(self)

    def _requests(self) -> Iterator[client_pb2.SessionRequest]:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._outgoing or self._ended)
                parts = take_batch(self._outgoing, _second, _MAX_BATCH, self._max_bytes)
                taken_input = sum(part[2] for part in parts)
                if taken_input:
                    self._queued_input -= taken_input
                    self._wake.notify_all()
            if not parts:
                return  # closed, and everything queued went out
            batch = client_pb2.SessionRequest()
            for part, _, _ in parts:
                batch.MergeFrom(part)  # requests before input chunks, as they were queued
            yield batch

    def _queue(self, message: client_pb2.SessionRequest | None, size: int = 0) -> None:
        """Queues `message` of `size` bytes for the writer (None: no more after what is
        queued)."""
        with self._wake:
            if message is None:
                self._ended = True
            else:
                self._outgoing.append((message, size, 0))
            self._wake.notify_all()

    def send_input(self, chunk: client_pb2.InputChunk, timeout: float | None = None) -> None:
        """Queues an input chunk of a request this session started; blocks while the input
        already queued is at the bound (the coordinator reads no faster than the entry
        stage consumes). Raises OmniError when the session ended or `timeout` passed."""
        if (size := chunk.ByteSize()) > self._max_bytes:
            raise too_large_chunk(chunk, size, self._max_bytes)
        with self._wake:
            if not self._wake.wait_for(
                lambda: self._queued_input < _MAX_QUEUED_INPUT or self._ended or self.broken,
                timeout,
            ):
                raise OmniError(Code.DEADLINE_EXCEEDED, "input chunk not sent within its timeout")
            if self.broken or self._ended:
                raise self.failure or _broken(None)
            self._queued_input += size
            self._outgoing.append((client_pb2.SessionRequest(input=[chunk]), size, size))
            self._wake.notify_all()

    def _read(self) -> None:
        error: BaseException | None = None
        try:
            for events in self._call:
                for event in events.events:
                    rid = event.request_id
                    with self._lock:
                        stream = self._streams.get(rid)
                        if stream is not None and not event.HasField("chunk"):
                            del self._streams[rid]
                        future = self._futures.pop(rid, None) if stream is None else None
                    if stream is not None:
                        stream.put(event)
                    elif future is not None:
                        future.set_result(event)
        except grpc.RpcError as exc:
            # The call is its own exception, and its traceback's frames hold the call: a
            # cycle only the cyclic GC frees, maybe at interpreter exit, when grpc's daemon
            # threads may have died holding the lock the call's __del__ waits for (a hang).
            error = exc.with_traceback(None)
        failure = _broken(error)  # not the call itself: that would keep the call alive
        with self._lock:
            self.failure = failure
            self.broken = True
            waiting, self._futures = self._futures, {}
            streams, self._streams = self._streams, {}
        with self._wake:
            self._wake.notify_all()  # an input sender waiting for room sees the end
        # Closed here (`close`): what waits ends as cancelled, like the async client's.
        ended = OmniError(Code.CANCELLED, "the client was closed") if self._closing else None
        for future in waiting.values():
            future.set_exception(ended or failure)
        for stream in streams.values():
            stream.put(ended or failure)

    def send(
        self, request: client_pb2.GenerateRequest
    ) -> concurrent.futures.Future[client_pb2.SessionEvent]:
        future: concurrent.futures.Future[client_pb2.SessionEvent] = concurrent.futures.Future()
        if (size := request.ByteSize()) > self._max_bytes:
            future.set_exception(too_large(request, size, self._max_bytes))
            return future
        with self._lock:
            if self.broken:
                future.set_exception(self.failure or _broken(None))
                return future
            self._futures[request.request_id] = future
        self._queue(client_pb2.SessionRequest(generate=[request]), size)
        return future

    def send_stream(
        self, request: client_pb2.GenerateRequest
    ) -> queue.SimpleQueue[client_pb2.SessionEvent | OmniError]:
        """Starts a streaming request; its events (chunks, then the end) arrive in order."""
        events: queue.SimpleQueue[client_pb2.SessionEvent | OmniError] = queue.SimpleQueue()
        if (size := request.ByteSize()) > self._max_bytes:
            events.put(too_large(request, size, self._max_bytes))
            return events
        with self._lock:
            if self.broken:
                events.put(self.failure or _broken(None))
                return events
            self._streams[request.request_id] = events
        self._queue(client_pb2.SessionRequest(generate=[request]), size)
        return events

    def live(self, request_id: str) -> bool:
        """Whether `request_id`, a streaming request sent here, has not ended yet."""
        with self._lock:
            return request_id in self._streams

    def abort(self, request_id: str, reason: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
            future = self._futures.pop(request_id, None)
        if future is not None:
            future.set_exception(OmniError(Code.CANCELLED, reason))
        abort = client_pb2.AbortRequest(request_id=request_id, reason=reason)
        self._queue(client_pb2.SessionRequest(abort=[abort]), abort.ByteSize())

    def close(self) -> None:
        call = self._call
        if call is None:
            return
        self._closing = True
        self._queue(None)
        call.cancel()
        self._reader.join(timeout=5)
        if not self._reader.is_alive():
            # The call is finalized on return, while grpc's threads still run (see `_read`).
            self._call = None


class AsyncSession:
    """For `AsyncClient`: a writer task and a reader task on the caller's loop."""

    def __init__(self, stub: Any, max_bytes: int, metadata: Metadata = ()) -> None:
        self._max_bytes = max_bytes - _BATCH_SLACK
        self._call = stub.Session(metadata=metadata)
        # What waits for the writer: requests and input chunks in the order they were
        # sent, with their sizes; and aborts.
        self._outbox: collections.deque[
            tuple[client_pb2.GenerateRequest | client_pb2.InputChunk, int]
        ] = collections.deque()
        # Bytes of input chunks queued for the writer; `send_input` waits at the bound.
        self._queued_input = 0
        self._input_room = asyncio.Event()
        self._input_room.set()
        self._aborts: list[client_pb2.AbortRequest] = []
        self._wake = asyncio.Event()
        self._futures: dict[str, asyncio.Future[client_pb2.SessionEvent]] = {}
        self._streams: dict[str, asyncio.Queue[client_pb2.SessionEvent | OmniError]] = {}
        self.broken = False
        # Why the stream ended (what requests sent after that fail with).
        self.failure: OmniError | None = None
        self._closing = False
        loop = asyncio.get_running_loop()
        self._reader = loop.create_task(self._read())
        self._writer = loop.create_task(self._write())

    async def _write(self) -> None:
        try:
            while True:
                await wait_until(self._wake, lambda: self._outbox or self._aborts)
                batch = client_pb2.SessionRequest(abort=self._aborts)
                self._aborts = []
                taken = take_batch(self._outbox, _second, _MAX_BATCH, self._max_bytes)
                for part, size in taken:
                    # Within one message the coordinator takes requests before input
                    # chunks: a chunk never precedes its request, as they were queued.
                    if isinstance(part, client_pb2.InputChunk):
                        batch.input.append(part)
                        self._queued_input -= size
                    else:
                        batch.generate.append(part)
                await self._call.write(batch)
                if self._queued_input < _MAX_QUEUED_INPUT:
                    self._input_room.set()
        except (grpc.RpcError, asyncio.InvalidStateError):
            pass  # the reader sees the end of the call and fails what is waiting

    async def _read(self) -> None:
        error: BaseException | None = None
        try:
            while (events := await self._call.read()) is not grpc.aio.EOF:
                for event in events.events:
                    rid = event.request_id
                    stream = self._streams.get(rid)
                    if stream is not None:
                        if not event.HasField("chunk"):
                            del self._streams[rid]
                        stream.put_nowait(event)
                        continue
                    future = self._futures.pop(rid, None)
                    if future is not None and not future.done():
                        future.set_result(event)
        except grpc.RpcError as exc:
            error = exc
        finally:
            # Also when the read is cancelled (`close()` cancels the call, and grpc.aio
            # then raises CancelledError here): nothing may be left waiting.
            self._end(error)

    def _end(self, error: BaseException | None) -> None:
        self.failure = _broken(error)
        self.broken = True
        self._writer.cancel()
        self._input_room.set()  # an input sender waiting for room sees the end
        waiting, self._futures = self._futures, {}
        streams, self._streams = self._streams, {}
        if self._closing:
            ended = OmniError(Code.CANCELLED, "the client was closed")
        else:
            ended = _broken(error)
        for future in waiting.values():
            if not future.done():
                future.set_exception(ended)
        for stream in streams.values():
            stream.put_nowait(ended)

    def send(self, request: client_pb2.GenerateRequest) -> asyncio.Future[client_pb2.SessionEvent]:
        future: asyncio.Future[client_pb2.SessionEvent] = asyncio.get_running_loop().create_future()
        if (size := request.ByteSize()) > self._max_bytes:
            future.set_exception(too_large(request, size, self._max_bytes))
            return future
        if self.broken:
            future.set_exception(self.failure or _broken(None))
            return future
        self._futures[request.request_id] = future
        self._outbox.append((request, size))
        self._wake.set()
        return future

    def send_stream(
        self, request: client_pb2.GenerateRequest
    ) -> asyncio.Queue[client_pb2.SessionEvent | OmniError]:
        """Starts a streaming request; its events (chunks, then the end) arrive in order."""
        events: asyncio.Queue[client_pb2.SessionEvent | OmniError] = asyncio.Queue()
        if (size := request.ByteSize()) > self._max_bytes:
            events.put_nowait(too_large(request, size, self._max_bytes))
            return events
        if self.broken:
            events.put_nowait(self.failure or _broken(None))
            return events
        self._streams[request.request_id] = events
        self._outbox.append((request, size))
        self._wake.set()
        return events

    async def send_input(self, chunk: client_pb2.InputChunk) -> None:
        """Queues an input chunk of a request this session started; waits while the input
        already queued is at the bound (the coordinator reads no faster than the entry
        stage consumes). Raises OmniError when the session ended."""
        if (size := chunk.ByteSize()) > self._max_bytes:
            raise too_large_chunk(chunk, size, self._max_bytes)
        while self._queued_input >= _MAX_QUEUED_INPUT and not self.broken:
            self._input_room.clear()
            await self._input_room.wait()
        if self.broken:
            raise self.failure or _broken(None)
        self._queued_input += size
        self._outbox.append((chunk, size))
        self._wake.set()

    def live(self, request_id: str) -> bool:
        """Whether `request_id`, a streaming request sent here, has not ended yet."""
        return request_id in self._streams

    def abort(self, request_id: str, reason: str) -> None:
        self._streams.pop(request_id, None)
        self._futures.pop(request_id, None)
        self._aborts.append(client_pb2.AbortRequest(request_id=request_id, reason=reason))
        self._wake.set()

    async def close(self) -> None:
        """Ends the session; requests still waiting on it end with CANCELLED."""
        self._closing = True
        self._writer.cancel()
        self._call.cancel()
        for task in (self._writer, self._reader):
            try:
                await task
            except (asyncio.CancelledError, grpc.RpcError):
                pass


def _second(pair: tuple[object, int] | tuple[object, int, int]) -> int:
    return pair[1]


def too_large_chunk(chunk: client_pb2.InputChunk, size: int, max_bytes: int) -> OmniError:
    return OmniError(
        Code.RESOURCE_EXHAUSTED,
        f"input chunk {chunk.chunk_id} of {chunk.request_id[:80]!r}: {size} bytes exceed the "
        f"client's message limit of {max_bytes} bytes (max_message_mb); send smaller chunks",
    )
