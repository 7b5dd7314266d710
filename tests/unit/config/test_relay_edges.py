"""Per-edge relay selection (`relay_to`) and the torchdist rank topology."""

from __future__ import annotations

from omnirail.config import PipelineConfig
from omnirail.stage_service.relays import plan_relays, relay_host
from tests.unit.config.helpers import config_error, pipe, st

TD = {"backend": "torchdist", "world_size": 2, "options": {"init_method": "tcp://10.0.0.1:29500"}}


def chain(**kw: object) -> dict:
    return pipe(st("a", next="b", **kw), st("b", next="c"), st("c", terminal=True))


def test_relay_to_overrides_only_that_edge() -> None:
    cfg = PipelineConfig.from_dict(
        chain(relay={"credits": 8}, relay_to={"b": {"backend": "nixl", "inline_bytes": 0}})
    )
    edge = cfg.relay_for("a", "b")
    assert (edge.backend, edge.inline_bytes, edge.credits) == ("nixl", 0, 8)
    assert cfg.relay_for("a").backend == "shm"
    assert cfg.relay_for("b", "c").backend == "shm"
    assert cfg.backends_of("a") == {"shm", "nixl"}
    assert cfg.backends_of("b") == {"shm", "nixl"}  # receives a->b over nixl
    assert cfg.backends_of("c") == {"shm"}


def test_relay_to_must_name_an_edge() -> None:
    err = str(config_error(chain(relay_to={"c": {"backend": "ucx"}})))
    assert "stages[a].relay_to: 'c' is not in next or stream_to" in err


def test_unknown_backends_are_named_where_they_are_set() -> None:
    err = str(config_error(chain(relay_to={"b": {"backend": "carrier-pigeon"}})))
    assert "stages[a].relay_to[b].backend: unknown relay backend 'carrier-pigeon'" in err
    err = str(config_error(pipe(st("a", terminal=True), relay={"backend": "rdma"})))
    assert "pipeline.relay.backend: unknown relay backend 'rdma'" in err


def test_torchdist_needs_ranks_for_every_process_that_uses_it() -> None:
    d = chain(relay={"rank": 0}, relay_to={"b": TD})
    err = str(config_error(d))
    assert (
        "stages[b].relay.rank: required: the stage sends or receives over torchdist (a->b)" in err
    )
    assert "stages[c]" not in err


def test_torchdist_ranks_are_unique_and_need_an_init_method() -> None:
    d = pipe(
        st("a", next="b", relay={"rank": 0}),
        st("b", terminal=True, relay={"rank": 0}),
        relay={"backend": "torchdist", "world_size": 2},
    )
    err = str(config_error(d))
    assert "stages[b].relay.rank: rank 0 is also used by process 'a'" in err
    assert "stages[a].relay: edge a->b uses torchdist but sets no options.init_method" in err


def test_plan_names_edges_and_takes_the_hosted_stage_rank() -> None:
    cfg = PipelineConfig.from_dict(
        pipe(
            st("a", next="b", relay={"rank": 0}, relay_to={"b": TD}),
            st("b", terminal=True, relay={"rank": 1}),
        )
    )
    plans = plan_relays(cfg, ["b"])
    assert plans["torchdist"].edges == ["a->b"]
    assert plans["torchdist"].config.rank == 1
    assert plans["shm"].edges == ["b->*"]
    assert plan_relays(cfg, ["a"])["torchdist"].config.rank == 0


def test_relay_host_of_addresses() -> None:
    assert relay_host("10.1.2.3:5000") == "10.1.2.3"
    assert relay_host("[::1]:5000") == "::1"
    assert relay_host("unix:///tmp/x.sock") == ""


def test_bad_copy_options_are_named_where_they_are_set() -> None:
    err = str(
        config_error(
            chain(
                relay={"options": {"copy_threads": 0}},
                relay_to={"b": {"backend": "ucx", "options": {"copy_thread_bytes": "8MiB"}}},
            )
        )
    )
    assert "stages[a].relay.options.copy_threads: input should be greater than or equal to 1" in err
    assert "stages[a].relay_to[b].options.copy_thread_bytes: input should be a valid integer" in err
    err = str(config_error(pipe(st("a", terminal=True), relay={"options": {"copy_threads": 1.5}})))
    assert "pipeline.relay.options.copy_threads: input should be a valid integer" in err
    PipelineConfig.from_dict(pipe(st("a", terminal=True), relay={"options": {"copy_threads": 4}}))


def test_bad_forward_option_is_named() -> None:
    err = str(config_error(chain(relay={"options": {"forward_views": "no"}})))
    assert "stages[a].relay.options.forward_views: input should be a valid boolean" in err
