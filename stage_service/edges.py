"""The relay each outgoing edge of a stage sends with (per-edge selection, `relay_to`).

Every per-edge field of an edge's merged config applies to that edge: its backend picks
the relay, `inline_bytes` its inline bound, and `credits` / `credit_mb` bound it in the
sender's relay (`Relay.set_edge_credits`), whichever config the relay was opened with.

An edge to a stage hosted in the same process (`process:` or `fused_stages`) is local:
its items are handed over in the process, values by reference, with no packing, relay or
gRPC (seed 003's "stage-level local dispatch"); its relay config does not apply.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from omnirail.config import PipelineConfig, RelayConfig
from omnirail.relay.base import Relay


class EdgeRelay:
    """One edge `stage->target`: its relay, inline bound and credit name, and whether the
    target is hosted in this process (`local`)."""

    __slots__ = ("inline_bytes", "local", "name", "relay")

    def __init__(self, name: str, relay: Relay, inline_bytes: int, local: bool = False) -> None:
        self.name = name
        self.relay = relay
        self.inline_bytes = inline_bytes
        self.local = local


class EdgeRelays:
    def __init__(
        self,
        stage: str,
        default: Relay,
        inline_bytes: int,
        credits: tuple[int, int] | None = None,
        local: frozenset[str] = frozenset(),
    ) -> None:
        self._stage = stage
        # Stages hosted in this process (their edges are local).
        self._local = local
        self._default = default
        self._inline_bytes = inline_bytes
        # (slots, bytes) of an edge outside the static ones (None: the relay's default).
        self._credits = credits
        self._edges: dict[str, EdgeRelay] = {}

    @classmethod
    def of(
        cls,
        pipeline: PipelineConfig,
        stage: str,
        relays: Mapping[str, Relay],
        local: Iterable[str] = (),
    ) -> EdgeRelays:
        """Every edge of `stage` with the backend its config picks (from `relays`), its
        inline bound and its credits; edges to the stages in `local` (hosted in this
        process) are local."""
        cfg = pipeline.relay_for(stage)
        edges = cls(stage, relays[cfg.backend], cfg.inline_bytes, _credits(cfg), frozenset(local))
        for target in pipeline.edges_of(stage):
            edge_cfg = pipeline.relay_for(stage, target)
            edges._add(target, relays[edge_cfg.backend], edge_cfg.inline_bytes, _credits(edge_cfg))
        return edges

    def _add(
        self, target: str, relay: Relay, inline_bytes: int, credits: tuple[int, int] | None
    ) -> EdgeRelay:
        name = f"{self._stage}->{target}"
        edge = self._edges[target] = EdgeRelay(name, relay, inline_bytes, target in self._local)
        if credits is not None:
            relay.set_edge_credits(edge.name, *credits)
        return edge

    def __getitem__(self, target: str) -> EdgeRelay:
        edge = self._edges.get(target)
        if edge is None:  # a target outside the static edges: the stage's own relay
            edge = self._add(target, self._default, self._inline_bytes, self._credits)
        return edge


def _credits(cfg: RelayConfig) -> tuple[int, int]:
    return cfg.credits, cfg.credit_mb << 20
