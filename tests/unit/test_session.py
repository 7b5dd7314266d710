"""The blocking client's Session stream against an in-process Omnirail server.

The call object must be gone when the client closes, without the cyclic GC: a call left
for the GC may be finalized at interpreter exit, after grpc's daemon threads died holding
the lock its __del__ takes, and the process then never exits.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from omnirail import Chunk, Client, OmniError
from omnirail.errors import Code
from omnirail.payload import pack, unpack
from omnirail.session import _close_open_sessions
from omnirail.v1 import client_pb2, client_pb2_grpc
from relay.io import inline_payload


class _OneAnswer(client_pb2_grpc.OmnirailServicer):
    """Answers each streamed request with one text chunk and an empty result; a request
    with input "break" ends the whole Session call with an error instead."""

    def Session(self, request_iterator: Iterator[Any], context: grpc.ServicerContext) -> Any:
        for batch in request_iterator:
            for request in batch.generate:
                if "break" in unpack(request.inputs.header, request.inputs.inline_data):
                    context.abort(grpc.StatusCode.INTERNAL, "session broken on purpose")
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
def address() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    client_pb2_grpc.add_OmnirailServicer_to_server(_OneAnswer(), server)
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
