"""The blocking client's Session stream against an in-process Omnirail server.

The call object must be gone when the client closes, without the cyclic GC: a call left
for the GC may be finalized at interpreter exit, after grpc's daemon threads died holding
the lock its __del__ takes, and the process then never exits.
"""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from omnirail import Chunk, Client, OmniError
from omnirail.client import sdk as client_module
from omnirail.client.sdk import AsyncClient
from omnirail.client.session import _close_open_sessions
from omnirail.relay.io import inline_payload
from omnirail.v1 import client_pb2, client_pb2_grpc
from omnirail.wire.errors import Code
from omnirail.wire.payload import pack, unpack


class _OneAnswer(client_pb2_grpc.OmnirailServicer):
    """Answers each streamed request with one text chunk and an empty result; a request
    with input "break" ends the whole Session call with an error instead, and one with
    input "silent" gets no answer. Aborts are recorded in `aborted`."""

    def __init__(self) -> None:
        self.aborted: list[tuple[str, str]] = []

    def Session(self, request_iterator: Iterator[Any], context: grpc.ServicerContext) -> Any:
        for batch in request_iterator:
            self.aborted += [(a.request_id, a.reason) for a in batch.abort]
            for request in batch.generate:
                inputs = unpack(request.inputs.header, request.inputs.inline_data)
                if "break" in inputs:
                    context.abort(grpc.StatusCode.INTERNAL, "session broken on purpose")
                if "silent" in inputs:
                    continue
                rid = request.request_id
                data = inline_payload(pack("hi"))
                chunk = client_pb2.Chunk(stage="s", modality="text", data=data)
                yield client_pb2.SessionEvents(
                    events=[
                        client_pb2.SessionEvent(request_id=rid, chunk=chunk),
                        client_pb2.SessionEvent(
                            request_id=rid, result=client_pb2.Result(request_id=rid)
                        ),
                    ]
                )


@pytest.fixture()
def servicer() -> _OneAnswer:
    return _OneAnswer()


@pytest.fixture()
def address(servicer: _OneAnswer) -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    client_pb2_grpc.add_OmnirailServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


@pytest.fixture()
def no_cyclic_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_closing_the_client_frees_the_session_call(address: str, no_cyclic_gc: None) -> None:
    client = Client(address, timeout=30)
    events = list(client.stream({"text": "x"}))
    assert isinstance(events[0], Chunk) and events[0].data == "hi"
    assert client._sess is not None
    call = weakref.ref(client._sess._call)
    client.close()
    assert call() is None, "the Session call outlived close(): only the cyclic GC frees it"


def test_a_broken_session_frees_its_call(address: str, no_cyclic_gc: None) -> None:
    client = Client(address, timeout=30)
    list(client.stream({"text": "x"}))
    assert client._sess is not None
    session = client._sess
    call = weakref.ref(session._call)
    with pytest.raises(OmniError) as info:
        list(client.stream({"text": "x", "break": 1}))
    assert info.value.code == Code.UNAVAILABLE and "broken on purpose" in info.value.message
    assert session.broken
    del session
    client.close()
    assert call() is None, "the broken call is held in a reference cycle"


def test_sessions_left_open_are_closed_at_exit(address: str, no_cyclic_gc: None) -> None:
    client = Client(address, timeout=30)  # never closed, as in a script that just ends
    list(client.stream({"text": "x"}))
    assert client._sess is not None
    call = weakref.ref(client._sess._call)
    _close_open_sessions()  # what atexit runs, while grpc's threads still run
    assert call() is None
    assert list(client.stream({"text": "x"}))  # a new session opens if used again
    client.close()


def _aborted(servicer: _OneAnswer, rid: str) -> str:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for request_id, reason in servicer.aborted:
            if request_id == rid:
                return reason
        time.sleep(0.01)
    raise AssertionError(f"no abort of {rid!r} reached the server")


def test_async_client_gives_up_after_its_deadline_and_aborts(
    address: str, servicer: _OneAnswer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client_module, "_DEADLINE_SLACK_S", 0.0)

    async def main() -> None:
        async with AsyncClient(address) as client:
            assert (await client.generate({"text": "x"}, timeout=5)).outputs == {}
            started = time.monotonic()
            with pytest.raises(OmniError) as info:
                await client.generate({"silent": 1}, request_id="quiet", timeout=0.3)
            assert time.monotonic() - started < 5
            assert info.value.code == Code.DEADLINE_EXCEEDED
            assert "no answer within 0.3s" in info.value.message
            # The session still serves later requests.
            assert (await client.generate({"text": "y"}, timeout=5)).outputs == {}

    asyncio.run(main())
    assert _aborted(servicer, "quiet") == "the client stopped waiting"


def test_async_client_cancelled_caller_aborts_the_request(
    address: str, servicer: _OneAnswer
) -> None:
    async def main() -> None:
        async with AsyncClient(address, timeout=30) as client:
            task = asyncio.create_task(client.generate({"silent": 1}, request_id="gone"))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert (await client.generate({"text": "y"})).outputs == {}

    asyncio.run(main())
    assert _aborted(servicer, "gone") == "the caller cancelled"


class _Sizes(_OneAnswer):
    """Records the byte size of each Session message it receives."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def Session(self, request_iterator: Iterator[Any], context: grpc.ServicerContext) -> Any:
        def recorded() -> Iterator[Any]:
            for batch in request_iterator:
                self.sizes.append(batch.ByteSize())
                yield batch

        yield from super().Session(recorded(), context)


@pytest.fixture()
def sizes_address() -> Iterator[tuple[str, _Sizes]]:
    servicer = _Sizes()
    # grpc's default receive limit (4 MiB): one message over it fails the whole stream.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    client_pb2_grpc.add_OmnirailServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(None)


def test_requests_that_fit_alone_go_out_in_writes_under_the_limit(
    sizes_address: tuple[str, _Sizes],
) -> None:
    import numpy as np

    address, servicer = sizes_address
    blob = np.ones(1_500_000, dtype=np.uint8)
    with Client(address, timeout=30, max_message_mb=4) as client:
        with futures.ThreadPoolExecutor(6) as pool:
            done = list(pool.map(lambda i: client.generate({"i": i, "blob": blob}), range(6)))
        assert len(done) == 6
        with pytest.raises(OmniError) as info:
            client.generate({"blob": np.ones(5 << 20, dtype=np.uint8)})
        assert info.value.code == Code.RESOURCE_EXHAUSTED
        client.generate({"after": 1})  # the session is whole
    assert max(servicer.sizes) <= 4 << 20


def test_the_async_client_splits_writes_and_fails_an_oversized_request_alone(
    sizes_address: tuple[str, _Sizes],
) -> None:
    import numpy as np

    address, servicer = sizes_address
    blob = np.ones(1_500_000, dtype=np.uint8)

    async def main() -> None:
        async with AsyncClient(address, timeout=30, max_message_mb=4) as client:
            big = asyncio.ensure_future(client.generate({"blob": np.ones(5 << 20, np.uint8)}))
            results = await asyncio.gather(
                *(client.generate({"i": i, "b": blob}) for i in range(6))
            )
            assert len(results) == 6
            with pytest.raises(OmniError) as info:
                await big
            assert info.value.code == Code.RESOURCE_EXHAUSTED

    asyncio.run(main())
    assert len(servicer.sizes) >= 3 and max(servicer.sizes) <= 4 << 20
