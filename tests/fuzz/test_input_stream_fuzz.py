"""Fuzzing input streams: random Session messages of requests and their input chunks.

Each example is one Session on the in-process mesh of an input-stream pipeline: requests
(with and without `input_stream`, some ids repeated), input chunks for them and for ids
nobody started (any chunk id, done marks, valid payloads, garbage headers, relay
descriptors), then either the end marks of every stream or aborts. What may come back for
each request: its result, or INVALID_ARGUMENT / NOT_FOUND / RESOURCE_EXHAUSTED / CANCELLED /
DEADLINE_EXCEEDED naming the problem; the Session ends OK; afterwards nothing is held
anywhere and the mesh serves on.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnirail.testing.local_mesh import LocalMesh
from omnirail.v1 import client_pb2, client_pb2_grpc, common_pb2
from omnirail.wire.errors import Code
from omnirail.wire.payload import encode_inline
from tests.fuzz.conftest import EXAMPLES
from tests.integration.conftest import PIPELINES
from tests.integration.test_input_stream import _nothing_left

pytestmark = pytest.mark.timeout(1200)

ALLOWED = {
    Code.INVALID_ARGUMENT,
    Code.NOT_FOUND,
    Code.RESOURCE_EXHAUSTED,
    Code.CANCELLED,
    Code.DEADLINE_EXCEEDED,
}
IDS = ["a", "b", "c"]


@pytest.fixture(scope="module")
def mesh() -> Iterator[LocalMesh]:
    with LocalMesh(PIPELINES / "input_stream.yaml", timeout=120) as local:
        yield local


@st.composite
def payloads(draw: st.DrawFn) -> common_pb2.Payload:
    kind = draw(st.sampled_from(["array", "value", "garbage", "relay"]))
    if kind == "array":
        return encode_inline(np.full(draw(st.integers(0, 8)), 1.0, np.float32))
    if kind == "value":
        return encode_inline(draw(st.one_of(st.text(max_size=8), st.integers(-9, 9))))
    if kind == "garbage":
        return common_pb2.Payload(
            header=draw(st.binary(max_size=32)), inline_data=draw(st.binary(max_size=32))
        )
    return common_pb2.Payload(header=b"\x80", relay=common_pb2.RelayDescriptor(backend="shm"))


@st.composite
def sessions(draw: st.DrawFn) -> list[client_pb2.SessionRequest]:
    starts = [
        client_pb2.GenerateRequest(
            request_id=rid,
            inputs=encode_inline({}),
            input_stream=draw(st.booleans()),
            stream=draw(st.booleans()),
            timeout_s=10.0,
        )
        for rid in draw(st.lists(st.sampled_from(IDS), max_size=4))
    ]
    chunks = draw(
        st.lists(
            st.builds(
                client_pb2.InputChunk,
                request_id=st.sampled_from([*IDS, "nobody", ""]),
                chunk_id=st.integers(0, 4),
                data=st.one_of(st.none(), payloads()),
                done=st.booleans(),
                modality=st.text(max_size=6),
            ),
            max_size=8,
        )
    )
    messages = [client_pb2.SessionRequest(generate=starts[:2], input=chunks[:4])]
    messages.append(client_pb2.SessionRequest(generate=starts[2:], input=chunks[4:]))
    rids = {s.request_id for s in starts}
    if draw(st.booleans()):
        # End every stream, counting the chunks as a client would have (maybe wrongly).
        messages.append(
            client_pb2.SessionRequest(
                input=[
                    client_pb2.InputChunk(
                        request_id=rid, chunk_id=draw(st.integers(0, 5)), done=True
                    )
                    for rid in sorted(rids)
                ]
            )
        )
    else:
        messages.append(
            client_pb2.SessionRequest(
                abort=[client_pb2.AbortRequest(request_id=rid) for rid in sorted(rids)]
            )
        )
    return messages


def _run(
    mesh: LocalMesh, messages: list[client_pb2.SessionRequest]
) -> list[client_pb2.SessionEvent]:
    async def run() -> list[client_pb2.SessionEvent]:
        assert mesh.address is not None
        events: list[client_pb2.SessionEvent] = []
        async with grpc.aio.insecure_channel(mesh.address) as channel:
            call = client_pb2_grpc.OmnirailStub(channel).Session()
            for message in messages:
                await call.write(message)
            await call.done_writing()
            async for batch in call:
                events.extend(batch.events)
            assert await call.code() == grpc.StatusCode.OK
        return events

    return mesh.run(run(), timeout=60)


@settings(max_examples=max(1, EXAMPLES // 20))
@given(sessions())
def test_input_streams_answer_only_with_typed_errors(
    mesh: LocalMesh, messages: list[client_pb2.SessionRequest]
) -> None:
    for event in _run(mesh, messages):
        if event.HasField("error"):
            assert event.error.code in ALLOWED, f"{event.error} for {messages}"


def test_after_the_campaign_nothing_is_left(mesh: LocalMesh) -> None:
    _nothing_left(mesh, timeout=30)
    with mesh.client(timeout=30) as client, client.input_stream({}) as request:
        request.send(np.ones(3, np.float32))
        request.end()
        assert list(request)[-1].outputs["listen"] == {"chunks": 1, "total": 3.0}
