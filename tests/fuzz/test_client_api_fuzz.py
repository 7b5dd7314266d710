"""Fuzzing the client API of a real mesh: the quickstart, every field checked at its entry.

Each example is either Python values through the SDK (`Client.generate`) or a raw
`GenerateRequest` (random ids, deadlines, traceparents, payload headers and bodies,
relay descriptors a client has no business sending) on the plain `Generate` RPC. What may
come back: a result, or INVALID_ARGUMENT / RESOURCE_EXHAUSTED / DEADLINE_EXCEEDED naming
the problem. Never INTERNAL or UNKNOWN (a stage or the coordinator tripping over input),
never a hang; afterwards nothing is in flight and the mesh serves on.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from omnirail.client.sdk import Client
from omnirail.ops.launcher import Mesh
from omnirail.v1 import client_pb2, client_pb2_grpc, common_pb2
from omnirail.wire.errors import Code, OmniError
from omnirail.wire.payload import PayloadError, encode_inline
from tests.integration.conftest import REPO, wait_nothing_in_flight

pytestmark = pytest.mark.timeout(1200)

ALLOWED = {Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED, Code.DEADLINE_EXCEEDED}
ALLOWED_GRPC = {
    # A request naming a principal (`on_behalf_of`) without being a front door of the mesh.
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}


@pytest.fixture(scope="module")
def mesh() -> Iterator[Mesh]:
    with Mesh(REPO / "examples" / "quickstart" / "pipeline.yaml") as running:
        yield running


@pytest.fixture(scope="module")
def client(mesh: Mesh) -> Iterator[Client]:
    with Client(mesh.address or "", timeout=30, tensors="numpy") as sdk:
        yield sdk


@pytest.fixture(scope="module")
def stub(mesh: Mesh) -> Iterator[client_pb2_grpc.OmnirailStub]:
    with grpc.insecure_channel(mesh.address or "") as channel:
        yield client_pb2_grpc.OmnirailStub(channel)


leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.binary(max_size=12)
    | st.builds(lambda n: np.arange(n, dtype=np.int16), st.integers(0, 6))
)
values = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
# Mostly near what the quickstart takes (text, a small image_size), so requests reach the
# stages; sometimes anything at all.
inputs = st.one_of(
    st.fixed_dictionaries(
        {
            "text": st.one_of(st.text(min_size=1, max_size=24), values),
            # Small, so the 10,000 requests stay quick (the default is 128).
            "image_size": st.one_of(st.integers(0, 16), values),
        }
    ),
    st.dictionaries(st.text(max_size=10), values, max_size=3),
    values,
)


def _payload(draw: st.DrawFn) -> common_pb2.Payload:
    kind = draw(st.sampled_from(["valid", "header", "relay"]))
    if kind == "valid":
        try:
            return encode_inline(draw(st.dictionaries(st.text(max_size=6), values, max_size=3)))
        except PayloadError:  # a value the format cannot carry (an int past 64 bits)
            kind = "header"
    if kind == "header":
        return common_pb2.Payload(
            header=draw(st.binary(max_size=64)), inline_data=draw(st.binary(max_size=64))
        )
    relay = common_pb2.RelayDescriptor()
    try:
        relay.ParseFromString(draw(st.binary(max_size=48)))
    except Exception:  # not a descriptor's bytes: an empty one then
        pass
    return common_pb2.Payload(header=draw(st.binary(max_size=16)), relay=relay)


@st.composite
def raw_requests(draw: st.DrawFn) -> client_pb2.GenerateRequest:
    return client_pb2.GenerateRequest(
        request_id=draw(st.one_of(st.just(""), st.text(max_size=40))),
        inputs=_payload(draw),
        timeout_s=draw(
            st.one_of(st.just(0.0), st.floats(allow_nan=True, allow_infinity=True), st.just(2.0))
        ),
        traceparent=draw(st.one_of(st.just(""), st.text(max_size=60))),
        stream=draw(st.booleans()),
        conversation_id=draw(st.one_of(st.just(""), st.text(max_size=40))),
        on_behalf_of=draw(st.one_of(st.just(""), st.just("web"), st.text(max_size=70))),
    )


def _through_sdk(client: Client, value: Any) -> None:
    try:
        client.generate(value, timeout=20)
    except OmniError as exc:
        assert exc.code in ALLOWED, f"{exc} for {value!r:.300}"
    except (TypeError, ValueError) as exc:  # the SDK's own checks, before anything is sent
        raise AssertionError(f"untyped {type(exc).__name__} for {value!r:.300}") from exc


def _raw(stub: client_pb2_grpc.OmnirailStub, request: client_pb2.GenerateRequest) -> None:
    try:
        for _ in stub.Generate(request, timeout=30):
            pass
    except grpc.RpcError as exc:
        code = exc.code()  # type: ignore[attr-defined]
        assert code in ALLOWED_GRPC, f"{code}: {exc.details()} for {request!r:.400}"  # type: ignore[attr-defined]


@given(st.one_of(st.tuples(st.just("sdk"), inputs), st.tuples(st.just("raw"), raw_requests())))
def test_the_client_api_answers_only_with_typed_errors(
    client: Client, stub: client_pb2_grpc.OmnirailStub, case: tuple[str, Any]
) -> None:
    kind, value = case
    if kind == "sdk":
        _through_sdk(client, value)
    else:  # NaN, negative or huge deadlines too: the coordinator must refuse them itself
        _raw(stub, value)


def test_after_the_campaign_nothing_is_in_flight(client: Client) -> None:
    wait_nothing_in_flight(client, timeout=60)
    assert client.generate({"text": "still serving"}).output["patches"] > 0
