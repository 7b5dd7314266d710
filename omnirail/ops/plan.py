"""The stage processes a pipeline runs as: one per process group and replica.

The one place this is enumerated: the local launcher starts these processes, and the
compose generator makes one service of each.
"""

from __future__ import annotations

from dataclasses import dataclass

from omnirail.config import PipelineConfig


@dataclass(frozen=True)
class StageProcess:
    """One stage process: a process group (its stages), or one replica of it."""

    group: str
    stages: tuple[str, ...]
    replica: int | None = None  # None when the group has one replica
    gpus: tuple[int, ...] = ()

    @property
    def name(self) -> str:
        """`group`, or `group-R` for replica R of a group with several."""
        return self.group if self.replica is None else f"{self.group}-{self.replica}"


def plan_processes(cfg: PipelineConfig) -> list[StageProcess]:
    """Every stage process, in the pipeline's declaration order of groups, then replicas."""
    processes: list[StageProcess] = []
    for group, stages in cfg.process_groups().items():
        # Stages sharing a process have equal `replicas` (config validation). Each replica
        # is its own process: a stage advertises one address.
        replicas = cfg.stage(stages[0]).replicas
        gpus = tuple(sorted({g for s in stages for g in cfg.stage(s).gpus}))
        for replica in range(replicas) if replicas > 1 else [None]:
            processes.append(StageProcess(group, tuple(stages), replica, gpus))
    return processes
