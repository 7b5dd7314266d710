"""Stage replicas known to the coordinator, and the commands queued for each."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from omnirail.config import PipelineConfig
from omnirail.transport.members import COORDINATOR, MemberCredentials, new_token, token_digest
from omnirail.v1 import client_pb2, mesh_pb2
from omnirail.wire.routing import conversation_index, replica_index


@dataclass(eq=False)
class Replica:
    stage: str
    replica_id: str
    address: str
    pid: int
    queue_depth: int = 0
    inflight: int = 0
    metrics_address: str = ""
    relay_infos: tuple[bytes, ...] = ()
    # This registration's member token (sent to it alone; its digest goes in the topology).
    member_token: bytes = field(default_factory=new_token, repr=False)
    # Requests the coordinator sent to this replica (as the entry) that are still live.
    assigned: int = 0
    # When its Attach stream last brought anything (monotonic; stages report every second).
    last_heard: float = field(default_factory=time.monotonic)
    # The coordinator's task serving its Attach stream (cancelled when it goes silent).
    task: asyncio.Task[None] | None = None
    # Shutting down: gets no new work (out of `replicas` and the topology), finishes its own.
    draining: bool = False
    # Told it may go: no live request needs it any more.
    released: bool = False
    # Commands accumulate here and go out in one write.
    pending: mesh_pb2.CoordinatorCommand = field(default_factory=mesh_pb2.CoordinatorCommand)
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    def push(self, command: mesh_pb2.CoordinatorCommand) -> None:
        self.pending.MergeFrom(command)
        self.wake.set()

    def take(self) -> mesh_pb2.CoordinatorCommand | None:
        if not self.pending.ListFields():
            return None
        command, self.pending = self.pending, mesh_pb2.CoordinatorCommand()
        return command


def _endpoint(rep: Replica) -> mesh_pb2.Endpoint:
    return mesh_pb2.Endpoint(
        replica_id=rep.replica_id,
        address=rep.address,
        relay_infos=rep.relay_infos,
        member_digest=token_digest(rep.member_token),
    )


BALANCE_POLICIES = ("least_outstanding", "round_robin", "request_id")


class StageRegistry:
    """Replicas by stage. `pick` chooses the entry stage's replica for a new request by
    `balance`: least_outstanding (fewest of the coordinator's live requests, ties by the
    request id's hash), round_robin, or request_id (a hash of it: the same id, the same
    replica). Later hops hash the request id in the stages (every producer of a fan-in
    must agree on the replica without asking anyone)."""

    def __init__(self, stage_names: list[str], balance: str = "least_outstanding") -> None:
        if balance not in BALANCE_POLICIES:
            raise ValueError(f"balance must be one of {list(BALANCE_POLICIES)}, not {balance!r}")
        self._balance = balance
        self._turn = 0
        self._by_stage: dict[str, dict[str, Replica]] = {name: {} for name in stage_names}
        # What the coordinator's own Deliver streams show (its digest is in every topology).
        self.credentials = MemberCredentials(COORDINATOR, "", new_token())

    def knows(self, stage: str) -> bool:
        return stage in self._by_stage

    def add(self, replica: Replica) -> Replica | None:
        """Adds a replica; returns the one it replaces (same stage and replica id)."""
        replicas = self._by_stage[replica.stage]
        old = replicas.get(replica.replica_id)
        replicas[replica.replica_id] = replica
        return old

    def remove(self, replica: Replica) -> bool:
        replicas = self._by_stage.get(replica.stage, {})
        if replicas.get(replica.replica_id) is replica:
            del replicas[replica.replica_id]
            return True
        return False

    def replicas(self, stage: str) -> list[Replica]:
        """The stage's replicas that take work (not draining), sorted by id: the order
        the stages route by."""
        found = self._by_stage.get(stage, {}).values()
        return sorted((r for r in found if not r.draining), key=lambda r: r.replica_id)

    def attached(self, stage: str) -> list[Replica]:
        """All of the stage's replicas, draining ones too, sorted by id."""
        return sorted(self._by_stage.get(stage, {}).values(), key=lambda r: r.replica_id)

    def all(self) -> list[Replica]:
        """Every attached replica, draining ones too (they still take aborts)."""
        return [r for reps in self._by_stage.values() for r in reps.values()]

    def live(self, stage: str) -> bool:
        return any(not r.draining for r in self._by_stage.get(stage, {}).values())

    def missing(self) -> list[str]:
        return [name for name in self._by_stage if not self.live(name)]

    def pick(self, stage: str, request_id: str, conversation_id: str = "") -> Replica | None:
        replicas = self.replicas(stage)
        if not replicas:
            return None
        if conversation_id:  # where the conversation's state is, whatever the balance
            return replicas[conversation_index(conversation_id, [r.address for r in replicas])]
        n = len(replicas)
        if self._balance == "round_robin":
            self._turn += 1
            return replicas[self._turn % n]
        start = replica_index(request_id, n)
        if self._balance == "request_id" or n == 1:
            return replicas[start]
        ring = replicas[start:] + replicas[:start]
        return min(ring, key=lambda r: r.assigned)  # first of the least loaded

    def topology(self) -> mesh_pb2.Topology:
        """Where the stages send: each stage's replicas that take work; a stage whose
        replicas all drain keeps them (requests already running still pass it)."""
        topo = mesh_pb2.Topology(coordinator_digest=token_digest(self.credentials.token))
        for name in self._by_stage:
            eps = topo.stages[name]
            routed = self.replicas(name) or self.attached(name)
            for rep in routed:
                eps.endpoints.append(_endpoint(rep))
            # Draining replicas still deliver what they finish: receivers must know them.
            rest = [rep for rep in self.attached(name) if rep not in routed]
            if rest:
                topo.draining[name].endpoints.extend(_endpoint(rep) for rep in rest)
        return topo

    def release_drained(self, live: Iterable[Any]) -> bool:
        """Tells each draining replica that nothing running needs it any more: its stage
        has replicas that take work, or none of the `live` requests may still pass it
        (all of a stage's replicas drain at once when a compose project stops). True
        while some draining replica still waits."""
        waiting = False
        pending = [r for r in self.all() if r.draining and not r.released]
        if pending:
            stages_needed = {s for rec in live for s in rec.possible}
        for rep in pending:
            if not self.live(rep.stage) and rep.stage in stages_needed:
                waiting = True
                continue
            rep.released = True
            rep.push(mesh_pb2.CoordinatorCommand(released=True))
        return waiting

    def broadcast(self, command: mesh_pb2.CoordinatorCommand) -> list[Replica]:
        targets = self.all()
        for rep in targets:
            rep.push(command)
        return targets


def describe(
    pipeline: PipelineConfig, registry: StageRegistry, metrics_address: str
) -> client_pb2.PipelineInfo:
    """What DescribePipeline answers: the pipeline's stages and every attached replica
    (a draining one is not `live`: it takes no new work)."""
    info = client_pb2.PipelineInfo(
        name=pipeline.name or "",
        entry_stage=pipeline.resolved_entry_stage,
        terminal_stages=list(pipeline.terminal_stages),
        ready=not registry.missing(),
        metrics_address=metrics_address,
    )
    for cfg in pipeline.stages:
        stage = info.stages.add(
            name=cfg.name,
            next=cfg.next_stages,
            terminal=cfg.terminal,
            wait_for=cfg.wait_for or [],
        )
        for rep in registry.attached(cfg.name):
            stage.replicas.add(
                replica_id=rep.replica_id,
                address=rep.address,
                live=not rep.draining,
                queue_depth=rep.queue_depth,
                inflight=rep.inflight,
                metrics_address=rep.metrics_address,
            )
    return info
