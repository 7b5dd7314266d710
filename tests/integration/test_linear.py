"""Linear pipeline in one process (LocalMesh: the same gRPC servers, shm between stage
hosts): results, failures, aborts, deadlines, bad input."""

from __future__ import annotations

import concurrent.futures
import threading
import time
import uuid

import grpc
import pytest

from omnirail.client.sdk import Client
from omnirail.testing.local_mesh import LocalMesh
from omnirail.v1 import client_pb2, client_pb2_grpc, common_pb2
from omnirail.wire.errors import Code, OmniError
from omnirail.wire.payload import encode_inline
from tests.integration.conftest import shm_names


@pytest.fixture
def client(linear_mesh: LocalMesh):
    with Client(linear_mesh.address or "", timeout=60) as c:
        yield c


def test_small_tensor_inline(client: Client) -> None:
    out = client.generate({"n": 4}).output
    assert out["sum"] == 2 * (0 + 1 + 2 + 3)
    assert out["n"] == 4


def test_large_tensor_through_shm(client: Client) -> None:
    n = 1 << 20  # 4 MiB of float32, far above the 1 KiB inline bound
    out = client.generate({"n": n}).output
    assert out["n"] == n
    assert out["sum"] == pytest.approx(float(n) * (n - 1), rel=1e-6)


def test_concurrent_requests_keep_their_results(client: Client) -> None:
    sizes = [3, 300, 3000, 30000, 70000] * 8  # mixes inline and relayed payloads
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(lambda n: client.generate({"n": n}).output, sizes))
    for n, out in zip(sizes, outs, strict=True):
        assert out["n"] == n
        assert out["sum"] == pytest.approx(float(n) * (n - 1), rel=1e-6)


def test_stage_error_names_stage_and_mesh_keeps_serving(client: Client) -> None:
    with pytest.raises(OmniError) as info:
        client.generate({"n": 4, "fail": "boom"})
    assert info.value.code == Code.INTERNAL
    assert info.value.stage == "double"
    assert "asked to fail: boom" in info.value.message
    assert client.generate({"n": 5}).output["n"] == 5


def test_deadline_exceeded(client: Client) -> None:
    with pytest.raises(OmniError) as info:
        client.generate({"n": 4, "sleep": 3}, timeout=0.5)
    assert info.value.code == Code.DEADLINE_EXCEEDED
    # The message says where the request stalled: the terminal stage gave no result.
    assert "no result yet from " in info.value.message


def test_submit_wait_and_status(client: Client) -> None:
    rid = client.submit({"n": 6})
    status = client.wait(rid, timeout=30)
    assert status.state == "completed"
    assert status.result is not None and status.result.output["n"] == 6
    assert client.status(rid).state == "completed"


def test_abort_mid_flight_frees_everything(client: Client, linear_mesh: LocalMesh) -> None:
    # Large payloads hold relay extents and credits (4 per edge) while `double` sleeps.
    n = 1 << 18
    rids = [f"abort-{i}-{time.monotonic_ns()}" for i in range(6)]
    errors: dict[str, OmniError] = {}

    def run(rid: str) -> None:
        try:
            client.generate({"n": n, "sleep": 2}, request_id=rid)
        except OmniError as exc:
            errors[rid] = exc

    threads = [threading.Thread(target=run, args=(rid,)) for rid in rids]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if all(_state(client, rid) == "running" for rid in rids):
            break
        time.sleep(0.05)
    for rid in rids:
        acked = client.abort(rid, reason="test abort")
        assert {a.split("/")[0] for a in acked.acknowledged} == {"source", "double", "summarize"}
    for t in threads:
        t.join(30)
    assert {rid: e.code for rid, e in errors.items()} == {rid: Code.CANCELLED for rid in rids}
    assert all(client.status(rid).state == "aborted" for rid in rids)
    # One pool segment (and its release marks) per sending process, nothing per message.
    assert len(shm_names(linear_mesh.shm_prefix)) <= 4
    # Credits came back: more large requests than the edge has credits all succeed.
    outs = [client.generate({"n": n}).output for _ in range(10)]
    assert all(o["n"] == n for o in outs)


def _state(client: Client, rid: str) -> str:
    try:
        return client.status(rid).state
    except OmniError:
        return "unknown"


def test_abort_unknown_request_is_not_found(client: Client) -> None:
    with pytest.raises(OmniError) as info:
        client.abort("no-such-request")
    assert info.value.code == Code.NOT_FOUND


def test_the_id_of_a_request_that_ended_can_be_used_again(client: Client) -> None:
    """Stages remember ended ids (to drop late items): a new request under the id of one
    that failed, was aborted or completed still runs (it used to wait for its deadline)."""
    rid = f"again-{uuid.uuid4().hex[:8]}"
    with pytest.raises(OmniError) as info:
        client.generate({"n": 4, "fail": "once"}, request_id=rid, timeout=10)
    assert info.value.code != Code.DEADLINE_EXCEEDED
    assert client.generate({"n": 4}, request_id=rid, timeout=10).output["sum"] == 12.0
    assert client.generate({"n": 2}, request_id=rid, timeout=10).output["sum"] == 2.0


