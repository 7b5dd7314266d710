"""The stage processes a pipeline runs as: one per process group and replica.

The one place this is enumerated: the local launcher starts these processes, and the
compose generator makes one service of each.
"""

from __future__ import annotations

from dataclasses import dataclass

from omnirail.config import PipelineConfig


@dataclass(frozen=True)
class StageProcess:
    """One stage process: a process group (its stages), one replica of it, or one
    tensor-parallel rank of a TP stage's group (replica)."""

    group: str
    stages: tuple[str, ...]
    replica: int | None = None  # None when the group has one replica
    gpus: tuple[int, ...] = ()
    tp_rank: int | None = None  # None for a stage without tensor parallelism
    tp_size: int = 1

    @property
    def replica_name(self) -> str:
        """`group`, or `group-R` for replica R of a group with several: one mesh
        endpoint (a TP group's ranks share it)."""
        return self.group if self.replica is None else f"{self.group}-{self.replica}"

    @property
    def name(self) -> str:
        """`replica_name`, then `_tp{rank}` for a TP rank (seed 003's
        `{process}_tp{rank}`)."""
        base = self.replica_name
        return base if self.tp_rank is None else f"{base}_tp{self.tp_rank}"


def plan_processes(cfg: PipelineConfig) -> list[StageProcess]:
    """Every stage process, in the pipeline's declaration order of groups, then replicas,
    then TP ranks (a TP stage has its process to itself: config validation)."""
    processes: list[StageProcess] = []
    for group, stages in cfg.process_groups().items():
        # Stages sharing a process have equal `replicas` (config validation). Each replica
        # is its own process: a stage advertises one address.
        first = cfg.stage(stages[0])
        replicas = first.replicas
        gpus = tuple(sorted({g for s in stages for g in cfg.stage(s).gpus}))
        for replica in range(replicas) if replicas > 1 else [None]:
            if first.tp_size == 1:
                processes.append(StageProcess(group, tuple(stages), replica, gpus))
                continue
            for rank in range(first.tp_size):
                rank_gpus = (first.gpus[rank],) if first.gpus else ()
                processes.append(
                    StageProcess(group, tuple(stages), replica, rank_gpus, rank, first.tp_size)
                )
    return processes
