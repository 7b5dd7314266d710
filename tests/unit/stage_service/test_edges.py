"""EdgeRelays: every edge gets its own merged config's backend, inline bound and credits."""

from __future__ import annotations

from typing import Any

from omnirail.config import PipelineConfig
from omnirail.relay.base import Relay
from omnirail.stage_service.edges import EdgeRelays
from tests.unit.config.helpers import pipe, st
from tests.unit.stage_service.relay_fakes import ScriptedRelay

MiB = 1 << 20


class CreditRecorder(ScriptedRelay):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.limits: dict[str, tuple[int, int]] = {}

    def set_edge_credits(self, edge: str, slots: int, nbytes: int) -> None:
        self.limits[edge] = (slots, nbytes)


def edges_of(**relay_to: Any) -> tuple[Any, dict[str, CreditRecorder]]:
    cfg = PipelineConfig.from_dict(
        pipe(
            st("a", next=["b", "c", "d"], relay={"credits": 16, "credit_mb": 2}, relay_to=relay_to),
            st("b", terminal=True),
            st("c", terminal=True),
            st("d", terminal=True),
        )
    )
    relays = {"shm": CreditRecorder("shm"), "nixl": CreditRecorder("nixl")}
    mapping: dict[str, Relay] = dict(relays)
    return EdgeRelays.of(cfg, "a", mapping), relays


def test_each_edge_is_bounded_by_its_own_credits_in_its_relay() -> None:
    edges, relays = edges_of(
        b={"credits": 1, "credit_mb": 1},
        c={"credits": 4, "inline_bytes": 0},
        d={"backend": "nixl", "credits": 2},
    )
    assert relays["shm"].limits == {"a->b": (1, 1 * MiB), "a->c": (4, 2 * MiB)}
    assert relays["nixl"].limits == {"a->d": (2, 2 * MiB)}
    assert (edges["c"].relay, edges["c"].inline_bytes) == (relays["shm"], 0)
    assert edges["d"].relay is relays["nixl"] and edges["d"].name == "a->d"


def test_a_target_outside_the_static_edges_gets_the_stage_credits() -> None:
    edges, relays = edges_of()
    assert edges["elsewhere"].relay is relays["shm"]
    assert relays["shm"].limits["a->elsewhere"] == (16, 2 * MiB)
    assert edges["elsewhere"] is edges["elsewhere"]


def test_edges_to_stages_hosted_here_are_local() -> None:
    cfg = PipelineConfig.from_dict(
        pipe(st("a", next=["b", "c"]), st("b", terminal=True), st("c", terminal=True))
    )
    relays: dict[str, Relay] = {"shm": CreditRecorder("shm")}
    edges = EdgeRelays.of(cfg, "a", relays, local=["a", "b"])
    assert edges["b"].local and not edges["c"].local
    assert edges["b"].name == "a->b"  # its stream credit is still counted per edge
    assert not edges["elsewhere"].local
    assert not EdgeRelays.of(cfg, "a", relays)["b"].local
