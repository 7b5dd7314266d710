"""Who sent a Deliver stream: per-member credentials and their check at the receiver.

Every process of a mesh holds the same mesh secret (and, with TLS, the same certificate),
so neither tells one member from another. The coordinator therefore gives each stage
registration (each Attach stream: a stage of a replica) a member token of its own, 32 random
bytes sent to that registration only, and publishes `sha256(token)` for it in every
topology (`Endpoint.member_digest`; the coordinator's own in `Topology.coordinator_digest`).

A Deliver stream's metadata names its sender (`omnirail-member`: the replica id, or
"coordinator"; `omnirail-member-stage`: the stage whose registration the token came from)
and shows its token (`omnirail-member-token-bin`). The receiver finds the sender in the
topology it holds and compares digests in constant time; a stream that names no member, an
unknown one, or shows a wrong token is refused (UNAUTHENTICATED, naming what is wrong,
never the token). A topology that drops the member, or gives it another digest (it
registered again), ends the stream's trust: its next batch is refused.

What an authenticated sender may name in relay descriptors: the relay peer ids (the "id"
of each `local_info()` msgpack map) that its registration announced (`Member.owners`).
The coordinator owns none: clients send tensors inline.

Tokens are secrets: they never appear in a repr, a log line or an error message.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import msgpack

from omnirail.tuning.aio import Changes
from omnirail.v1 import mesh_pb2

__all__ = [
    "COORDINATOR",
    "Member",
    "MemberCredentials",
    "MemberError",
    "MemberTable",
    "Sender",
    "new_token",
    "relay_owner_ids",
    "token_digest",
]

TOKEN_BYTES = 32
# Metadata keys of a Deliver stream (gRPC: a key ending in -bin carries bytes).
MEMBER_KEY = "omnirail-member"
MEMBER_STAGE_KEY = "omnirail-member-stage"
MEMBER_TOKEN_KEY = "omnirail-member-token-bin"
# The member name the coordinator's streams show (with no stage).
COORDINATOR = "coordinator"
# Bounds on what a peer's metadata may make the receiver look at or echo.
_MAX_NAME = 200


def new_token() -> bytes:
    return secrets.token_bytes(TOKEN_BYTES)


def token_digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


def _shown(value: str) -> str:
    return repr(value[:80]) + ("..." if len(value) > 80 else "")


@dataclass(frozen=True)
class MemberCredentials:
    """What a member's Deliver streams show. `stage` is "" for the coordinator."""

    replica_id: str
    stage: str
    token: bytes = field(repr=False)

    def metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        if self.stage:
            return (
                (MEMBER_KEY, self.replica_id),
                (MEMBER_STAGE_KEY, self.stage),
                (MEMBER_TOKEN_KEY, self.token),
            )
        return ((MEMBER_KEY, COORDINATOR), (MEMBER_TOKEN_KEY, self.token))


def relay_owner_ids(infos: Iterable[bytes]) -> frozenset[str]:
    """The relay peer ids (the "id" of each msgpack map) in `infos`; anything else (other
    shapes, garbage) is skipped, never unpickled."""
    ids: set[str] = set()
    for raw in infos:
        try:
            info = msgpack.unpackb(raw, raw=False, strict_map_key=True)
        except Exception:
            continue
        if isinstance(info, dict):
            peer = info.get("id")
            if isinstance(peer, str) and 0 < len(peer) <= _MAX_NAME:
                ids.add(peer)
    return frozenset(ids)


@dataclass(frozen=True, slots=True)
class Member:
    """A member as the topology lists it."""

    replica_id: str
    stage: str  # "" for the coordinator
    digest: bytes = field(repr=False)
    # Relay peer ids it announced: what its descriptors may name.
    owners: frozenset[str] = frozenset()
    # The stages its replica hosts: what its items' `from_stage` may be.
    stages: frozenset[str] = frozenset()

    def describe(self) -> str:
        if not self.stage:
            return "the coordinator"
        return f"replica {_shown(self.replica_id)} of stage {_shown(self.stage)}"


class MemberError(Exception):
    """A Deliver stream's sender is not (or no longer) an authenticated member."""


