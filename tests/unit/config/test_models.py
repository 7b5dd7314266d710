"""PipelineConfig models: defaults, derived values and topology queries."""

from __future__ import annotations

import pytest

from omnirail.config import (
    EndpointsConfig,
    PipelineConfig,
    RelayConfig,
    StageConfig,
    format_topology,
    load_pipeline,
)
from tests.unit.config.helpers import (
    CONFIGS,
    F,
    T,
    config_error,
    demo,
    pipe,
    st,
    stage_of,
)

# -- valid configs and derived values -----------------------------------------------------


def test_demo_is_valid_and_derives_topology() -> None:
    cfg = PipelineConfig.from_dict(demo())
    assert cfg.name == "/models/demo"
    assert cfg.stage_names[0] == "preprocessing"
    assert cfg.resolved_entry_stage == "preprocessing"
    assert cfg.terminal_stages == ["decode", "code2wav"]
    assert cfg.stage("image_encoder").next == ["mm_aggregate"]
    assert cfg.stage("image_encoder").next_stages == ["mm_aggregate"]
    assert cfg.stage("decode").next_stages == []
    assert cfg.upstream_of("mm_aggregate") == ["preprocessing", "image_encoder", "audio_encoder"]
    assert cfg.upstream_of("preprocessing") == []
    assert cfg.source_dir is None


def test_name_defaults() -> None:
    d = pipe(st("a", terminal=True))
    assert PipelineConfig.from_dict(d).name == "pipeline"
    assert PipelineConfig.from_dict({**d, "model_path": "org/m"}).name == "org/m"
    assert PipelineConfig.from_dict({**d, "name": "x", "model_path": "org/m"}).name == "x"


def test_stage_lookup_error_names_the_stage() -> None:
    cfg = PipelineConfig.from_dict(demo())
    with pytest.raises(KeyError, match="unknown stage 'nope'"):
        cfg.stage("nope")


def test_entry_stage_override() -> None:
    d = pipe(st("b", terminal=True), st("a", next="b"), entry_stage="a")
    cfg = PipelineConfig.from_dict(d)
    assert cfg.resolved_entry_stage == "a"


def test_relay_backend_shorthand() -> None:
    d = pipe(st("a", terminal=True), relay_backend="nixl")
    assert PipelineConfig.from_dict(d).relay.backend == "nixl"
    assert PipelineConfig.from_dict(d).relay_backend == "nixl"
    d2 = pipe(st("a", terminal=True), relay_backend="nixl", relay={"pool_mb": 8})
    cfg = PipelineConfig.from_dict(d2)
    assert (cfg.relay.backend, cfg.relay.pool_mb) == ("nixl", 8)
    obj = PipelineConfig(
        stages=[StageConfig(name="a", factory=F, terminal=True)], relay_backend="ucx"
    )
    assert obj.relay.backend == "ucx"


def test_relay_backend_conflict() -> None:
    d = pipe(st("a", terminal=True), relay_backend="nixl", relay={"backend": "shm"})
    assert "conflicts with relay.backend" in str(config_error(d))


def test_relay_for_merges_stage_override_over_pipeline_default() -> None:
    d = demo()
    d["relay"] = {"backend": "nixl", "credits": 8}
    stage_of(d, "thinker")["relay"] = {"pool_mb": 32, "credit_mb": 16}
    cfg = PipelineConfig.from_dict(d)
    r = cfg.relay_for("thinker")
    assert (r.backend, r.credits, r.pool_mb, r.credit_mb) == ("nixl", 8, 32, 16)
    assert cfg.relay_for("decode") == cfg.relay


def test_relay_to_settings() -> None:
    from omnirail.relay.base import RelaySettings
    from omnirail.relay.options import ShmOptions

    r = RelayConfig(
        pool_mb=2, credits=3, credit_mb=4, rank=1, world_size=2, options={"copy_threads": 1}
    )
    s = r.to_settings("omni-run1")
    assert isinstance(s, RelaySettings)
    assert s.pool_bytes == 2 << 20
    assert s.credit_slots == 3
    assert s.credit_bytes == 4 << 20
    assert s.name_prefix == "omni-run1"
    # device, rank and world_size are settings fields; the options are the backend's model.
    assert (s.device, s.rank, s.world_size) == ("cpu", 1, 2)
    assert s.options == ShmOptions(copy_threads=1)
    assert RelayConfig(device="cuda:1").to_settings("p").device == "cuda:1"


def test_relay_defaults() -> None:
    r = RelayConfig()
    assert (r.backend, r.inline_bytes, r.pool_mb, r.credits, r.credit_mb) == (
        "shm",
        65536,
        256,
        64,
        1024,
    )
    assert RelayConfig(inline_bytes=0).inline_bytes == 0