def test_an_abort_that_overtakes_its_start_cancels_the_start(client: Client) -> None:
    """The abort comes first (another call): the request's start is refused with
    CANCELLED instead of running to its end; the id is free again afterwards."""
    rid = f"early-{uuid.uuid4().hex[:8]}"
    with pytest.raises(OmniError) as info:
        client.abort(rid, "changed my mind")
    assert info.value.code == Code.NOT_FOUND and "cancelled" in info.value.message
    with pytest.raises(OmniError) as info:
        client.generate({"n": 4}, request_id=rid)
    assert info.value.code == Code.CANCELLED
    assert "aborted before it started: changed my mind" in info.value.message
    assert client.generate({"n": 4}, request_id=rid).output["sum"] == 12.0
    assert client.generate({"n": 4}).output["sum"] == 12.0  # others never noticed


# ---- bad input on the raw client API ----------------------------------------------


@pytest.fixture
def stub(linear_mesh: LocalMesh):
    with grpc.insecure_channel(linear_mesh.address or "") as channel:
        yield client_pb2_grpc.OmnirailStub(channel)


def _generate(stub, request: client_pb2.GenerateRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request, timeout=30))
    return info.value


def test_garbage_header_is_invalid_argument(stub) -> None:
    bad = common_pb2.Payload(header=b"\xc1\xff garbage", inline_data=b"")
    err = _generate(stub, client_pb2.GenerateRequest(inputs=bad))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "inputs" in err.details()


def test_missing_inputs_is_invalid_argument(stub) -> None:
    err = _generate(stub, client_pb2.GenerateRequest())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "inputs" in err.details()


def test_inputs_must_be_a_mapping(stub) -> None:
    err = _generate(stub, client_pb2.GenerateRequest(inputs=encode_inline([1, 2, 3])))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "mapping" in err.details()


def test_bad_request_id_and_timeout(stub) -> None:
    inputs = encode_inline({"n": 1})
    err = _generate(stub, client_pb2.GenerateRequest(request_id="bad id!", inputs=inputs))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in err.details()
    # `$` would have let a trailing newline through.
    err = _generate(stub, client_pb2.GenerateRequest(request_id="ok-id\n", inputs=inputs))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in err.details()
    err = _generate(stub, client_pb2.GenerateRequest(inputs=inputs, timeout_s=-1))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "timeout_s" in err.details()


def test_oversized_input_is_resource_exhausted(client: Client) -> None:
    import numpy as np

    # The coordinator's limit is 32 MiB of inputs (max_input_mb); the message limit is 64 MiB.
    with pytest.raises(OmniError) as info:
        client.generate({"blob": np.zeros(40 << 20, dtype=np.uint8)})
    assert info.value.code == Code.RESOURCE_EXHAUSTED


def test_bodies_that_are_not_protobuf_are_invalid_argument(
    linear_mesh: LocalMesh, client: Client
) -> None:
    garbage = b"\xff\xff\xff"
    with grpc.insecure_channel(linear_mesh.address or "") as channel:
        calls = {
            "/omnirail.v1.Omnirail/Submit": lambda m: channel.unary_unary(m)(garbage, timeout=10),
            "/omnirail.v1.Omnirail/Generate": lambda m: list(
                channel.unary_stream(m)(garbage, timeout=10)
            ),
            "/omnirail.v1.Omnirail/Session": lambda m: list(
                channel.stream_stream(m)(iter([garbage]), timeout=10)
            ),
            "/omnirail.v1.Coordinator/Attach": lambda m: list(
                channel.stream_stream(m)(iter([garbage]), timeout=10)
            ),
        }
        for method, call in calls.items():
            with pytest.raises(grpc.RpcError) as info:
                call(method)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
            assert "not a valid protobuf message" in (info.value.details() or ""), method
    assert client.generate({"n": 3}).output["n"] == 3


def test_a_request_over_the_message_limit_fails_alone(client: Client) -> None:
    """65 MiB through the SDK while three requests share its Session: only it fails."""
    import numpy as np

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        others = [pool.submit(client.generate, {"n": n, "sleep": 1.0}) for n in (2, 3, 4)]
        time.sleep(0.3)  # the three are in flight on the shared stream
        with pytest.raises(OmniError) as info:
            client.generate({"blob": np.zeros(65 << 20, dtype=np.uint8)})
        assert [f.result(timeout=60).output["n"] for f in others] == [2, 3, 4]
    assert info.value.code == Code.RESOURCE_EXHAUSTED
    assert "exceed the client's message limit" in info.value.message
    assert client.generate({"n": 5}).output["n"] == 5  # the same session serves on


