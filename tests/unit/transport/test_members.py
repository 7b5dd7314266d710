"""Member credentials of Deliver streams: what the receiver accepts, what it refuses and
says, and that a topology change ends a member's trust. Tokens appear in no message."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from omnirail.stage.scheduler import CLIENT
from omnirail.transport.members import (
    COORDINATOR,
    MEMBER_KEY,
    MEMBER_STAGE_KEY,
    MEMBER_TOKEN_KEY,
    MemberCredentials,
    MemberError,
    MemberTable,
    new_token,
    relay_owner_ids,
    token_digest,
)
from omnirail.v1 import mesh_pb2

TOKEN_A = new_token()
TOKEN_B = new_token()
TOKEN_C = new_token()  # the coordinator's


def shm_info(peer: str) -> bytes:
    return msgpack.packb({"backend": "shm", "id": peer, "prefix": "p"})


def topology(*, a: bytes = TOKEN_A, with_b: bool = True, b_draining: bool = False):
    topo = mesh_pb2.Topology(coordinator_digest=token_digest(TOKEN_C))
    topo.stages["a"].endpoints.add(
        replica_id="ra", address="x", member_digest=token_digest(a), relay_infos=[shm_info("pa")]
    )
    if with_b:
        group = topo.draining if b_draining else topo.stages
        group["b"].endpoints.add(
            replica_id="rb", address="y", member_digest=token_digest(TOKEN_B), relay_infos=[]
        )
    return topo


def table(**kw: object) -> MemberTable:
    t = MemberTable()
    t.update(topology(**kw))  # type: ignore[arg-type]
    return t


def meta(replica: str, stage: str, token: bytes) -> list[tuple[str, str | bytes]]:
    return list(MemberCredentials(replica, stage, token).metadata())


async def test_a_member_with_its_token_is_the_sender_with_its_relay_ids() -> None:
    sender = await table().authenticate(meta("ra", "a", TOKEN_A), 0)
    assert sender.member.replica_id == "ra" and sender.owners == {"pa"}
    assert sender.sends_as("a") and not sender.sends_as("b") and not sender.sends_as("")


async def test_the_coordinator_owns_no_relay_and_sends_new_requests_only() -> None:
    sender = await table().authenticate(meta(COORDINATOR, "", TOKEN_C), 0)
    assert sender.owners == frozenset()
    assert sender.sends_as("") and sender.sends_as(CLIENT) and not sender.sends_as("a")


async def test_a_draining_replica_is_still_a_member() -> None:
    sender = await table(b_draining=True).authenticate(meta("rb", "b", TOKEN_B), 0)
    assert sender.sends_as("b")


@pytest.mark.parametrize(
    ("metadata", "problem"),
    [
        ([], "names no member"),
        ([(MEMBER_KEY, "ra"), (MEMBER_STAGE_KEY, "a")], "shows no member token"),
        ([(MEMBER_KEY, "ra"), (MEMBER_STAGE_KEY, "a"), (MEMBER_TOKEN_KEY, b"short")], "32-byte"),
        ([(MEMBER_KEY, ""), (MEMBER_TOKEN_KEY, TOKEN_A)], "not a member name"),
        (meta("rz", "a", TOKEN_A), "names replica 'rz' of stage 'a', not a member"),
        (meta("ra", "b", TOKEN_A), "names replica 'ra' of stage 'b', not a member"),
        (meta("ra", "a", TOKEN_B), "wrong member token for replica 'ra' of stage 'a'"),
        (meta(COORDINATOR, "", TOKEN_A), "wrong member token for the coordinator"),
        ([(MEMBER_KEY, "ra"), (MEMBER_TOKEN_KEY, TOKEN_A)], "member 'ra' with no stage"),
    ],
)
async def test_what_is_refused_is_named_and_the_token_never(
    metadata: list[tuple[str, str | bytes]], problem: str
) -> None:
    with pytest.raises(MemberError, match=problem) as info:
        await table().authenticate(metadata, 0)
    text = str(info.value)
    for token in (TOKEN_A, TOKEN_B, TOKEN_C):
        assert token.hex() not in text and repr(token) not in text


def test_credentials_do_not_show_their_token() -> None:
    creds = MemberCredentials("ra", "a", TOKEN_A)
    assert TOKEN_A.hex() not in repr(creds) and repr(TOKEN_A) not in repr(creds)


async def test_a_stream_before_its_topology_waits_for_it() -> None:
    """The coordinator tells a new replica its token before the others hear of it: its
    first stream may come first, and waits (bounded) for the topology that lists it."""
    t = table(with_b=False)
    loop = asyncio.get_running_loop()
    loop.call_later(0.05, t.update, topology())
    sender = await asyncio.wait_for(t.authenticate(meta("rb", "b", TOKEN_B), 5), 4)
    assert sender.member.stage == "b"
    started = loop.time()
    with pytest.raises(MemberError, match="not a member"):
        await t.authenticate(meta("rz", "b", TOKEN_B), 0.1)
    assert loop.time() - started < 2


async def test_a_topology_change_ends_a_members_trust() -> None:
    t = table()
    a = await t.authenticate(meta("ra", "a", TOKEN_A), 0)
    b = await t.authenticate(meta("rb", "b", TOKEN_B), 0)
    t.update(topology())  # the same members: nothing changes
    a.check()
    b.check()
    t.update(topology(with_b=False))
    with pytest.raises(MemberError, match="replica 'rb' of stage 'b' is no longer a member"):
        b.check()
    t.update(topology(a=new_token(), with_b=False))  # ra registered again: a new token
    with pytest.raises(MemberError, match="registered again"):
        a.check()


def test_relay_owner_ids_skip_what_is_not_an_id() -> None:
    infos = [
        shm_info("pa"),
        msgpack.packb({"backend": "ucx", "id": "u1"}),
        msgpack.packb({"id": 5}),
        msgpack.packb({"id": "x" * 500}),
        msgpack.packb(["id", "l"]),
        b"\xc1",
        b"",
    ]
    assert relay_owner_ids(infos) == {"pa", "u1"}