def test_endpoint_defaults() -> None:
    e = EndpointsConfig()
    assert (e.transport, e.base_path, e.host, e.coordinator, e.max_message_mb) == (
        "unix",
        None,
        "127.0.0.1",
        None,
        64,
    )
    cfg = PipelineConfig.from_dict(pipe(st("a", terminal=True)))
    assert cfg.endpoints == e
    assert (cfg.default_timeout_s, cfg.max_input_mb, cfg.abort_ack_timeout_s) == (60.0, 32, 0.5)


def test_gpu_placement_and_gpus() -> None:
    d = pipe(st("a", next="b", gpu=0), st("b", terminal=True, gpu=[1, 2], tp_size=2))
    cfg = PipelineConfig.from_dict(d)
    assert cfg.gpu_placement == {"a": 0, "b": [1, 2]}
    assert cfg.stage("b").gpus == [1, 2]


# -- topology queries ---------------------------------------------------------------------


def test_process_groups_default_one_per_stage() -> None:
    cfg = PipelineConfig.from_dict(demo())
    groups = cfg.process_groups()
    assert list(groups) == cfg.stage_names
    assert all(groups[n] == [n] for n in cfg.stage_names)


def test_process_groups_explicit_and_fused() -> None:
    d = demo()
    stage_of(d, "preprocessing")["process"] = "cpu"
    stage_of(d, "decode")["process"] = "cpu"
    stage_of(d, "talker")["process"] = "speech"
    stage_of(d, "thinker")["process"] = "lm"
    d["fused_stages"] = [["talker", "code2wav"]]
    cfg = PipelineConfig.from_dict(d)
    assert cfg.process_groups() == {
        "cpu": ["preprocessing", "decode"],
        "image_encoder": ["image_encoder"],
        "audio_encoder": ["audio_encoder"],
        "mm_aggregate": ["mm_aggregate"],
        "lm": ["thinker"],
        "speech": ["talker", "code2wav"],
    }
    assert cfg.process_of("code2wav") == "speech"


def test_fused_group_merges_two_process_groups() -> None:
    d = pipe(
        st("a", next="b", process="front"),
        st("b", next="c", process="back"),
        st("c", next="t"),
        st("t", terminal=True, process="back"),
        fused_stages=[["a", "b"]],
    )
    cfg = PipelineConfig.from_dict(d)
    assert cfg.process_groups() == {"front": ["a", "b", "t"], "c": ["c"]}


def test_fused_groups_chain_merges() -> None:
    d = pipe(
        st("a", next="b"),
        st("b", next="c"),
        st("c", next="d"),
        st("d", terminal=True),
        fused_stages=[["c", "d"], ["a", "b"]],
    )
    cfg = PipelineConfig.from_dict(d)
    assert cfg.process_groups() == {"a": ["a", "b"], "c": ["c", "d"]}
    d["fused_stages"] = [["a", "b", "c", "d"]]
    assert PipelineConfig.from_dict(d).process_groups() == {"a": ["a", "b", "c", "d"]}


def test_tp_stage_has_own_group() -> None:
    d = demo()
    stage_of(d, "thinker").update(gpu=[0, 1], tp_size=2, process="lm")
    cfg = PipelineConfig.from_dict(d)
    assert cfg.process_groups()["lm"] == ["thinker"]


def test_reachable_stages() -> None:
    cfg = PipelineConfig.from_dict(demo())
    assert cfg.reachable_stages("thinker") == {"thinker", "decode", "talker", "code2wav"}
    assert cfg.reachable_stages("decode") == {"decode"}
    assert cfg.reachable_stages("preprocessing") == set(cfg.stage_names)
    with pytest.raises(KeyError):
        cfg.reachable_stages("ghost")


def test_possible_stages_for() -> None:
    cfg = PipelineConfig.from_dict(demo())
    front = {"preprocessing", "image_encoder", "audio_encoder", "mm_aggregate", "thinker"}
    assert cfg.possible_stages_for(["decode"]) == front | {"decode"}
    assert cfg.possible_stages_for(["code2wav"]) == front | {"talker", "code2wav"}
    assert cfg.possible_stages_for(["decode", "code2wav"]) == set(cfg.stage_names)
    assert cfg.possible_stages_for([]) == set()
    with pytest.raises(KeyError):
        cfg.possible_stages_for(["ghost"])


def test_possible_stages_is_computed_once_per_terminal_set() -> None:
    cfg = PipelineConfig.from_dict(demo())
    first = cfg.possible_stages(("decode",))
    assert first == frozenset(cfg.possible_stages_for(["decode"]))
    assert cfg.possible_stages(("decode",)) is first  # the coordinator and hosts share it
    assert cfg.possible_stages(("code2wav",)) != first


