"""Client SDK: `Client` (blocking) and `AsyncClient` (asyncio).

Imports without torch: inputs may hold numpy arrays or torch tensors (if the caller has
torch), outputs come back as the producing stage made them (torch tensors when torch is
importable, numpy otherwise).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from omnirail.client.connect import client_channel
from omnirail.client.input_stream import AsyncInputStream, InputStream
from omnirail.client.readiness import not_ready
from omnirail.client.session import AsyncSession, SyncSession
from omnirail.client.span import ClientSpan
from omnirail.config.limits import MAX_MESSAGE_MB
from omnirail.v1 import client_pb2, client_pb2_grpc, common_pb2
from omnirail.wire.errors import Code, OmniError, invalid
from omnirail.wire.payload import PayloadError, decode_inline, encode_inline

InputT = TypeVar("InputT", InputStream, AsyncInputStream)

# Extra seconds on the gRPC deadline so the coordinator's own deadline error wins.
_DEADLINE_SLACK_S = 2.0


@dataclass(frozen=True)
class GenerateResult:
    request_id: str
    # Output of each terminal stage that ran, by stage name.
    outputs: dict[str, Any]

    @property
    def output(self) -> Any:
        """The single terminal's output; the dict of all outputs when there are several."""
        if len(self.outputs) == 1:
            return next(iter(self.outputs.values()))
        return self.outputs


@dataclass(frozen=True)
class Chunk:
    """One stream chunk of a terminal stage, in order per (request, stage)."""

    request_id: str
    stage: str
    chunk_id: int
    modality: str
    data: Any


StreamEvent = Chunk | GenerateResult


@dataclass(frozen=True)
class AbortResult:
    """What an abort reached: the stage replicas ("stage/replica") that acknowledged their
    cleanup, and those that did not within the pipeline's abort_ack_timeout_s (a stopped or
    hung process; it drops the request when it next hears from the coordinator)."""

    request_id: str
    acknowledged: list[str]
    not_acknowledged: list[str]


def _abort_result(reply: client_pb2.AbortResponse) -> AbortResult:
    return AbortResult(reply.request_id, list(reply.acknowledged_by), list(reply.not_acknowledged))


def closed_error() -> OmniError:
    """What a call on a closed client raises (grpc's own is a bare ValueError)."""
    return OmniError(Code.FAILED_PRECONDITION, "the client is closed: make a new one")


@dataclass(frozen=True)
class RequestStatus:
    """A request's state (pending, running, completed, failed, aborted), how long it has
    run, and its result or error once it ended (`Client.wait`, `Client.status`)."""

    request_id: str
    state: str  # pending, running, completed, failed, aborted
    elapsed_s: float
    result: GenerateResult | None
    error: OmniError | None


def build_request(
    inputs: Mapping[str, Any],
    request_id: str | None,
    timeout: float | None,
    traceparent: str | None,
    stream: bool = False,
    input_stream: bool = False,
    conversation_id: str | None = None,
    on_behalf_of: str | None = None,
) -> client_pb2.GenerateRequest:
    if not isinstance(inputs, Mapping):
        raise invalid(f"inputs: expected a mapping of names to values, got {type(inputs).__name__}")
    try:
        timeout = _check_timeout(timeout)
    except ValueError as exc:
        raise invalid(str(exc)) from None
    try:
        payload = encode_inline(dict(inputs))
    except PayloadError as exc:
        raise invalid(f"inputs: {exc}") from None
    return client_pb2.GenerateRequest(
        request_id=request_id or uuid.uuid4().hex,
        inputs=payload,
        timeout_s=timeout or 0.0,
        traceparent=traceparent or "",
        stream=stream,
        input_stream=input_stream,
        conversation_id=_conversation(conversation_id),
        on_behalf_of=_principal(on_behalf_of),
    )


def _principal(on_behalf_of: str | None) -> str:
    if on_behalf_of is None:
        return ""
    if not isinstance(on_behalf_of, str) or not on_behalf_of:
        raise invalid(f"on_behalf_of: expected a principal's name, got {on_behalf_of!r}")
    return on_behalf_of


def _conversation(conversation_id: str | None) -> str:
    if conversation_id is None:
        return ""
    if not isinstance(conversation_id, str) or not conversation_id:
        raise invalid(f"conversation_id: expected a non-empty string, got {conversation_id!r}")
    return conversation_id


def parse_result(result: client_pb2.Result, numpy: bool = False) -> GenerateResult:
    outputs = {s: decode_inline(p, numpy_only=numpy) for s, p in result.outputs.items()}
    return GenerateResult(result.request_id, outputs)


