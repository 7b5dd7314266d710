"""Compose services for a pipeline: one per stage process (and replica), their DNS-safe
names, and the IPC namespaces that `shm` edges between them need.

Pure topology over `PipelineConfig`; `omnirail.ops.compose` turns it into a compose file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from omnirail.config import PipelineConfig, RestartConfig
from omnirail.config.graph import join_groups
from omnirail.ops.plan import plan_processes

# Services the deployment adds beside the stages; a stage service may not take these names.
RESERVED_SERVICES = ("coordinator", "gateway", "jaeger", "prometheus")

# RFC 1123 label: service, namespace and most object names (fullmatch: no trailing \n).
DNS_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
# tmpfs headroom for the marks segments and page rounding of every pool.
SHM_SLACK_MB = 64


class ComposeError(ValueError):
    """A deployment that cannot be generated; the message is one line naming the cause."""


@dataclass(frozen=True)
class StageService:
    """One container: a stage process group, or one replica of it."""

    name: str
    group: str
    stages: tuple[str, ...]
    replica: int | None = None  # None when the group has one replica
    gpus: tuple[int, ...] = ()
    restart: str = "no"  # compose's restart policy (`restart_policy`)


@dataclass(frozen=True)
class IpcGroup:
    """Services that must share an IPC namespace; `owner` creates it (`ipc: shareable`)."""

    owner: str
    members: tuple[str, ...]  # the owner first, then the others in service order
    shm_mb: int  # /dev/shm size the owner needs for every sender's shm pool


def dns_label(name: str) -> str:
    """A stage or process name as a DNS label: lower case, '_' becomes '-'."""
    label = name.lower().replace("_", "-")
    if not DNS_LABEL.fullmatch(label):
        raise ComposeError(
            f"{name!r} cannot be a compose service name ({label!r} is not a DNS label: "
            "letters, digits and inner '-', at most 63); rename it"
        )
    return label


def restart_policy(restart: RestartConfig) -> str:
    """The container runtime's version of a stage's `restart`: restart on failure, at
    most `max` times (the runtime counts every retry, with its own backoff, where
    `omnirail up` counts them per `window_s`); `max: 0`, never. A container stopped on
    purpose (`compose stop`, `podman kill`) is not restarted."""
    return f"on-failure:{restart.max}" if restart.max > 0 else "no"


def plan_services(cfg: PipelineConfig) -> list[StageService]:
    """One service per stage process (`plan_processes`), in the same order."""
    services: list[StageService] = []
    taken: dict[str, str] = {name: f"the {name} service" for name in RESERVED_SERVICES}
    for p in plan_processes(cfg):
        if p.tp_rank is not None:
            raise ComposeError(
                f"stages[{p.stages[0]}].tp_size: tensor-parallel stages run under "
                "`omnirail up` only; compose cannot start their rank groups yet"
            )
        base = dns_label(p.group)
        # compose's `deploy.replicas` would give every replica the one address a stage
        # advertises, so each replica is a service of its own.
        name = base if p.replica is None else f"{base}-{p.replica}"
        owner = f"process {p.group!r}" + ("" if p.replica is None else f" replica {p.replica}")
        if len(name) > 63:
            raise ComposeError(f"service name {name!r} for {owner} is longer than 63")
        if name in taken:
            raise ComposeError(
                f"{owner} and {taken[name]} both map to compose service {name!r}; "
                "rename one (service names are lower case, '_' becomes '-')"
            )
        taken[name] = owner
        policy = restart_policy(cfg.stage(p.stages[0]).restart)
        services.append(StageService(name, p.group, p.stages, p.replica, p.gpus, policy))
    return services


def ipc_groups(cfg: PipelineConfig, services: list[StageService]) -> list[IpcGroup]:
    """Services joined by `shm` edges (next and stream_to), as groups of two or more.

    An shm receiver maps the sender's /dev/shm pool by name, so both must see one IPC
    namespace. Edges inside a process never touch a relay; other backends cross
    containers on their own.
    """
    by_group: dict[str, list[str]] = {}
    for s in services:
        by_group.setdefault(s.group, []).append(s.name)
    links = (
        by_group[cfg.process_of(src)] + by_group[cfg.process_of(dst)] for src, dst in shm_edges(cfg)
    )
    grouped = join_groups([s.name for s in services], links)
    budgets = shm_budgets(cfg)
    group_of = {s.name: s.group for s in services}
    return [
        IpcGroup(
            members[0],
            tuple(members),
            SHM_SLACK_MB + sum(budgets.get(group_of[m], 0) for m in members),
        )
        for members in grouped
        if len(members) > 1
    ]


def shm_edges(cfg: PipelineConfig) -> list[tuple[str, str]]:
    """Edges between different processes whose relay is `shm`, in declaration order."""
    return [
        (s.name, t)
        for s in cfg.stages
        for t in cfg.edges_of(s.name)
        if cfg.process_of(s.name) != cfg.process_of(t) and cfg.relay_for(s.name, t).backend == "shm"
    ]


def shm_budgets(cfg: PipelineConfig) -> dict[str, int]:
    """MiB of /dev/shm each process group's sender pool may fill (each replica's; groups
    that send over no shm edge are absent).

    A pool's first segment (`pool_mb`) is sparse, and it only grows while the bytes in
    flight (at most `credit_mb` per edge) do not fit, so the larger of the two bounds the
    pages it can touch. Docker's default /dev/shm is 64 MiB: a write past the size kills
    the sender with SIGBUS, so the owner of each namespace is sized for all its senders.
    """
    budgets: dict[str, int] = {}
    edges = shm_edges(cfg)
    for group, stages in cfg.process_groups().items():
        mine = [cfg.relay_for(src, dst) for src, dst in edges if src in stages]
        if mine:
            budgets[group] = max(max(r.pool_mb for r in mine), sum(r.credit_mb for r in mine))
    return budgets
