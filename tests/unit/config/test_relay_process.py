"""Per-process relay fields: what a process opens each backend with, and the overrides
that could not apply (refused by validation instead of dropped at run time)."""

from __future__ import annotations

from typing import Any

import pytest

from omnirail.config import ConfigError, PipelineConfig
from omnirail.config.relays import process_relays
from omnirail.stage_service.relays import plan_relays
from tests.unit.config.helpers import T, config_error, pipe, st

NIXL = "nixl"


def two_edges(a_relay: dict[str, Any] | None = None, **relay_to: dict[str, Any]) -> dict:
    """a sends to b and c (relay_to as given); b and c are terminal."""
    a = st("a", next=["b", "c"], relay_to=relay_to, **({"relay": a_relay} if a_relay else {}))
    return pipe(a, st("b", terminal=True), st("c", terminal=True))


def fan_in(**relays: dict[str, Any]) -> dict:
    """a and b both send to c; `relays[x]` is stage x's relay_to[c] (or relay for c)."""
    c = {"wait_for": ["a", "b"], "merge_fn": f"{T}:merge", "terminal": True}
    if "c" in relays:
        c["relay"] = relays["c"]
    return pipe(
        st("s", next=["a", "b"]),
        st("a", next="c", relay_to={"c": relays["a"]}),
        st("b", next="c", relay_to={"c": relays["b"]}),
        st("c", **c),
    )


def test_per_edge_fields_may_differ_per_edge() -> None:
    cfg = PipelineConfig.from_dict(
        two_edges(b={"credits": 1, "credit_mb": 1, "inline_bytes": 0}, c={"credits": 4})
    )
    assert (cfg.relay_for("a", "b").credits, cfg.relay_for("a", "c").credits) == (1, 4)
    (shm,) = plan_relays(cfg, ["a"]).values()
    assert shm.edges == ["a->b", "a->c"]


def test_an_edge_cannot_change_what_its_process_opens_the_backend_with() -> None:
    err = config_error(two_edges(b={"pool_mb": 512, "credits": 8}))
    assert err.errors == [
        "stages[a].relay_to[b].pool_mb: pool_mb is per process: process 'a' opens one 'shm' "
        "relay for all its edges, with pool_mb 256 (the default), not 512"
    ]
    err = config_error(two_edges({"pool_mb": 64, "device": "cuda:0"}, c={"device": "cpu"}))
    assert (
        "stages[a].relay_to[c].device: device is per process: process 'a' opens one 'shm' "
        "relay for all its edges, with device 'cuda:0' (from stages[a].relay), not 'cpu'"
    ) in err.errors
    # ...and a device pool is refused as such (host pools only; CUDA tensors stage through).
    assert any(
        e.startswith("stages[a].relay.device: 'cuda:0' is not supported") for e in err.errors
    )
    # The same value, or one set where it applies to the whole process, is fine.
    cfg = PipelineConfig.from_dict(two_edges({"pool_mb": 64}, b={"pool_mb": 64}))
    assert plan_relays(cfg, ["a"])["shm"].config.pool_mb == 64


def test_options_are_per_process_key_by_key() -> None:
    stage = {"backend": NIXL, "options": {"num_threads": 2}}
    err = config_error(two_edges(stage, b={"options": {"num_threads": 4}}))
    assert err.errors == [
        "stages[a].relay_to[b].options.num_threads: options are per process: process 'a' "
        "opens one 'nixl' relay for all its edges, with options.num_threads 2 (from "
        "stages[a].relay), not 4"
    ]
    # Keys set by different configs all apply; typed values compare equal (30 == 30.0).
    cfg = PipelineConfig.from_dict(
        two_edges(
            stage,
            b={"options": {"num_threads": 2, "fetch_timeout_s": 30}},
            c={"options": {"fetch_timeout_s": 30.0, "spin_us": 0}},
        )
    )
    opened = plan_relays(cfg, ["a"])
    assert list(opened) == [NIXL]
    assert opened[NIXL].config.options == {"num_threads": 2, "fetch_timeout_s": 30, "spin_us": 0}