def parse_chunk(request_id: str, chunk: client_pb2.Chunk, numpy: bool = False) -> Chunk:
    data = decode_inline(chunk.data, numpy_only=numpy)
    return Chunk(request_id, chunk.stage, chunk.chunk_id, chunk.modality, data)


def is_stream_end(event: client_pb2.SessionEvent | OmniError) -> bool:
    """Whether `event` ends a streaming request (its result, its error, a broken session)."""
    return isinstance(event, OmniError) or not event.HasField("chunk")


def end_stream(
    session: SyncSession | AsyncSession | None,
    request_id: str,
    ended: bool,
    error: BaseException | None,
    span: ClientSpan,
) -> None:
    """After a `stream()` loop: abort what the caller stopped reading, close the span."""
    if not ended and session is not None:
        session.abort(request_id, "the client stopped reading the stream")
    # The caller closing the iterator is an abort, not a failure of the request.
    span.end(None if isinstance(error, GeneratorExit) else error)


def open_input_stream(
    kind: type[InputT],
    session_of: Callable[[], Any],
    inputs: Mapping[str, Any],
    request_id: str | None,
    timeout: float | None,
    traceparent: str | None,
    conversation_id: str | None,
    numpy: bool,
) -> InputT:
    """Starts an input-streaming request on the client's session (`session_of`) and returns
    its `kind` (`InputStream` or `AsyncInputStream`)."""
    rid = request_id or uuid.uuid4().hex
    span = ClientSpan("input_stream", rid, traceparent)
    try:
        request = build_request(
            inputs,
            rid,
            timeout,
            span.traceparent,
            stream=True,
            input_stream=True,
            conversation_id=conversation_id,
        )
        session = session_of()
    except BaseException as exc:
        span.end(exc)
        raise
    events = session.send_stream(request)
    deadline = None if timeout is None else time.monotonic() + _deadline(timeout)
    return kind(
        session, rid, events, deadline, timeout, span,
        lambda event: stream_event(rid, event, numpy),
    )  # fmt: skip


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def stream_event(
    request_id: str, event: client_pb2.SessionEvent | OmniError, numpy: bool = False
) -> StreamEvent:
    """A chunk or the final result of a streaming request; raises for its error."""
    if isinstance(event, OmniError):
        raise event
    if event.HasField("chunk"):
        return parse_chunk(request_id, event.chunk, numpy)
    return event_result(event, numpy)


def parse_status(status: client_pb2.RequestStatus, numpy: bool = False) -> RequestStatus:
    state = common_pb2.RequestState.Name(status.state).lower()
    return RequestStatus(
        request_id=status.request_id,
        state=state,
        elapsed_s=status.elapsed_s,
        result=parse_result(status.result, numpy) if status.HasField("result") else None,
        error=OmniError.from_proto(status.error) if status.HasField("error") else None,
    )


def event_result(event: client_pb2.SessionEvent, numpy: bool = False) -> GenerateResult:
    if event.HasField("error"):
        raise OmniError.from_proto(event.error)
    return parse_result(event.result, numpy)


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else timeout + _DEADLINE_SLACK_S


