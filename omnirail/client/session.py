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
import concurrent.futures
import queue
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import grpc

from omnirail.v1 import client_pb2
from omnirail.wire.errors import Code, OmniError

# Bound on one write so a burst of large inputs stays under the message limit.
_MAX_BATCH = 64


def _broken(err: BaseException | None) -> OmniError:
    if isinstance(err, grpc.RpcError):
        error = OmniError.from_rpc_error(err)
        return OmniError(Code.UNAVAILABLE, f"session to the coordinator ended: {error.message}")
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

    def __init__(self, stub: Any) -> None:
        self._outgoing: queue.SimpleQueue[client_pb2.SessionRequest | None] = queue.SimpleQueue()
        self._futures: dict[str, concurrent.futures.Future[client_pb2.SessionEvent]] = {}
        self._streams: dict[str, queue.SimpleQueue[client_pb2.SessionEvent | OmniError]] = {}
        self._lock = threading.Lock()
        self.broken = False
        self._closing = False
        self._call = stub.Session(self._requests())
        self._reader = threading.Thread(target=self._read, name="omnirail-session", daemon=True)
        self._reader.start()
        _OPEN.add(self)

    def _requests(self) -> Iterator[client_pb2.SessionRequest]:
        while (first := self._outgoing.get()) is not None:
            batch = client_pb2.SessionRequest()
            batch.MergeFrom(first)
            while len(batch.generate) < _MAX_BATCH:
                try:
                    more = self._outgoing.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    yield batch
                    return
                batch.MergeFrom(more)
            yield batch

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
        with self._lock:
            self.broken = True
            waiting, self._futures = self._futures, {}
            streams, self._streams = self._streams, {}
        # Closed here (`close`): what waits ends as cancelled, like the async client's.
        ended = OmniError(Code.CANCELLED, "the client was closed") if self._closing else None
        for future in waiting.values():
            future.set_exception(ended or _broken(error))
        for stream in streams.values():
            stream.put(ended or _broken(error))

    def send(
        self, request: client_pb2.GenerateRequest
    ) -> concurrent.futures.Future[client_pb2.SessionEvent]:
        future: concurrent.futures.Future[client_pb2.SessionEvent] = concurrent.futures.Future()
        with self._lock:
            if self.broken:
                future.set_exception(_broken(None))
                return future
            self._futures[request.request_id] = future
        self._outgoing.put(client_pb2.SessionRequest(generate=[request]))
        return future

    def send_stream(
        self, request: client_pb2.GenerateRequest
    ) -> queue.SimpleQueue[client_pb2.SessionEvent | OmniError]:
        """Starts a streaming request; its events (chunks, then the end) arrive in order."""
        events: queue.SimpleQueue[client_pb2.SessionEvent | OmniError] = queue.SimpleQueue()
        with self._lock:
            if self.broken:
                events.put(_broken(None))
                return events
            self._streams[request.request_id] = events
        self._outgoing.put(client_pb2.SessionRequest(generate=[request]))
        return events

    def abort(self, request_id: str, reason: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
            future = self._futures.pop(request_id, None)
        if future is not None:
            future.set_exception(OmniError(Code.CANCELLED, reason))
        self._outgoing.put(
            client_pb2.SessionRequest(
                abort=[client_pb2.AbortRequest(request_id=request_id, reason=reason)]
            )
        )

    def close(self) -> None:
        call = self._call
        if call is None:
            return
        self._closing = True
        self._outgoing.put(None)
        call.cancel()
        self._reader.join(timeout=5)
        if not self._reader.is_alive():
            # The call is finalized on return, while grpc's threads still run (see `_read`).
            self._call = None


class AsyncSession:
    """For `AsyncClient`: a writer task and a reader task on the caller's loop."""

    def __init__(self, stub: Any) -> None:
        self._call = stub.Session()
        self._pending = client_pb2.SessionRequest()
        self._wake = asyncio.Event()
        self._futures: dict[str, asyncio.Future[client_pb2.SessionEvent]] = {}
        self._streams: dict[str, asyncio.Queue[client_pb2.SessionEvent | OmniError]] = {}
        self.broken = False
        self._closing = False
        loop = asyncio.get_running_loop()
        self._reader = loop.create_task(self._read())
        self._writer = loop.create_task(self._write())

    async def _write(self) -> None:
        try:
            while True:
                while not (self._pending.generate or self._pending.abort):
                    self._wake.clear()
                    await self._wake.wait()
                batch, self._pending = self._pending, client_pb2.SessionRequest()
                await self._call.write(batch)
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
        self.broken = True
        self._writer.cancel()
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
        if self.broken:
            future.set_exception(_broken(None))
            return future
        self._futures[request.request_id] = future
        self._pending.generate.append(request)
        self._wake.set()
        return future

    def send_stream(
        self, request: client_pb2.GenerateRequest
    ) -> asyncio.Queue[client_pb2.SessionEvent | OmniError]:
        """Starts a streaming request; its events (chunks, then the end) arrive in order."""
        events: asyncio.Queue[client_pb2.SessionEvent | OmniError] = asyncio.Queue()
        if self.broken:
            events.put_nowait(_broken(None))
            return events
        self._streams[request.request_id] = events
        self._pending.generate.append(request)
        self._wake.set()
        return events

    def abort(self, request_id: str, reason: str) -> None:
        self._streams.pop(request_id, None)
        self._futures.pop(request_id, None)
        self._pending.abort.add(request_id=request_id, reason=reason)
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