def test_edges_that_switch_to_one_backend_must_agree() -> None:
    err = config_error(
        two_edges(
            b={"backend": "ucx", "options": {"progress": "polling"}},
            c={"backend": "ucx", "options": {"progress": "blocking"}, "pool_mb": 16},
        )
    )
    assert err.errors == [
        "stages[a].relay_to[c].pool_mb: pool_mb is per process: process 'a' opens one 'ucx' "
        "relay for all its edges, with pool_mb 256 (the default), not 16",
        "stages[a].relay_to[c].options.progress: options are per process: process 'a' opens "
        "one 'ucx' relay for all its edges, with options.progress 'polling' (from "
        "stages[a].relay_to[b]), not 'blocking'",
    ]
    cfg = PipelineConfig.from_dict(
        two_edges(
            b={"backend": "ucx", "options": {"progress": "polling"}},
            c={"backend": "ucx", "options": {"ucx_config": {"TLS": "tcp"}}},
        )
    )
    opened = plan_relays(cfg, ["a"])
    assert opened["ucx"].config.options == {"progress": "polling", "ucx_config": {"TLS": "tcp"}}
    assert opened["shm"].edges == ["a->*"]


def test_stages_sharing_a_process_share_its_relays() -> None:
    d = pipe(
        st("a", next="b", process="p", relay={"pool_mb": 32}),
        st("b", terminal=True, process="p"),
    )
    assert config_error(d).errors == [
        "stages[b].relay.pool_mb: pool_mb is per process: process 'p' opens one 'shm' relay "
        "for all its edges, with pool_mb 32 (from stages[a].relay), not 256 (the default)"
    ]


def test_a_receive_only_process_opens_with_its_senders_configs_which_must_agree() -> None:
    peer = {"backend": NIXL, "options": {"ucx_error_handling_mode": "peer"}}
    cfg = PipelineConfig.from_dict(fan_in(a=peer, b={"backend": NIXL}))
    opened = plan_relays(cfg, ["c"])
    assert opened[NIXL].config.options == {"ucx_error_handling_mode": "peer"}
    assert opened[NIXL].edges == ["a->c", "b->c"]
    none = {"backend": NIXL, "options": {"ucx_error_handling_mode": "none"}}
    assert config_error(fan_in(a=peer, b=none)).errors == [
        "stages[b].relay_to[c].options.ucx_error_handling_mode: options are per process: "
        "process 'c' only receives over 'nixl' and opens one relay for all those edges (the "
        "senders' configs, here a->c and b->c), with options.ucx_error_handling_mode 'peer' "
        "(from stages[a].relay_to[c]), not 'none'"
    ]


def test_a_process_that_sends_with_the_backend_keeps_its_own_config() -> None:
    # c opens nixl for its own relay: what a and b send to it with configures a and b.
    cfg = PipelineConfig.from_dict(
        fan_in(
            a={"backend": NIXL, "options": {"ucx_error_handling_mode": "peer"}},
            b={"backend": NIXL, "pool_mb": 8},
            c={"backend": NIXL, "options": {"num_threads": 1}},
        )
    )
    (nixl,) = plan_relays(cfg, ["c"]).values()
    assert nixl.config.options == {"num_threads": 1}
    assert nixl.config.pool_mb == 256
    assert nixl.edges == ["a->c", "b->c"]
    assert plan_relays(cfg, ["b"])[NIXL].config.pool_mb == 8


def test_a_relay_to_rank_other_than_the_stage_rank_is_refused() -> None:
    td = {"backend": "torchdist", "world_size": 2, "options": {"init_method": "tcp://h:1"}}
    d = pipe(
        st("a", next="b", relay={"rank": 0}, relay_to={"b": {**td, "rank": 1}}),
        st("b", terminal=True, relay={"rank": 1}),
    )
    assert (
        "stages[a].relay_to[b].rank: rank is per process: process 'a' has one rank for all "
        "its relays, with rank 0 (from stages[a].relay), not 1"
    ) in config_error(d).errors
    # Stages sharing a process share its rank.
    d = pipe(
        st("a", next="b", process="p", relay={"rank": 0}),
        st("b", next="c", process="p", relay={"rank": 0}, relay_to={"c": td}),
        st("c", terminal=True, relay={"rank": 1}),
    )
    assert plan_relays(PipelineConfig.from_dict(d), ["a", "b"])["torchdist"].config.rank == 0
    d["stages"][1]["relay"] = {"rank": 1}
    assert (
        "stages[b].relay.rank: rank is per process: process 'p' has one rank for all its "
        "relays, with rank 0 (from stages[a].relay), not 1"
    ) in config_error(d).errors


def test_plan_relays_refuses_a_config_that_skipped_validation() -> None:
    cfg = PipelineConfig.model_validate(two_edges(b={"pool_mb": 512}))
    with pytest.raises(ConfigError, match=r"relay_to\[b\]\.pool_mb: pool_mb is per process"):
        plan_relays(cfg, ["a"])
    opened, problems = process_relays(cfg, ["b"], "b")  # b's own process is fine
    assert problems == [] and list(opened) == ["shm"]