def _check_timeout(timeout: float | None) -> float | None:
    """None (no deadline) or a finite number of seconds above 0; ValueError otherwise (a
    negative or nan deadline would be sent as none at all)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise ValueError(f"timeout must be a number of seconds or None, not {timeout!r}")
    if not 0 < timeout < math.inf:
        raise ValueError(f"timeout must be above 0 and finite (None: no deadline), not {timeout}")
    return float(timeout)


def _check_client(address: str, timeout: float | None, max_message_mb: int) -> None:
    if not isinstance(address, str) or not address.strip():
        raise ValueError(f"address must be 'unix:///path' or 'host:port', not {address!r}")
    _check_timeout(timeout)
    if isinstance(max_message_mb, bool) or not isinstance(max_message_mb, int):
        raise ValueError(f"max_message_mb must be an int, not {max_message_mb!r}")
    if not 1 <= max_message_mb <= MAX_MESSAGE_MB:  # the pipeline's own bound
        raise ValueError(f"max_message_mb must be 1-{MAX_MESSAGE_MB}, not {max_message_mb}")


def _numpy_only(tensors: str) -> bool:
    if tensors not in ("auto", "numpy"):
        raise ValueError(f"tensors must be 'auto' or 'numpy', not {tensors!r}")
    return tensors == "numpy"


class Client:
    """Blocking client. `address` is ``unix:///path`` or ``host:port``.

    `tensors="auto"` returns tensors as the stage sent them (torch tensors when torch is
    installed, imported on the first one); `"numpy"` returns numpy arrays only and never
    imports torch (what the CLI does: importing torch mid-stream takes seconds).

    A secured mesh: `tls` is True (the system's roots), a CA bundle's path, or None to
    follow ``OMNIRAIL_TLS_CA``; `token` is the bearer token (default ``OMNIRAIL_TOKEN``);
    `server_name` overrides the name the server's certificate is checked against.
    """

    def __init__(
        self,
        address: str,
        *,
        timeout: float | None = None,
        max_message_mb: int = 64,
        tensors: str = "auto",
        tls: bool | str | None = None,
        token: str | None = None,
        server_name: str | None = None,
    ) -> None:
        _check_client(address, timeout, max_message_mb)
        self.address = address
        self.timeout = timeout
        self._numpy = _numpy_only(tensors)
        self._max_bytes = max_message_mb << 20
        self._channel, self._md = client_channel(
            address,
            tls=tls,
            token=token,
            server_name=server_name,
            max_message_bytes=self._max_bytes,
            aio=False,
        )
        self._stub = client_pb2_grpc.OmnirailStub(self._channel)
        self._sess: SyncSession | None = None
        self._lock = threading.Lock()
        self._closed = False

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise closed_error()

    def close(self) -> None:
        """Ends the client: streams still being read end with CANCELLED, and any later call
        raises OmniError(FAILED_PRECONDITION)."""
        self._closed = True
        if self._sess is not None:
            self._sess.close()
            self._sess = None
        self._channel.close()

    def generate(
        self,
        inputs: Mapping[str, Any],
        *,
        request_id: str | None = None,
        timeout: float | None = None,
        traceparent: str | None = None,
        conversation_id: str | None = None,
    ) -> GenerateResult:
        """Runs one request over the client's Session stream and returns its result.
        `conversation_id`: the conversation the request is a turn of (its inputs carry the
        whole history; stages that keep state across turns reuse it)."""
        timeout = timeout if timeout is not None else self.timeout
        span = ClientSpan("generate", request_id := request_id or uuid.uuid4().hex, traceparent)
        try:
            result = self._generate(inputs, request_id, timeout, span.traceparent, conversation_id)
        except BaseException as exc:
            span.end(exc)
            raise
        span.end()
        return result

    def _generate(
        self,
        inputs: Mapping[str, Any],
        request_id: str,
        timeout: float | None,
        tp: str | None,
        conversation_id: str | None = None,
    ) -> GenerateResult:
        request = build_request(inputs, request_id, timeout, tp, conversation_id=conversation_id)
        session = self._session()
        future = session.send(request)
        try:
            event = future.result(timeout=_deadline(timeout))
        except concurrent.futures.TimeoutError:
            session.abort(request.request_id, "the client stopped waiting")
            raise OmniError(Code.DEADLINE_EXCEEDED, f"no answer within {timeout}s") from None
        except BaseException:
            if not future.done():  # interrupted: nobody will wait for it any more
                session.abort(request.request_id, "the client stopped waiting")
            raise
        return event_result(event, self._numpy)

    def stream(
        self,
        inputs: Mapping[str, Any],
        *,
        request_id: str | None = None,
        timeout: float | None = None,
        traceparent: str | None = None,
        conversation_id: str | None = None,
    ) -> Iterator[StreamEvent]:
        """Runs one request, yielding each `Chunk` as terminal stages make it, then the
        `GenerateResult`. Raises OmniError when the request fails. Closing the iterator
        early (break, exception) aborts the request everywhere."""
        timeout = timeout if timeout is not None else self.timeout
        rid = request_id or uuid.uuid4().hex
        span = ClientSpan("stream", rid, traceparent)
        session: SyncSession | None = None
        error: BaseException | None = None
        ended = False
        try:
            request = build_request(
                inputs, rid, timeout, span.traceparent, stream=True, conversation_id=conversation_id
            )
            session = self._session()
            events = session.send_stream(request)
            deadline = None if timeout is None else time.monotonic() + _deadline(timeout)
            while not ended:
                try:
                    event = events.get(timeout=_remaining(deadline))
                except queue.Empty:
                    raise OmniError(
                        Code.DEADLINE_EXCEEDED, f"no answer within {timeout}s"
                    ) from None
                ended = is_stream_end(event)
                yield stream_event(rid, event, self._numpy)
        except BaseException as exc:
            error = exc
            raise
        finally:
            end_stream(session, rid, ended, error, span)

    def input_stream(
        self,
        inputs: Mapping[str, Any],
        *,
        request_id: str | None = None,
        timeout: float | None = None,
        traceparent: str | None = None,
        conversation_id: str | None = None,
    ) -> InputStream:
        """Starts a request that takes input while it runs (its pipeline sets
        `input_stream`): `send()` chunks into it from one thread, `end()` the input, and
        iterate it for its events (each `Chunk`, then the `GenerateResult`), possibly from
        another. Use it in a `with` block: leaving it before the request ended aborts it.

            with client.input_stream({"rate": 16000}) as request:
                for piece in pieces:
                    request.send(piece)
                request.end()
                for event in request:
                    ...
        """
        timeout = timeout if timeout is not None else self.timeout
        return open_input_stream(
            InputStream,
            self._session,
            inputs,
            request_id,
            timeout,
            traceparent,
            conversation_id,
            self._numpy,
        )

    def _session(self) -> SyncSession:
        self._check_open()
        with self._lock:
            if self._sess is None or self._sess.broken:
                self._sess = SyncSession(self._stub, self._max_bytes, self._md)
            return self._sess

    def submit(
        self,
        inputs: Mapping[str, Any],
        *,
        request_id: str | None = None,
        timeout: float | None = None,
        conversation_id: str | None = None,
    ) -> str:
        """Starts a request and returns its id at once; `wait` or `status` fetch its result
        (the coordinator keeps the results of submitted requests)."""
        self._check_open()
        request = build_request(
            inputs, request_id, timeout or self.timeout, None, conversation_id=conversation_id
        )
        try:
            return self._stub.Submit(request, metadata=self._md).request_id
        except grpc.RpcError as err:
            raise OmniError.from_rpc_error(err) from None

    def wait(self, request_id: str, timeout: float | None = None) -> RequestStatus:
        """Waits (up to `timeout` seconds) for a submitted request to end and returns its
        status: state, result or error."""
        self._check_open()
        try:
            status = self._stub.Wait(
                client_pb2.RequestRef(request_id=request_id), timeout=timeout, metadata=self._md
            )
        except grpc.RpcError as err:
            raise OmniError.from_rpc_error(err) from None
        return parse_status(status, self._numpy)

    def status(self, request_id: str) -> RequestStatus:
        """A request's status now (pending, running, completed, failed, aborted), without
        waiting."""
        self._check_open()
        try:
            status = self._stub.GetRequest(
                client_pb2.RequestRef(request_id=request_id), metadata=self._md
            )
            return parse_status(status, self._numpy)
        except grpc.RpcError as err:
            raise OmniError.from_rpc_error(err) from None

    def abort(self, request_id: str, reason: str = "") -> AbortResult:
        """Aborts a request everywhere; returns which stage replicas acknowledged (within
        the pipeline's abort_ack_timeout_s) and which did not."""
        self._check_open()
        try:
            reply = self._stub.Abort(
                client_pb2.AbortRequest(request_id=request_id, reason=reason), metadata=self._md
            )
        except grpc.RpcError as err:
            raise OmniError.from_rpc_error(err) from None
        return _abort_result(reply)

    def close_conversation(self, conversation_id: str) -> None:
        """Every stage drops what it keeps of the conversation now (its state is bounded
        and expires anyway). Its requests (`conversation_id=` on `generate`, `stream`,
        `input_stream`, `submit`) keep working: a later turn rebuilds the state."""
        self._check_open()
        ref = client_pb2.ConversationRef(conversation_id=_conversation(conversation_id))
        try:
            self._stub.CloseConversation(ref, metadata=self._md)
        except grpc.RpcError as err:
            raise OmniError.from_rpc_error(err) from None

    def describe(self) -> client_pb2.PipelineInfo:
        """The pipeline the coordinator serves: its stages, their live replicas and the
        metrics endpoints (`metrics_address`)."""
        self._check_open()
        try:
            return self._stub.DescribePipeline(
                client_pb2.DescribePipelineRequest(), metadata=self._md
            )
        except grpc.RpcError as err:
            raise OmniError.from_rpc_error(err) from None

    def wait_ready(
        self,
        timeout: float = 30.0,
        *,
        replicas: Mapping[str, int] | None = None,
        on_wait: Callable[[str], None] | None = None,
    ) -> None:
        """Blocks until every stage of the pipeline has a live replica (with `replicas`,
        until each named stage has that many). `on_wait(reason)` runs before each retry
        (the launcher checks its processes there; what it raises ends the wait)."""
        self._check_open()
        deadline = time.monotonic() + timeout
        while True:
            try:
                reason = not_ready(self.describe(), replicas)
            except OmniError as exc:
                reason = f"waiting for the coordinator ({exc.code_name})"
            if not reason:
                return
            if on_wait is not None:
                on_wait(reason)
            if time.monotonic() > deadline:
                raise OmniError(
                    Code.UNAVAILABLE,
                    f"pipeline at {self.address} not ready after {timeout}s: {reason}",
                )
            time.sleep(0.05)


class AsyncClient:
    """asyncio client; the same calls as `Client`, awaited."""

    def __init__(
        self,
        address: str,
        *,
        timeout: float | None = None,
        max_message_mb: int = 64,
        tensors: str = "auto",
        tls: bool | str | None = None,
        token: str | None = None,
        server_name: str | None = None,
        metadata: Sequence[tuple[str, str]] = (),
    ) -> None:
        """`metadata`: more call metadata on every call (a front door of the mesh shows the
        mesh secret with it, to name the principal of each request: `on_behalf_of`)."""
        _check_client(address, timeout, max_message_mb)
        self.address = address
        self.timeout = timeout
        self._numpy = _numpy_only(tensors)
        self._max_bytes = max_message_mb << 20
        self._channel, self._md = client_channel(
            address,
            tls=tls,
            token=token,
            server_name=server_name,
            max_message_bytes=self._max_bytes,
            aio=True,
        )
        self._md = (*self._md, *metadata)
        self._stub = client_pb2_grpc.OmnirailStub(self._channel)
        self._sess: AsyncSession | None = None
        self._closed = False

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise closed_error()

    async def close(self) -> None:
        """Ends the client: streams still being read end with CANCELLED, and any later call
        raises OmniError(FAILED_PRECONDITION)."""
        self._closed = True
        if self._sess is not None:
            await self._sess.close()
            self._sess = None
        await self._channel.close()

    async def generate(
        self,
        inputs: Mapping[str, Any],
        *,
        request_id: str | None = None,
        timeout: float | None = None,
        traceparent: str | None = None,
        conversation_id: str | None = None,
        on_behalf_of: str | None = None,
    ) -> GenerateResult:
        """Runs one request over the client's Session stream and returns its result.
        `conversation_id`: the conversation the request is a turn of (its inputs carry the
        whole history; stages that keep state across turns reuse it). `on_behalf_of`: the
        principal the request is for, for front doors that show the mesh secret
        (`metadata`); others' requests are their token's."""
        timeout = timeout if timeout is not None else self.timeout
        span = ClientSpan("generate", request_id := request_id or uuid.uuid4().hex, traceparent)
        try:
            result = await self._generate(
                inputs, request_id, timeout, span.traceparent, conversation_id, on_behalf_of
            )
        except BaseException as exc:
            span.end(exc)
            raise
        span.end()
        return result

    async def _generate(
        self,
        inputs: Mapping[str, Any],
        request_id: str,
        timeout: float | None,
        tp: str | None,
        conversation_id: str | None = None,
        on_behalf_of: str | None = None,
    ) -> GenerateResult:
        request = build_request(
            inputs,
            request_id,
            timeout,
            tp,
            conversation_id=conversation_id,
            on_behalf_of=on_behalf_of,
        )
        session = self._session()
        future = session.send(request)
        try:
            event = await asyncio.wait_for(asyncio.shield(future), _deadline(timeout))
        except TimeoutError:
            session.abort(request.request_id, "the client stopped waiting")
            raise OmniError(Code.DEADLINE_EXCEEDED, f"no answer within {timeout}s") from None
        except asyncio.CancelledError:
            session.abort(request.request_id, "the caller cancelled")
            raise
        return event_result(event, self._numpy)

    async def stream(
        self,
        inputs: Mapping[str, Any],
        *,
        request_id: str | None = None,
        timeout: float | None = None,
        traceparent: str | None = None,
        conversation_id: str | None = None,
        on_behalf_of: str | None = None,
    ) -> AsyncIterator[StreamEvent]:
        """`Client.stream`, as an async iterator; cancelling or closing it aborts the request.
        `on_behalf_of`: as in `generate`."""
        timeout = timeout if timeout is not None else self.timeout
        rid = request_id or uuid.uuid4().hex
        span = ClientSpan("stream", rid, traceparent)
        session: AsyncSession | None = None
        error: BaseException | None = None
        ended = False
        try:
            request = build_request(
                inputs,
                rid,
                timeout,
                span.traceparent,
                stream=True,
                conversation_id=conversation_id,
                on_behalf_of=on_behalf_of,
            )
            session = self._session()
            events = session.send_stream(request)
            deadline = None if timeout is None else time.monotonic() + _deadline(timeout)
            while not ended:
                try:
                    event = await asyncio.wait_for(events.get(), _remaining(deadline))
                except TimeoutError:
                    raise OmniError(
                        Code.DEADLINE_EXCEEDED, f"no answer within {timeout}s"
                    ) from None
                ended = is_stream_end(event)
                yield stream_event(rid, event, self._numpy)
        except BaseException as exc:
            error = exc
            raise
        finally:
            end_stream(session, rid, ended, error, span)

    def input_stream(
        self,
        inputs: Mapping[str, Any],
        *,
        request_id: str | None = None,
        timeout: float | None = None,
        traceparent: str | None = None,
        conversation_id: str | None = None,
    ) -> AsyncInputStream:
        """`Client.input_stream`, with `await send()`, `await end()` and `async for`:

        async with client.input_stream({"rate": 16000}) as request:
            for piece in pieces:
                await request.send(piece)
            await request.end()
            async for event in request:
                ...
        """
        timeout = timeout if timeout is not None else self.timeout
        return open_input_stream(
            AsyncInputStream,
            self._session,
            inputs,
            request_id,
            timeout,
            traceparent,
            conversation_id,
            self._numpy,
        )

    def _session(self) -> AsyncSession:
        self._check_open()
        if self._sess is None or self._sess.broken:
            self._sess = AsyncSession(self._stub, self._max_bytes, self._md)
        return self._sess

    async def submit(
        self,
        inputs: Mapping[str, Any],
        *,
        request_id: str | None = None,
        timeout: float | None = None,
        conversation_id: str | None = None,
    ) -> str:
        """Starts a request and returns its id at once; `wait` or `status` fetch its result
        (the coordinator keeps the results of submitted requests)."""
        self._check_open()
        request = build_request(
            inputs, request_id, timeout or self.timeout, None, conversation_id=conversation_id
        )
        try:
            return (await self._stub.Submit(request, metadata=self._md)).request_id
        except grpc.RpcError as err:
            raise OmniError.from_rpc_error(err) from None

    async def wait(self, request_id: str, timeout: float | None = None) -> RequestStatus:
        """Waits (up to `timeout` seconds) for a submitted request to end and returns its
        status: state, result or error."""
        self._check_open()
        try:
            status = await self._stub.Wait(
                client_pb2.RequestRef(request_id=request_id), timeout=timeout, metadata=self._md
            )
        except grpc.RpcError as err:
            raise OmniError.from_rpc_error(err) from None
        return parse_status(status, self._numpy)

    async def status(self, request_id: str) -> RequestStatus:
        """A request's status now (pending, running, completed, failed, aborted), without
        waiting."""
        self._check_open()
        try:
            status = await self._stub.GetRequest(
                client_pb2.RequestRef(request_id=request_id), metadata=self._md
            )
            return parse_status(status, self._numpy)
        except grpc.RpcError as err:
            raise OmniError.from_rpc_error(err) from None

    async def abort(self, request_id: str, reason: str = "") -> AbortResult:
        """`Client.abort`, awaited."""
        self._check_open()
        try:
            reply = await self._stub.Abort(
                client_pb2.AbortRequest(request_id=request_id, reason=reason), metadata=self._md
            )
        except grpc.RpcError as err:
            raise OmniError.from_rpc_error(err) from None
        return _abort_result(reply)

    async def close_conversation(self, conversation_id: str) -> None:
        """`Client.close_conversation`, awaited."""
        self._check_open()
        ref = client_pb2.ConversationRef(conversation_id=_conversation(conversation_id))
        try:
            await self._stub.CloseConversation(ref, metadata=self._md)
        except grpc.RpcError as err:
            raise OmniError.from_rpc_error(err) from None

    async def describe(self) -> client_pb2.PipelineInfo:
        """The pipeline the coordinator serves: its stages, their live replicas and the
        metrics endpoints (`metrics_address`)."""
        self._check_open()
        try:
            return await self._stub.DescribePipeline(
                client_pb2.DescribePipelineRequest(), metadata=self._md
            )
        except grpc.RpcError as err:
            raise OmniError.from_rpc_error(err) from None
