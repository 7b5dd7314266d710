"""Kubernetes workloads for a pipeline: which stage processes share a pod, how many
replicas it runs, and the /dev/shm it needs.

Pure topology over `PipelineConfig`, from the same process plan as `omnirail up` and
compose (`plan_processes`): one container per stage process (per tensor-parallel rank),
and one Deployment per workload. Process groups joined by `shm` edges share one pod (an
shm receiver maps the sender's /dev/shm pool by name, so both need one IPC namespace: the
pod's, with an `emptyDir` of medium Memory at /dev/shm). A TP stage's ranks share a pod
too (they meet at a rendezvous on localhost). Such a pod runs once: the mesh picks a
replica of the next stage by load, not by pod, so with several replicas of a shared pod a
request would reach another pod's receiver, which cannot map the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

from omnirail.config import PipelineConfig
from omnirail.config.graph import join_groups
from omnirail.ops.compose_groups import (
    SHM_SLACK_MB,
    ComposeError,
    dns_label,
    shm_budgets,
    shm_edges,
)
from omnirail.ops.plan import StageProcess, plan_processes


@dataclass(frozen=True)
class Container:
    """One stage process of a pod (one TP rank of a TP group)."""

    name: str
    group: str
    stages: tuple[str, ...]
    gpus: tuple[int, ...]
    tp_rank: int | None
    tp_size: int

    @property
    def follower(self) -> bool:
        """A TP rank other than 0: it runs rank 0's calls and serves nothing itself."""
        return bool(self.tp_rank)


@dataclass(frozen=True)
class Workload:
    """One Deployment: its pod's containers, replicas and /dev/shm."""

    name: str
    containers: tuple[Container, ...]
    replicas: int
    shm_mb: int  # 0: no shared /dev/shm volume

    @property
    def stages(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s for c in self.containers for s in c.stages))

    @property
    def gpus(self) -> int:
        return sum(len(c.gpus) for c in self.containers)


def plan_workloads(cfg: PipelineConfig, gpus_per_node: int | None = None) -> list[Workload]:
    """The pipeline's workloads in declaration order; raises ComposeError naming the stage
    and field when one cannot be placed."""
    processes = [p for p in plan_processes(cfg) if p.replica in (None, 0)]
    by_group: dict[str, list[StageProcess]] = {}
    for p in processes:
        by_group.setdefault(p.group, []).append(p)
    links = ([cfg.process_of(src), cfg.process_of(dst)] for src, dst in shm_edges(cfg))
    budgets = shm_budgets(cfg)
    out: list[Workload] = []
    for members in join_groups(list(by_group), links):
        first = cfg.stage(by_group[members[0]][0].stages[0])
        replicas = first.replicas
        shared = len(members) > 1 or first.tp_size > 1
        for group in members:
            stage = cfg.stage(by_group[group][0].stages[0])
            if shared and stage.replicas > 1:
                why = (
                    "its tensor-parallel ranks share one pod"
                    if stage.tp_size > 1
                    else f"it shares shm edges with {[m for m in members if m != group]}, so "
                    "they run in one pod"
                )
                raise ComposeError(
                    f"stages[{stage.name}].replicas: {stage.replicas}, but {why}, which "
                    "runs once (the mesh routes to replicas by load, not by pod); give it "
                    "replicas: 1, or send its shm edges over a cross-host relay (relay_to)"
                )
        containers = tuple(
            Container(
                dns_label(p.group if p.tp_rank is None else f"{p.group}-tp{p.tp_rank}"),
                p.group,
                p.stages,
                p.gpus,
                p.tp_rank,
                p.tp_size,
            )
            for group in members
            for p in by_group[group]
        )
        shm = SHM_SLACK_MB + sum(budgets.get(g, 0) for g in members) if len(members) > 1 else 0
        workload = Workload(dns_label(members[0]), containers, replicas, shm)
        if gpus_per_node is not None and workload.gpus > gpus_per_node:
            stage = next(s for c in containers if c.gpus for s in c.stages)
            raise ComposeError(
                f"stages[{stage}].gpu: the pod of {list(workload.stages)} needs "
                f"{workload.gpus} GPUs, more than a node has (--gpus-per-node {gpus_per_node})"
            )
        out.append(workload)
    names = [w.name for w in out]
    for name in names:
        if name == "coordinator" or names.count(name) > 1:
            raise ComposeError(f"workload name {name!r} is taken twice; rename a process group")
    return out
