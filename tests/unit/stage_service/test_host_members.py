"""The stage host's Deliver server authenticates each stream's sender (its member token,
omnirail/transport/members.py) and reads only relay descriptors that sender may name:
on a LocalMesh (the real `StageHost` and coordinator in this process)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import grpc
import numpy as np
import pytest

from omnirail.config import PipelineConfig
from omnirail.stage_service.attach import AttachClient
from omnirail.testing.local_mesh import LocalMesh
from omnirail.transport.members import MemberCredentials, new_token
from omnirail.v1 import common_pb2, mesh_pb2, mesh_pb2_grpc
from omnirail.wire.payload import pack
from tests.unit.local_stages import stage

WAIT_S = 20.0
LINE = PipelineConfig.from_dict(
    {"name": "host-members", "stages": [stage("a", next="b"), stage("b", terminal=True)]}
)


async def deliver(
    address: str, items: list[mesh_pb2.DeliverItem], metadata: Any = ()
) -> list[mesh_pb2.Ack]:
    """Sends `items` on one Deliver stream; the acks (raises the stream's RpcError)."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = mesh_pb2_grpc.StageStub(channel).Deliver(
            iter([mesh_pb2.DeliverBatch(sender="test", items=items)]),
            metadata=metadata,
            timeout=WAIT_S,
        )
        return [ack async for batch in call for ack in batch.acks]


def b_address(mesh: LocalMesh) -> str:
    (replica,) = mesh.coordinator.registry.replicas("b")
    return replica.address


def item(rid: str, payload: common_pb2.Payload, from_stage: str = "a") -> mesh_pb2.DeliverItem:
    return mesh_pb2.DeliverItem(
        seq=1, request_id=rid, from_stage=from_stage, to_stage="b", payload=payload
    )


def inline() -> common_pb2.Payload:
    packed = pack({"path": ["x"]})
    return common_pb2.Payload(header=packed.header, inline_data=b"")


async def test_a_stream_without_a_valid_member_token_is_refused() -> None:
    async with LocalMesh(LINE) as mesh:
        for host in mesh.hosts.values():
            host.member_wait_s = 0.1
        address = b_address(mesh)
        (a,) = mesh.coordinator.registry.replicas("a")
        cases = [
            ((), "names no member"),
            (MemberCredentials(a.replica_id, "a", new_token()).metadata(), "wrong member token"),
            (MemberCredentials("nobody", "a", new_token()).metadata(), "not a member"),
        ]
        for metadata, problem in cases:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await deliver(address, [item("r", inline())], metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert problem in (info.value.details() or "")
        async with mesh.async_client(timeout=WAIT_S) as client:  # the mesh serves on
            assert (await client.generate({})).output["path"] == ["a", "b"]


async def test_the_coordinators_stream_carries_no_relay_descriptor_and_no_stage_items() -> None:
    """The coordinator is a member (it delivers new requests), but it announced no relay:
    a relay descriptor on its stream is refused, as is an item claiming a stage's output."""
    async with LocalMesh(LINE) as mesh:
        address = b_address(mesh)
        (a_host,) = [h for h in mesh.hosts.values() if "a" in h.stage_names]
        shm = a_host._relays.get("shm")
        assert shm is not None
        handle = await shm.put(pack({"t": np.ones(1 << 17)}), "r", "e")
        metadata = mesh.coordinator.registry.credentials.metadata()
        relayed = common_pb2.Payload(header=b"", relay=handle.descriptor)
        rid = uuid.uuid4().hex
        acks = await deliver(address, [item(rid, relayed, from_stage="")], metadata)
        assert len(acks) == 1 and "did not announce" in acks[0].error.message
        assert not shm._live[handle.transfer_id].released
        (b_host,) = [h for h in mesh.hosts.values() if "b" in h.stage_names]
        assert not b_host._relays["shm"]._held  # nothing was mapped for the stage
        acks = await deliver(address, [item(rid, inline(), from_stage="a")], metadata)
        assert "is not a stage of its sender, the coordinator" in acks[0].error.message
        handle.release()


async def test_a_member_that_leaves_the_topology_loses_its_open_streams() -> None:
    """A stream authenticated while its sender was a member: once a topology drops the
    sender, the stream's next batch is refused."""
    async with LocalMesh(LINE) as mesh:
        address = b_address(mesh)
        token: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

        def on_command(cmd: mesh_pb2.CoordinatorCommand) -> None:
            if cmd.member_token and not token.done():
                token.set_result(cmd.member_token)

        assert mesh.address is not None
        joined = AttachClient(
            mesh.address,
            mesh_pb2.Register(stage="a", replica_id="leaver", address="unix:///nowhere"),
            on_command,
        )
        joined.drain()  # registers draining: nothing is routed to it
        running = asyncio.get_running_loop().create_task(joined.run())
        creds = MemberCredentials("leaver", "a", await asyncio.wait_for(token, WAIT_S))
        async with grpc.aio.insecure_channel(address) as channel:
            call = mesh_pb2_grpc.StageStub(channel).Deliver(
                metadata=creds.metadata(), timeout=WAIT_S
            )
            nowhere = mesh_pb2.DeliverItem(seq=1, request_id="x", from_stage="a", to_stage="z")
            await call.write(mesh_pb2.DeliverBatch(items=[nowhere]))
            (ack,) = (await call.read()).acks  # taken: an item error, not the stream's
            assert "not 'z'" in ack.error.message
            joined.stop()
            await running
            (b_host,) = [h for h in mesh.hosts.values() if "b" in h.stage_names]
            while b_host.members.lookup("leaver", "a") is not None:  # a topology without it
                await asyncio.sleep(0.01)
            nowhere.seq = 2
            await call.write(mesh_pb2.DeliverBatch(items=[nowhere]))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call.read()
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "replica 'leaver' of stage 'a' is no longer a member" in (
                info.value.details() or ""
            )
