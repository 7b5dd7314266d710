"""Garbage on a Deliver stream, and a stage process that dies mid-request: its requests fail
with UNAVAILABLE, and the launcher restarts it (or, with no restarts left, leaves it down
while the mesh keeps answering)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omnirail.client.sdk import Client
from omnirail.ops.launcher import Mesh
from omnirail.transport.members import MemberCredentials
from omnirail.v1 import common_pb2, mesh_pb2, mesh_pb2_grpc
from omnirail.wire.errors import Code, OmniError
from omnirail.wire.payload import encode_inline
from tests.integration.conftest import PIPELINES, generate_when_back, shm_names, start_mesh
from tests.integration.members import member_of


def _stage_address(client: Client, stage: str) -> str:
    info = client.describe()
    return next(s.replicas[0].address for s in info.stages if s.name == stage)


def _deliver(
    address: str, items: list[mesh_pb2.DeliverItem], member: MemberCredentials
) -> list[mesh_pb2.Ack]:
    with grpc.insecure_channel(address) as channel:
        call = mesh_pb2_grpc.StageStub(channel).Deliver(
            iter([mesh_pb2.DeliverBatch(sender="test", items=items)]),
            timeout=10,
            metadata=member.metadata(),
        )
        acks: list[mesh_pb2.Ack] = []
        try:
            for batch in call:
                acks.extend(batch.acks)
        except grpc.RpcError:
            pass
        return acks


def test_garbage_on_deliver_fails_items_not_the_stage() -> None:
    mesh = start_mesh("linear")
    try:
        with Client(mesh.address or "", timeout=30) as client:
            address = _stage_address(client, "double")
            with grpc.insecure_channel(address) as channel:  # stages serve health too
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            bad_region = common_pb2.Payload(
                header=encode_inline({"x": 1}).header,
                relay=common_pb2.RelayDescriptor(
                    backend="shm", region="../../etc/passwd", nbytes=8
                ),
            )
            outside = common_pb2.Payload(
                header=encode_inline({"x": 1}).header,
                relay=common_pb2.RelayDescriptor(
                    backend="shm", region=f"{mesh.shm_prefix}-nope-0", offset=1 << 40, nbytes=8
                ),
            )
            items = [
                mesh_pb2.DeliverItem(
                    seq=1,
                    request_id="g1",
                    from_stage="source",
                    to_stage="double",
                    payload=common_pb2.Payload(header=b"\xff\x00junk"),
                ),
                mesh_pb2.DeliverItem(
                    seq=2,
                    request_id="g2",
                    from_stage="source",
                    to_stage="double",
                    payload=bad_region,
                ),
                mesh_pb2.DeliverItem(
                    seq=3, request_id="g3", from_stage="source", to_stage="double", payload=outside
                ),
                mesh_pb2.DeliverItem(
                    seq=4,
                    request_id="g4",
                    from_stage="source",
                    to_stage="nope",
                    payload=encode_inline({}),
                ),
            ]
            # Sent as a member (a draining replica of `source`): strangers are refused
            # before any item is looked at (tests/unit/stage_service/test_host_members.py).
            with member_of(mesh.address or "", "source") as member:
                acks = {a.seq: a for a in _deliver(address, items, member)}
            # Relayed garbage and unknown targets are refused with a reason.
            for seq in (2, 3, 4):
                assert acks[seq].error.code == Code.INVALID_ARGUMENT, acks
            assert "nope" in acks[4].error.message
            # The stage still serves real requests.
            assert client.generate({"n": 3}).output["n"] == 3
            assert client.generate({"n": 100000}).output["n"] == 100000
    finally:
        mesh.stop()


def _kill_mid_request(mesh: Mesh, client: Client) -> tuple[int, float]:
    """Three 20 s requests at `double`, then SIGKILL of its process: each fails with
    UNAVAILABLE naming the stage, well before its compute or deadline would end it."""
    errors: list[OmniError] = []
    started = time.monotonic()

    def run() -> None:
        try:
            client.generate({"n": 4, "sleep": 20}, timeout=60)
        except OmniError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    pid = mesh.processes()["stage-double"]
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(30)
    assert [e.code for e in errors] == [Code.UNAVAILABLE] * 3
    assert all(e.stage == "double" for e in errors)
    assert time.monotonic() - started < 15  # well before the 20 s compute / 60 s deadline
    return pid, started


def test_killed_stage_fails_inflight_requests_and_is_restarted() -> None:
    mesh = start_mesh("linear")
    try:
        with Client(mesh.address or "", timeout=60) as client:
            client.generate({"n": 100000})  # relayed: `double` makes shared memory
            made = f"{mesh.shm_prefix}-{mesh.processes()['stage-double']}."
            assert any(n.startswith(made) for n in shm_names(mesh.shm_prefix))
            pid, _ = _kill_mid_request(mesh, client)
            # The launcher starts it again; it registers and serves with no one asking.
            out = generate_when_back(client, mesh, time.monotonic() + 90)
            assert out["sum"] == 12.0 and out["pid"] != pid
            # What the killed process had made in shared memory is gone with it.
            theirs = [
                n for n in shm_names(mesh.shm_prefix) if n.startswith(f"{mesh.shm_prefix}-{pid}.")
            ]
            assert theirs == []
        status = mesh.status()["stage-double"]
        assert (status["state"], status["restarts"]) == ("running", 1)
        assert status["last_exit"]["code"] == -signal.SIGKILL
        assert mesh.poll_exited() == []
    finally:
        mesh.stop()
    assert shm_names(mesh.shm_prefix) == []


def test_a_stage_out_of_restarts_stays_down_and_the_mesh_keeps_answering(
    tmp_path: Path,
) -> None:
    cfg = yaml.safe_load((PIPELINES / "linear.yaml").read_text())
    cfg["stages"][1]["restart"] = {"max": 0}
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg))
    mesh = Mesh(path)
    mesh.start(timeout=240)
    try:
        with Client(mesh.address or "", timeout=60) as client:
            _kill_mid_request(mesh, client)
            # New requests are refused at once while the stage is gone.
            with pytest.raises(OmniError) as info:
                client.generate({"n": 1})
            assert info.value.code == Code.UNAVAILABLE
            assert "double" in info.value.message
        deadline = time.monotonic() + 10
        while mesh.status()["stage-double"]["state"] != "stopped":
            assert time.monotonic() < deadline, mesh.status()
            time.sleep(0.05)
        assert mesh.poll_exited() == []  # the coordinator and the other stages run on
        with Client(mesh.address or "", timeout=60) as client:
            assert client.describe().stages  # the coordinator still answers
    finally:
        mesh.stop()
    assert shm_names(mesh.shm_prefix) == []
