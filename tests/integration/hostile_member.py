"""A hostile mesh member, run as its own process by tests/integration/test_relay_trust.py.

It holds what every process of the mesh holds (the mesh secret, the mesh certificate, the
same user id), joins through Attach as a (draining) replica of stage `--as-stage`, so the
coordinator gives it a member token of its own and announces it, and then Delivers to the
replica of stage `--victim` what a compromised stage would:
  a: a descriptor of its own transfer naming another of its edges' extents;
  b: another sender's segment, with a grant for it forged into that sender's marks file
     (the same user may write it): only the owner check stands in the way;
  c: another sender's segment with a guessed transfer id; and its own transfer's id
     replayed after its release (stale);
  d: streams naming another member with a wrong token, and a member nobody registered.
It prints one JSON object: per case what came back (an ack's error, or the stream's
status), and whether anything was marked in the other sender's release marks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import uuid
from typing import Any

import grpc
import msgpack
import numpy as np

from omnirail.config import load_pipeline
from omnirail.relay.base import RelaySettings
from omnirail.relay.shm import ShmRelay
from omnirail.relay.shm_handles import SLOT_MASK
from omnirail.relay.shm_pool import (
    GRANT_END,
    GRANT_SEGMENT,
    GRANT_START,
    MARKS_BYTES,
    SHM_DIR,
    grant_index,
)
from omnirail.stage_service.attach import AttachClient
from omnirail.transport.deliver import channel_options
from omnirail.transport.members import MemberCredentials, new_token
from omnirail.transport.security import mesh_channel, mesh_security
from omnirail.v1 import common_pb2, mesh_pb2, mesh_pb2_grpc
from omnirail.wire.payload import pack

HEADER = pack(np.ones(64, np.uint8)).header


async def deliver(
    security: Any,
    address: str,
    creds: MemberCredentials,
    from_stage: str,
    to_stage: str,
    desc: common_pb2.RelayDescriptor,
    rid: str,
) -> dict[str, Any]:
    channel, metadata = mesh_channel(security, address, channel_options(64 << 20), aio=True)
    item = mesh_pb2.DeliverItem(
        seq=1,
        request_id=rid,
        from_stage=from_stage,
        to_stage=to_stage,
        payload=common_pb2.Payload(header=HEADER, relay=desc),
    )
    try:
        call = mesh_pb2_grpc.StageStub(channel).Deliver(
            metadata=(*metadata, *creds.metadata()), timeout=30
        )
        await call.write(mesh_pb2.DeliverBatch(sender=creds.replica_id, items=[item]))
        batch = await call.read()
        await call.done_writing()
        if batch is grpc.aio.EOF:
            return {"eof": True}
        (ack,) = batch.acks
        return {"code": ack.error.code, "message": ack.error.message}
    except grpc.aio.AioRpcError as e:
        return {"status": e.code().name, "details": e.details()}
    finally:
        await channel.close()


def marks_words(owner_stem: str) -> np.memmap:
    return np.memmap(
        os.path.join(SHM_DIR, f"{owner_stem}-marks"), np.uint64, "r+", shape=(MARKS_BYTES // 8,)
    )


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pipeline", required=True)
    p.add_argument("--coordinator", required=True)
    p.add_argument("--as-stage", required=True)
    p.add_argument("--victim", required=True)
    p.add_argument("--prefix", required=True)
    args = p.parse_args()
    pipeline = load_pipeline(args.pipeline)
    security = mesh_security(pipeline)
    relay = ShmRelay(RelaySettings(name_prefix=args.prefix, pool_bytes=1 << 20))
    replica_id = f"hostile-{uuid.uuid4().hex[:8]}"
    got: dict[str, Any] = {}

    def on_command(cmd: mesh_pb2.CoordinatorCommand) -> None:
        if cmd.member_token:
            got["token"] = cmd.member_token
        if cmd.HasField("topology"):
            got["topology"] = cmd.topology

    attach = AttachClient(
        args.coordinator,
        mesh_pb2.Register(
            stage=args.as_stage,
            replica_id=replica_id,
            address="127.0.0.1:9",  # never dialled: it registers draining, gets no work
            pid=os.getpid(),
            relay_backends=["shm"],
            relay_infos=[relay.local_info()],
        ),
        on_command,
        security=security,
    )
    attach.drain()
    running = asyncio.get_running_loop().create_task(attach.run())
    await asyncio.wait_for(attach.connected.wait(), 60)
    topology: mesh_pb2.Topology = got["topology"]
    creds = MemberCredentials(replica_id, args.as_stage, got["token"])
    victim = topology.stages[args.victim].endpoints[0].address
    # The honest replica of the stage it joined: its shm peer id names its segments.
    honest = next(
        ep for ep in topology.stages[args.as_stage].endpoints if ep.replica_id != replica_id
    )
    (honest_owner,) = [
        msgpack.unpackb(i)["id"]
        for i in honest.relay_infos
        if msgpack.unpackb(i).get("backend") == "shm"
    ]
    stem = next(
        n.rsplit("-", 1)[0]
        for n in sorted(os.listdir(SHM_DIR))
        if n.startswith(honest_owner + ".") and n.endswith("-0")
    )
    region = f"{stem}-0"
    results: dict[str, Any] = {"honest_segment": region}

    async def send(desc: common_pb2.RelayDescriptor, case: str, c: MemberCredentials = creds):
        return await deliver(
            security, victim, c, args.as_stage, args.victim, desc, f"hostile-{case}"
        )

    # a: its own transfer's id over another of its edges' extents.
    mine = await relay.put(pack(np.full(256, 1, np.uint8)), "x1", "edge-1")
    other = await relay.put(pack(np.full(256, 2, np.uint8)), "x2", "edge-2")
    a = common_pb2.RelayDescriptor()
    a.CopyFrom(mine.descriptor)
    a.offset, a.nbytes = other.descriptor.offset, other.descriptor.nbytes
    results["a"] = await send(a, "a")
    # b: the honest sender's segment, with a grant forged into its marks (same user).
    words = marks_words(stem)
    slot = 65_000  # far from the slots a short test's transfers use
    forged = (secrets.randbits(48) << 16) | slot
    g = grant_index(slot)
    saved = np.array(words[g : g + 5])
    words[g + GRANT_SEGMENT], words[g + GRANT_START], words[g + GRANT_END] = 0, 0, 64
    words[g] = forged
    b = common_pb2.RelayDescriptor(
        backend="shm", region=region, offset=0, nbytes=64, transfer_id=forged
    )
    results["b"] = await send(b, "b")
    results["b_marked"] = int(words[slot]) == forged
    words[g : g + 5] = saved
    # c: a guessed id in the honest sender's segment, and its own id replayed when stale.
    guess = (secrets.randbits(48) << 16) | 1
    c = common_pb2.RelayDescriptor(
        backend="shm", region=region, offset=0, nbytes=64, transfer_id=guess
    )
    results["c"] = await send(c, "c")
    results["c_marked"] = int(words[guess & SLOT_MASK]) == guess
    stale = common_pb2.RelayDescriptor()
    stale.CopyFrom(mine.descriptor)
    mine.release()
    other.release()
    results["c_stale"] = await send(stale, "c-stale")
    del words
    # d: the honest replica's name with a token of its own making; a name nobody has.
    for case, forged_creds in (
        ("d", MemberCredentials(honest.replica_id, args.as_stage, new_token())),
        ("d_unknown", MemberCredentials("nobody", args.as_stage, new_token())),
    ):
        results[case] = await send(a, case, forged_creds)
    print(json.dumps(results), flush=True)
    attach.stop()
    running.cancel()
    relay.close()


if __name__ == "__main__":
    asyncio.run(main())
