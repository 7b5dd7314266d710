"""`--edge-relay SRC->DST=BACKEND`: the pipeline with some edges moved onto other relay
backends, so a deployment can put their stages in containers that share no IPC namespace.

The derived pipeline is the authored YAML with `relay_to` entries added and its model
directories pointed at their container mounts (`compose_models`), validated like the
original and written next to it (dotted paths may name modules relative to its directory).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from omnirail.config import ConfigError, PipelineConfig
from omnirail.config.yaml_loader import read_yaml
from omnirail.ops.compose_groups import ComposeError
from omnirail.ops.compose_models import ModelMount, point_at_mounts

# Options an edge moved across containers gets unless the pipeline already sets its own:
# UCX sees one machine and would pick shared-memory transports whose signalling does not
# cross network namespaces (docs/guides/relays.md); nixl must notice a dead peer instead of hanging.
CONTAINER_EDGE_OPTIONS: dict[str, dict[str, Any]] = {
    "ucx": {"ucx_config": {"TLS": "tcp"}},
    "nixl": {"ucx_error_handling_mode": "peer"},
}


@dataclass(frozen=True, order=True)
class EdgeRelay:
    """`SRC->DST=BACKEND`: the backend one edge uses in the deployment."""

    source: str
    target: str
    backend: str

    @classmethod
    def parse(cls, text: str) -> EdgeRelay:
        edge, sep, backend = text.rpartition("=")
        source, arrow, target = edge.partition("->")
        if not (sep and arrow and source and target and backend):
            raise ComposeError(f"--edge-relay {text!r}: expected SRC->DST=BACKEND")
        return cls(source.strip(), target.strip(), backend.strip())

    def __str__(self) -> str:
        return f"{self.source}->{self.target}={self.backend}"


def derive_pipeline(
    cfg: PipelineConfig,
    source: Path,
    edge_relays: tuple[EdgeRelay, ...],
    resolve: bool,
    mounts: list[ModelMount] | None = None,
) -> tuple[PipelineConfig, str] | None:
    """The pipeline with `edge_relays` applied and model paths pointed at `mounts`,
    validated, and its YAML text; None when that changes nothing (the deployment then uses
    the original file)."""
    seen: set[tuple[str, str]] = set()
    for edge in edge_relays:
        _check_edge(cfg, edge)
        if (edge.source, edge.target) in seen:
            raise ComposeError(f"--edge-relay {edge}: that edge is given twice")
        seen.add((edge.source, edge.target))
    # Sorted so the flags' order does not change the file.
    changes = sorted(
        e for e in edge_relays if cfg.relay_for(e.source, e.target).backend != e.backend
    )
    if not changes and not mounts:
        return None
    data = _raw_pipeline(cfg, source)
    stages = {s["name"]: s for s in data["stages"]}
    for edge in changes:
        _apply_edge(cfg, stages[edge.source], edge)
    point_at_mounts(data, cfg, mounts or [])
    try:
        derived = PipelineConfig.from_dict(data, source_dir=cfg.source_dir, resolve=resolve)
    except ConfigError as exc:
        flags = " ".join(f"--edge-relay {e}" for e in changes)
        with_flags = f"with {flags} " if flags else "derived for the containers, "
        raise ComposeError(
            f"{with_flags}the pipeline is invalid: {'; '.join(exc.errors)}"
        ) from None
    what = [", ".join(map(str, changes))] if changes else []
    what += [f"{', '.join(m.fields)} -> {m.target}" for m in mounts or []]
    header = (
        f"# Derived from {source.name} by `omnirail compose` "
        f"({'; '.join(what)}); edit {source.name}, not this file.\n"
    )
    return derived, header + yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


def _check_edge(cfg: PipelineConfig, edge: EdgeRelay) -> None:
    from omnirail.relay.base import relay_backends

    for name in (edge.source, edge.target):
        if name not in cfg.stage_names:
            known = ", ".join(cfg.stage_names)
            raise ComposeError(f"--edge-relay {edge}: unknown stage {name!r} (stages: {known})")
    targets = cfg.edges_of(edge.source)
    if edge.target not in targets:
        sends = ", ".join(targets) or "nothing"
        raise ComposeError(
            f"--edge-relay {edge}: {edge.source} has no edge to {edge.target} "
            f"({edge.source} sends to: {sends})"
        )
    known = relay_backends()
    if edge.backend not in known:
        raise ComposeError(
            f"--edge-relay {edge}: unknown relay backend {edge.backend!r} "
            f"(known: {', '.join(known)})"
        )
    process = cfg.process_of(edge.source)
    if process == cfg.process_of(edge.target):
        raise ComposeError(
            f"--edge-relay {edge}: both stages run in process {process!r} (one container), "
            "where no relay carries the edge"
        )


def _raw_pipeline(cfg: PipelineConfig, source: Path) -> dict[str, Any]:
    """The pipeline as authored: the YAML itself, or the loaded config of a .py file."""
    if source.suffix.lower() in (".yaml", ".yml"):
        return read_yaml(source)  # the bounded loader load_pipeline used
    try:
        return cfg.model_dump(mode="json", exclude_unset=True)
    except ValueError as exc:  # pydantic's serialization error is a ValueError
        raise ComposeError(
            f"{source}: --edge-relay needs the pipeline as YAML and it cannot be written "
            f"as YAML: {exc}"
        ) from None


def _apply_edge(cfg: PipelineConfig, stage: dict[str, Any], edge: EdgeRelay) -> None:
    relay_to = stage.get("relay_to") or {}
    entry = dict(relay_to.get(edge.target) or {})
    entry["backend"] = edge.backend
    inherited = cfg.relay_for(edge.source)
    # Options set on the edge, or on the stage for this very backend, are the author's.
    own = "options" in entry or (inherited.backend == edge.backend and inherited.options)
    if not own and edge.backend in CONTAINER_EDGE_OPTIONS:
        entry["options"] = copy.deepcopy(CONTAINER_EDGE_OPTIONS[edge.backend])
    stage["relay_to"] = {**relay_to, edge.target: entry}