def test_possible_stages_for_branches() -> None:
    d = pipe(
        st("a", next=["b", "c"]),
        st("b", next="t1"),
        st("c", next="t2"),
        st("t1", terminal=True),
        st("t2", terminal=True),
    )
    cfg = PipelineConfig.from_dict(d)
    assert cfg.possible_stages_for(["t1"]) == {"a", "b", "t1"}
    assert cfg.possible_stages_for(("t2",)) == {"a", "c", "t2"}


def test_factory_args_for() -> None:
    d = demo()
    stage_of(d, "thinker").update(factory=f"{T}:factory_with_model_path", factory_args={"size": 2})
    stage_of(d, "decode")["factory_args"] = {"a": 1, "b": 2}
    d["runtime_overrides"] = {"decode": {"b": 3, "c": 4}}
    cfg = PipelineConfig.from_dict(d)
    # `factory` takes **kwargs only: model_path is not injected.
    assert cfg.factory_args_for("decode") == {"a": 1, "b": 3, "c": 4}
    assert cfg.factory_args_for("thinker") == {"size": 2, "model_path": "/models/demo"}
    # The stored config is not changed by merging.
    assert cfg.stage("decode").factory_args == {"a": 1, "b": 2}


def test_factory_args_for_keeps_explicit_model_path() -> None:
    d = demo()
    stage_of(d, "thinker").update(
        factory=f"{T}:factory_with_model_path", factory_args={"model_path": "/other"}
    )
    cfg = PipelineConfig.from_dict(d)
    assert cfg.factory_args_for("thinker") == {"model_path": "/other"}
    d["runtime_overrides"] = {"thinker": {"model_path": "/override"}}
    assert PipelineConfig.from_dict(d).factory_args_for("thinker") == {"model_path": "/override"}


def test_factory_args_for_without_model_path() -> None:
    d = demo()
    del d["model_path"]
    stage_of(d, "thinker")["factory"] = f"{T}:factory_with_model_path"
    cfg = PipelineConfig.from_dict(d)
    assert cfg.factory_args_for("thinker") == {}


def test_format_topology() -> None:
    cfg = load_pipeline(CONFIGS / "demo.yaml")
    text = format_topology(cfg)
    assert text.splitlines()[0] == "pipeline: demo"
    assert "entry: preprocessing" in text
    assert "terminals: decode, code2wav" in text
    assert "processes:" in text
    assert "  thinker [relay=shm]" in text
    assert "    next: decode, talker" in text
    assert "    route_fn: tests.unit.config.helpers:route" in text
    assert "    stream_to: talker" in text
    assert "    wait_for: preprocessing, image_encoder, audio_encoder" in text
    assert "    terminal: yes" in text


def test_cpus_as_lists_or_ranges_and_the_union_per_process() -> None:
    d = pipe(
        st("a", next="b", cpus="2-3", process="p"),
        st("b", next="c", cpus=[1, 1], process="p"),
        st("c", terminal=True),
        coordinator_cpus="0",
    )
    cfg = PipelineConfig.from_dict(d)
    assert cfg.stage("a").cpus == [2, 3] and cfg.stage("b").cpus == [1]
    assert cfg.coordinator_cpus == [0]
    assert cfg.process_cpus(["a", "b"]) == [1, 2, 3]
    assert cfg.process_cpus(["c"]) is None
    text = format_topology(cfg)
    assert "  coordinator [cpus=0]" in text and "  p: a, b [cpus=1,2,3]" in text
    assert "  c: c\n" in text


@pytest.mark.parametrize("bad", [[], [-1], "0-", [True], "x", 3])
def test_bad_cpus_name_the_stage_and_field(bad: object) -> None:
    err = config_error(pipe(st("a", terminal=True, cpus=bad)))
    assert "stages[a].cpus" in str(err)
    assert "coordinator_cpus" in str(
        config_error(pipe(st("a", terminal=True), coordinator_cpus=bad))
    )


def test_cpu_wake_latency_is_off_unless_set() -> None:
    assert PipelineConfig.from_dict(pipe(st("a", terminal=True))).cpu_wake_latency_us is None
    cfg = PipelineConfig.from_dict(pipe(st("a", terminal=True), cpu_wake_latency_us=0))
    assert cfg.cpu_wake_latency_us == 0
    assert "cpu wake latency: idle CPUs held to wake within 0 µs\n" in format_topology(cfg)


@pytest.mark.parametrize("bad", [-1, 1_000_001, "0", True, 2.5])
def test_bad_cpu_wake_latency_names_the_field(bad: object) -> None:
    err = config_error(pipe(st("a", terminal=True), cpu_wake_latency_us=bad))
    assert "pipeline.cpu_wake_latency_us" in str(err)