def test_the_async_client_sends_a_request_over_the_limit_alone(linear_mesh: LocalMesh) -> None:
    import asyncio

    import numpy as np

    from omnirail.client.sdk import AsyncClient

    async def main() -> None:
        async with AsyncClient(linear_mesh.address or "", timeout=60) as client:
            others = [
                asyncio.ensure_future(client.generate({"n": n, "sleep": 0.5})) for n in (2, 3, 4)
            ]
            with pytest.raises(OmniError) as info:
                await client.generate({"blob": np.zeros(65 << 20, dtype=np.uint8)})
            assert info.value.code == Code.RESOURCE_EXHAUSTED
            assert [r.output["n"] for r in await asyncio.gather(*others)] == [2, 3, 4]
            assert (await client.generate({"n": 5})).output["n"] == 5

    asyncio.run(main())


def test_client_rejects_non_mapping_and_unsupported_values(client: Client) -> None:
    with pytest.raises(OmniError) as info:
        client.generate([1, 2])  # type: ignore[arg-type]
    assert info.value.code == Code.INVALID_ARGUMENT
    with pytest.raises(OmniError) as info:
        client.generate({"x": {1, 2}})
    assert info.value.code == Code.INVALID_ARGUMENT


def test_health_and_reflection(linear_mesh: LocalMesh) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(linear_mesh.address or "") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(service="omnirail.v1.Omnirail"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = refl.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        names = {s.name for r in responses for s in r.list_services_response.service}
        assert {"omnirail.v1.Omnirail", "omnirail.v1.Coordinator", "grpc.health.v1.Health"} <= names


def test_generate_rpc_streams_the_result(stub) -> None:
    """The plain server-streaming Generate RPC (what grpcurl uses), not the SDK's Session."""
    from omnirail.wire.payload import decode_inline

    events = list(
        stub.Generate(client_pb2.GenerateRequest(inputs=encode_inline({"n": 3})), timeout=30)
    )
    assert len(events) == 1
    assert decode_inline(events[0].result.outputs["summarize"])["sum"] == 6.0


def test_generate_rpc_error_carries_stage_in_trailers(stub) -> None:
    request = client_pb2.GenerateRequest(inputs=encode_inline({"n": 3, "fail": "x"}))
    err = _generate(stub, request)
    assert err.code() == grpc.StatusCode.INTERNAL
    assert ("omnirail-stage", "double") in tuple(err.trailing_metadata() or ())


def test_session_requires_request_ids(linear_mesh: LocalMesh) -> None:
    with grpc.insecure_channel(linear_mesh.address or "") as channel:
        stub = client_pb2_grpc.OmnirailStub(channel)
        request = client_pb2.SessionRequest(
            generate=[client_pb2.GenerateRequest(inputs=encode_inline({"n": 1}))]
        )
        call = stub.Session(iter([request]), timeout=30)
        event = next(iter(call)).events[0]
        assert event.error.code == Code.INVALID_ARGUMENT
        assert "request_id" in event.error.message
        call.cancel()


def test_async_client_concurrent_and_cancel(linear_mesh: LocalMesh) -> None:
    import asyncio

    from omnirail.client.sdk import AsyncClient

    async def main() -> None:
        async with AsyncClient(linear_mesh.address or "", timeout=60) as client:
            outs = await asyncio.gather(*(client.generate({"n": n}) for n in range(1, 40)))
            assert [o.output["n"] for o in outs] == list(range(1, 40))
            rid = f"cancel-{time.monotonic_ns()}"
            task = asyncio.create_task(client.generate({"n": 2, "sleep": 5}, request_id=rid))
            for _ in range(600):
                if await _state_async(client, rid) == "running":
                    break
                await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(200):
                if (await client.status(rid)).state == "aborted":
                    break
                await asyncio.sleep(0.05)
            assert (await client.status(rid)).state == "aborted"

    asyncio.run(main())


async def _state_async(client, rid: str) -> str:
    try:
        return (await client.status(rid)).state
    except OmniError:
        return "unknown"


def test_describe_reports_replicas_and_load(client: Client) -> None:
    client.generate({"n": 2})
    info = client.describe()
    assert info.ready and info.entry_stage == "source"
    assert list(info.terminal_stages) == ["summarize"]
    by_name = {s.name: s for s in info.stages}
    assert set(by_name) == {"source", "double", "summarize"}
    for stage in by_name.values():
        assert len(stage.replicas) == 1 and stage.replicas[0].live
        assert stage.replicas[0].address.startswith("unix://")
    # Load is reported once a second: a request held in `double` shows up there.
    rid = client.submit({"n": 2, "sleep": 4})
    deadline = time.monotonic() + 10
    inflight = 0
    while time.monotonic() < deadline and not inflight:
        double = next(s for s in client.describe().stages if s.name == "double")
        inflight = double.replicas[0].inflight
        time.sleep(0.1)
    assert inflight == 1
    client.abort(rid)
