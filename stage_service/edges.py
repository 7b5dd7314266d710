"""The relay each outgoing edge of a stage sends with (per-edge selection, `relay_to`)."""

from __future__ import annotations

from collections.abc import Mapping

from omnirail.config import PipelineConfig
from omnirail.relay.base import Relay


class EdgeRelay:
    """One edge `stage->target`: its relay, inline bound and credit name."""

    __slots__ = ("inline_bytes", "name", "relay")

    def __init__(self, name: str, relay: Relay, inline_bytes: int) -> None:
        self.name = name
        self.relay = relay
        self.inline_bytes = inline_bytes


class EdgeRelays:
    def __init__(self, stage: str, default: Relay, inline_bytes: int) -> None:
        self._stage = stage
        self._default = default
        self._inline_bytes = inline_bytes
        self._edges: dict[str, EdgeRelay] = {}

    @classmethod
    def of(cls, pipeline: PipelineConfig, stage: str, relays: Mapping[str, Relay]) -> EdgeRelays:
        """Every edge of `stage` with the backend its config picks (from `relays`)."""
        cfg = pipeline.relay_for(stage)
        edges = cls(stage, relays[cfg.backend], cfg.inline_bytes)
        for target in pipeline.edges_of(stage):
            edge_cfg = pipeline.relay_for(stage, target)
            edges._edges[target] = EdgeRelay(
                f"{stage}->{target}", relays[edge_cfg.backend], edge_cfg.inline_bytes
            )
        return edges

    def __getitem__(self, target: str) -> EdgeRelay:
        edge = self._edges.get(target)
        if edge is None:  # a target outside the static edges: the stage's own relay
            edge = self._edges[target] = EdgeRelay(
                f"{self._stage}->{target}", self._default, self._inline_bytes
            )
        return edge