class MemberTable:
    """The members of the last topology, by (stage, replica id), and the coordinator."""

    def __init__(self) -> None:
        self._members: dict[tuple[str, str], Member] = {}
        self._coordinator: Member | None = None
        # Bumped by every topology: a stream's `Sender` re-checks itself when it changed.
        self.version = 0
        self._changed = Changes()

    def update(self, topology: mesh_pb2.Topology) -> None:
        listed = [
            (stage, ep)
            for group in (topology.stages, topology.draining)
            for stage, eps in group.items()
            for ep in eps.endpoints
        ]
        hosted: dict[str, set[str]] = {}
        for stage, ep in listed:
            hosted.setdefault(ep.replica_id, set()).add(stage)
        stages = {replica: frozenset(names) for replica, names in hosted.items()}
        self._members = {
            (stage, ep.replica_id): Member(
                ep.replica_id,
                stage,
                ep.member_digest,
                relay_owner_ids(ep.relay_infos),
                stages[ep.replica_id],
            )
            for stage, ep in listed
        }
        digest = topology.coordinator_digest
        # The coordinator sends new requests ("" as their producer) and the client's input
        # stream chunks ("@client", omnirail.stage.scheduler.CLIENT).
        self._coordinator = (
            Member(COORDINATOR, "", digest, frozenset(), frozenset(("", "@client")))
            if digest
            else None
        )
        self.version += 1
        self._changed.changed()

    def lookup(self, replica_id: str, stage: str) -> Member | None:
        if not stage:
            return self._coordinator if replica_id == COORDINATOR else None
        return self._members.get((stage, replica_id))

    async def authenticate(
        self, metadata: Sequence[tuple[str, str | bytes]] | None, wait_s: float
    ) -> Sender:
        """The sender `metadata` names, once its token matches; MemberError otherwise.

        A sender not in the topology (or whose digest differs: it registered again) may be
        listed by a topology still on its way (the coordinator tells the sender first), so
        this waits up to `wait_s` for a topology that lists it before refusing."""
        replica_id, stage, token = _parse(metadata)
        digest = token_digest(token)

        def shown_by_token() -> Member | None:
            member = self.lookup(replica_id, stage)
            ok = member is not None and hmac.compare_digest(digest, member.digest)
            return member if ok else None

        if await self._changed.until(lambda: shown_by_token() is not None, wait_s):
            member = shown_by_token()
            assert member is not None  # no await since `until` saw it
            return Sender(self, member)
        who = (
            Member(replica_id, stage, b"").describe()
            if stage or replica_id == COORDINATOR
            else f"member {_shown(replica_id)} with no stage"
        )
        if self.lookup(replica_id, stage) is None:
            raise MemberError(f"Deliver stream names {who}, not a member of the mesh")
        raise MemberError(f"Deliver stream shows a wrong member token for {who}")


class Sender:
    """The authenticated sender of one Deliver stream."""

    __slots__ = ("_table", "_version", "member")

    def __init__(self, table: MemberTable, member: Member) -> None:
        self._table = table
        self._version = table.version
        self.member = member

    @property
    def owners(self) -> frozenset[str]:
        return self.member.owners

    def sends_as(self, stage: str) -> bool:
        """Whether an item that names `stage` as its producer may come from this sender."""
        return stage in self.member.stages

    def check(self) -> None:
        """Raises MemberError once a topology dropped the member or changed its digest
        (cheap when no topology came since the last check)."""
        if self._version == self._table.version:
            return
        member = self.member
        now = self._table.lookup(member.replica_id, member.stage)
        if now is None:
            raise MemberError(f"{member.describe()} is no longer a member of the mesh")
        if not hmac.compare_digest(now.digest, member.digest):
            raise MemberError(f"{member.describe()} registered again: this stream's token is stale")
        self.member = now  # its relay infos may have changed
        self._version = self._table.version


def _parse(metadata: Sequence[tuple[str, str | bytes]] | None) -> tuple[str, str, bytes]:
    """(replica id, stage, token) from a Deliver stream's metadata; MemberError naming the
    key that is missing or malformed."""
    replica_id: str | bytes | None = None
    stage: str | bytes = ""
    token: str | bytes | None = None
    for key, value in metadata or ():
        if key == MEMBER_KEY:
            replica_id = value
        elif key == MEMBER_STAGE_KEY:
            stage = value
        elif key == MEMBER_TOKEN_KEY:
            token = value
    if replica_id is None:
        raise MemberError(f"Deliver stream names no member (metadata {MEMBER_KEY!r} missing)")
    if not isinstance(replica_id, str) or not 0 < len(replica_id) <= _MAX_NAME:
        raise MemberError(f"Deliver stream metadata {MEMBER_KEY!r} is not a member name")
    if not isinstance(stage, str) or len(stage) > _MAX_NAME:
        raise MemberError(f"Deliver stream metadata {MEMBER_STAGE_KEY!r} is not a stage name")
    if token is None:
        raise MemberError(
            f"Deliver stream shows no member token (metadata {MEMBER_TOKEN_KEY!r} missing)"
        )
    if not isinstance(token, bytes) or len(token) != TOKEN_BYTES:
        raise MemberError(
            f"Deliver stream metadata {MEMBER_TOKEN_KEY!r} is not a {TOKEN_BYTES}-byte token"
        )
    return replica_id, stage, token
