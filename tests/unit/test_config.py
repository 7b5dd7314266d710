"""Tests for omnirail.config: models, every validation rule, loading and topology queries."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from omnirail import dotted
from omnirail.config import (
    ConfigError,
    EndpointsConfig,
    PipelineConfig,
    RelayConfig,
    StageConfig,
    format_topology,
    load_pipeline,
    validate,
)

CONFIGS = Path(__file__).parent / "configs"
T = "tests.unit.test_config"
F = f"{T}:factory"


# -- dotted targets used by the configs below ---------------------------------------------


def factory(**kwargs: Any) -> dict[str, Any]:
    return kwargs


def factory_with_model_path(model_path: str | None = None, size: int = 1) -> dict[str, Any]:
    return {"model_path": model_path, "size": size}


def merge(payloads: dict[str, Any]) -> Any:
    return payloads


def select_sources(request_id: str, from_stage: str, payload: Any) -> list[str] | None:
    return None


def route(request_id: str, output: Any) -> list[str]:
    return []


def project(payload: Any) -> Any:
    return payload


NOT_CALLABLE = 42


# -- helpers ------------------------------------------------------------------------------


def st(name: str, **kw: Any) -> dict[str, Any]:
    return {"name": name, "factory": F, **kw}


def pipe(*stages: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {"stages": list(stages), **kw}


def demo() -> dict[str, Any]:
    """A valid omni-like topology: fan-out, fan-in, streaming, two terminals."""
    return pipe(
        st("preprocessing", next=["image_encoder", "audio_encoder", "mm_aggregate"]),
        st("image_encoder", next="mm_aggregate"),
        st("audio_encoder", next="mm_aggregate"),
        st(
            "mm_aggregate",
            wait_for=["preprocessing", "image_encoder", "audio_encoder"],
            merge_fn=f"{T}:merge",
            next="thinker",
        ),
        st("thinker", next=["decode", "talker"], stream_to=["talker"]),
        st("decode", terminal=True),
        st("talker", next="code2wav"),
        st("code2wav", terminal=True),
        model_path="/models/demo",
    )


def stage_of(d: dict[str, Any], name: str) -> dict[str, Any]:
    return next(s for s in d["stages"] if s["name"] == name)


def config_error(d: Any, resolve: bool = True) -> ConfigError:
    with pytest.raises(ConfigError) as ei:
        PipelineConfig.from_dict(d, resolve=resolve)
    return ei.value


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
    stage_of(d, "thinker")["relay"] = {"pool_mb": 32, "device": "cuda:0"}
    cfg = PipelineConfig.from_dict(d)
    r = cfg.relay_for("thinker")
    assert (r.backend, r.credits, r.pool_mb, r.device) == ("nixl", 8, 32, "cuda:0")
    assert cfg.relay_for("decode") == cfg.relay


def test_relay_to_settings() -> None:
    from relay.base import RelaySettings

    r = RelayConfig(pool_mb=2, credits=3, credit_mb=4, rank=1, world_size=2, options={"x": 1})
    s = r.to_settings("omni-run1")
    assert isinstance(s, RelaySettings)
    assert s.pool_bytes == 2 << 20
    assert s.credit_slots == 3
    assert s.credit_bytes == 4 << 20
    assert s.name_prefix == "omni-run1"
    assert s.options == {"device": "cpu", "rank": 1, "world_size": 2, "x": 1}
    assert RelayConfig(options={"device": "cuda:1"}).to_settings("p").options["device"] == "cuda:1"


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
    assert (cfg.default_timeout_s, cfg.max_input_mb, cfg.abort_ack_timeout_s) == (60.0, 32, 5.0)


def test_gpu_placement_and_gpus() -> None:
    d = pipe(st("a", next="b", gpu=0), st("b", terminal=True, gpu=[1, 2], tp_size=2))
    cfg = PipelineConfig.from_dict(d)
    assert cfg.gpu_placement == {"a": 0, "b": [1, 2]}
    assert cfg.stage("b").gpus == [1, 2]


# -- semantic rules: each bad config names the stage and the field ------------------------


def _mut(fn: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    d = demo()
    fn(d)
    return d


def _set(stage: str, **kw: Any) -> Callable[[dict[str, Any]], None]:
    def apply(d: dict[str, Any]) -> None:
        s = stage_of(d, stage)
        for k, v in kw.items():
            if v is _DEL:
                s.pop(k, None)
            else:
                s[k] = v

    return apply


_DEL = object()

BAD_CASES: list[tuple[str, dict[str, Any], list[str]]] = [
    (
        "duplicate_name",
        pipe(st("a", next="b"), st("b", terminal=True), st("b", terminal=True)),
        ["stages[b].name", "duplicate stage name"],
    ),
    (
        "unknown_entry",
        {**demo(), "entry_stage": "foo"},
        ["pipeline.entry_stage: unknown stage 'foo'"],
    ),
    (
        "no_terminal",
        pipe(st("a", next="b"), st("b", next="a")),
        ["pipeline.stages: no terminal stage"],
    ),
    (
        "next_and_terminal",
        _mut(_set("decode", next="code2wav")),
        ["stages[decode].terminal", "exactly one of next / terminal"],
    ),
    (
        "neither_next_nor_terminal",
        _mut(_set("decode", terminal=False)),
        ["stages[decode].next", "exactly one of next / terminal"],
    ),
    (
        "next_unknown",
        _mut(_set("talker", next=["code2wav", "zz"])),
        ["stages[talker].next: unknown stage 'zz'"],
    ),
    (
        "next_self_loop",
        _mut(_set("talker", next=["code2wav", "talker"])),
        ["stages[talker].next", "cannot name itself"],
    ),
    (
        "next_duplicate",
        _mut(_set("talker", next=["code2wav", "code2wav"])),
        ["stages[talker].next: duplicate entry 'code2wav'"],
    ),
    (
        "next_empty",
        _mut(_set("talker", next=[])),
        ["stages[talker].next: must name at least one stage"],
    ),
    (
        "route_fn_on_terminal",
        _mut(_set("decode", route_fn=f"{T}:route")),
        ["stages[decode].route_fn", "not on terminal"],
    ),
    (
        "cycle",
        pipe(
            st("a", next=["b", "t"]), st("b", next="c"), st("c", next="b"), st("t", terminal=True)
        ),
        ["stages[b].next: cycle in next graph: b -> c -> b"],
    ),
    (
        "cycle_cannot_reach_terminal",
        pipe(
            st("a", next=["b", "t"]), st("b", next="c"), st("c", next="b"), st("t", terminal=True)
        ),
        ["stages[c].next: no terminal stage is reachable"],
    ),
    (
        "unreachable",
        pipe(st("a", next="t"), st("t", terminal=True), st("orphan", next="t")),
        ["stages[orphan]: not reachable from entry stage 'a'"],
    ),
    (
        "wait_for_without_merge_fn",
        _mut(_set("mm_aggregate", merge_fn=_DEL)),
        ["stages[mm_aggregate].merge_fn: required when wait_for is set"],
    ),
    (
        "wait_for_fn_without_wait_for",
        _mut(_set("thinker", wait_for_fn=f"{T}:select_sources")),
        ["stages[thinker].wait_for_fn: requires wait_for"],
    ),
    (
        "merge_fn_without_wait_for",
        _mut(_set("thinker", merge_fn=f"{T}:merge")),
        ["stages[thinker].merge_fn: requires wait_for"],
    ),
    (
        "wait_for_unknown",
        _mut(
            _set(
                "mm_aggregate",
                wait_for=["preprocessing", "image_encoder", "audio_encoder", "ghost"],
            )
        ),
        ["stages[mm_aggregate].wait_for: unknown stage 'ghost'"],
    ),
    (
        "wait_for_not_upstream",
        _mut(
            _set(
                "mm_aggregate",
                wait_for=["preprocessing", "image_encoder", "audio_encoder", "decode"],
            )
        ),
        ["stages[mm_aggregate].wait_for: stage 'decode' does not list 'mm_aggregate' in its next"],
    ),
    (
        "fan_in_without_wait_for",
        _mut(_set("mm_aggregate", wait_for=_DEL, merge_fn=_DEL)),
        ["stages[mm_aggregate].wait_for: required", "3 upstream stages"],
    ),
    (
        "wait_for_missing_upstream",
        _mut(_set("mm_aggregate", wait_for=["preprocessing", "image_encoder"])),
        ["stages[mm_aggregate].wait_for: missing upstream stage(s) 'audio_encoder'"],
    ),
    (
        "entry_wait_for",
        pipe(
            st("a", next="t", wait_for=["x"], merge_fn=f"{T}:merge"),
            st("x", next="a"),
            st("t", terminal=True),
        ),
        ["stages[a].wait_for: the entry stage cannot wait"],
    ),
    (
        "stream_to_unknown",
        _mut(_set("thinker", stream_to=["talker", "ghost"])),
        ["stages[thinker].stream_to: unknown stage 'ghost'"],
    ),
    (
        "stream_to_self",
        _mut(_set("thinker", stream_to=["thinker"])),
        ["stages[thinker].stream_to", "cannot name itself"],
    ),
    (
        "stream_done_to_fn_without_stream_to",
        _mut(_set("talker", stream_done_to_fn=f"{T}:route")),
        ["stages[talker].stream_done_to_fn: requires stream_to"],
    ),
    (
        "project_payload_not_in_next",
        _mut(_set("thinker", project_payload={"code2wav": f"{T}:project"})),
        ["stages[thinker].project_payload: target 'code2wav' is not in next"],
    ),
    (
        "gpu_list_len_mismatch",
        _mut(_set("thinker", gpu=[0, 1], tp_size=4)),
        ["stages[thinker].gpu: 2 GPU id(s) listed but tp_size is 4"],
    ),
    (
        "tp_without_gpu_list",
        _mut(_set("thinker", gpu=0, tp_size=2)),
        ["stages[thinker].tp_size", "requires gpu to be a list"],
    ),
    (
        "gpu_list_duplicates",
        _mut(_set("thinker", gpu=[1, 1], tp_size=2)),
        ["stages[thinker].gpu: duplicate GPU ids"],
    ),
    (
        "tp_stage_shares_process",
        _mut(
            lambda d: (
                _set("thinker", gpu=[0, 1], tp_size=2, process="shared")(d),
                _set("decode", process="shared")(d),
            )
        ),
        ["stages[thinker].process: TP stage cannot share process 'shared'"],
    ),
    (
        "process_spans_two_gpus",
        _mut(
            lambda d: (
                _set("thinker", gpu=0, process="gpu")(d),
                _set("talker", gpu=1, process="gpu")(d),
            )
        ),
        ["stages[thinker].process", "spans GPUs [0, 1]"],
    ),
    (
        "process_replicas_mismatch",
        _mut(
            lambda d: (
                _set("thinker", replicas=2, process="p")(d),
                _set("decode", process="p")(d),
            )
        ),
        ["stages[thinker].replicas", "equal replicas", "thinker=2", "decode=1"],
    ),
    (
        "env_bad_name",
        _mut(_set("decode", env={"A=B": "1"})),
        ["stages[decode].env: invalid variable name 'A=B'"],
    ),
    (
        "env_defaults_bad_name",
        {**demo(), "env_defaults": {"1X": "y"}},
        ["pipeline.env_defaults: invalid variable name '1X'"],
    ),
    (
        "runtime_overrides_unknown",
        {**demo(), "runtime_overrides": {"ghost": {"x": 1}}},
        ["pipeline.runtime_overrides[ghost]: unknown stage 'ghost'"],
    ),
    # fused_stages
    (
        "fused_single",
        {**demo(), "fused_stages": [["talker"]]},
        ["pipeline.fused_stages[0]: a fused group needs at least 2 stages"],
    ),
    (
        "fused_unknown",
        {**demo(), "fused_stages": [["talker", "ghost"]]},
        ["pipeline.fused_stages[0]: unknown stage 'ghost'"],
    ),
    (
        "fused_twice",
        {**demo(), "fused_stages": [["talker", "code2wav"], ["thinker", "talker"]]},
        ["pipeline.fused_stages[1]: stage 'talker' is already in fused_stages[0]"],
    ),
    (
        "fused_not_linked",
        {**demo(), "fused_stages": [["code2wav", "talker"]]},
        ["pipeline.fused_stages[0]: 'code2wav' -> 'talker' is not a next edge"],
    ),
    (
        "fused_fan_out",
        {**demo(), "fused_stages": [["thinker", "decode"]]},
        ["pipeline.fused_stages[0]: 'thinker' must route only to 'decode'"],
    ),
    (
        "fused_tp",
        _mut(
            lambda d: (
                _set("code2wav", gpu=[0, 1], tp_size=2)(d),
                d.update(fused_stages=[["talker", "code2wav"]]),
            )
        ),
        ["pipeline.fused_stages[0]: stage 'code2wav' has tp_size 2"],
    ),
    (
        "fused_spans_two_gpus",
        _mut(
            lambda d: (
                _set("talker", gpu=0)(d),
                _set("code2wav", gpu=1)(d),
                d.update(fused_stages=[["talker", "code2wav"]]),
            )
        ),
        ["stages[talker].process", "spans GPUs [0, 1]"],
    ),
    # dotted paths
    (
        "factory_bad_syntax",
        _mut(_set("decode", factory="not a path")),
        ["stages[decode].factory: invalid dotted path 'not a path'"],
    ),
    (
        "factory_import_error",
        _mut(_set("decode", factory="examples.x:y")),
        ["stages[decode].factory: cannot import 'examples.x:y': No module named 'examples.x'"],
    ),
    (
        "merge_fn_missing_attr",
        _mut(_set("mm_aggregate", merge_fn=f"{T}:no_such_fn")),
        ["stages[mm_aggregate].merge_fn", "has no attribute 'no_such_fn'"],
    ),
    (
        "route_fn_not_callable",
        _mut(_set("thinker", route_fn=f"{T}:NOT_CALLABLE")),
        ["stages[thinker].route_fn", "is not callable"],
    ),
    (
        "wait_for_fn_missing",
        _mut(_set("mm_aggregate", wait_for_fn="nonexistent_pkg_q.mod.fn")),
        ["stages[mm_aggregate].wait_for_fn: cannot import", "nonexistent_pkg_q"],
    ),
    (
        "stream_done_to_fn_missing",
        _mut(_set("thinker", stream_done_to_fn=f"{T}:nope")),
        ["stages[thinker].stream_done_to_fn", "has no attribute 'nope'"],
    ),
    (
        "project_payload_fn_missing",
        _mut(_set("thinker", project_payload={"decode": f"{T}:nope"})),
        ["stages[thinker].project_payload[decode]", "has no attribute 'nope'"],
    ),
    (
        "terminal_stages_fn_missing",
        {**demo(), "terminal_stages_fn": f"{T}:nope"},
        ["pipeline.terminal_stages_fn", "has no attribute 'nope'"],
    ),
]


@pytest.mark.parametrize(
    ("data", "expected"),
    [pytest.param(d, e, id=i) for i, d, e in BAD_CASES],
)
def test_semantic_rule(data: dict[str, Any], expected: list[str]) -> None:
    msg = str(config_error(data))
    for part in expected:
        assert part in msg, f"{part!r} not in:\n{msg}"


def test_demo_fixture_cases_start_valid() -> None:
    # Guards the table above: each mutation must be what breaks the config.
    PipelineConfig.from_dict(demo())


def test_resolve_false_skips_imports_but_checks_syntax() -> None:
    d = _mut(_set("decode", factory="examples.x:y"))
    PipelineConfig.from_dict(d, resolve=False)
    d = _mut(_set("decode", factory="bad path"))
    assert "invalid dotted path" in str(config_error(d, resolve=False))


def test_dotted_path_forms_accepted() -> None:
    d = _mut(_set("decode", factory=f"{T}.factory"))
    PipelineConfig.from_dict(d)


def test_all_errors_collected_one_per_line() -> None:
    d = demo()
    stage_of(d, "decode")["terminal"] = False
    stage_of(d, "talker")["next"] = ["code2wav", "ghost"]
    d["entry_stage"] = "foo"
    err = config_error(d)
    assert len(err.errors) >= 3
    lines = str(err).splitlines()
    assert lines == err.errors
    assert any(line.startswith("stages[decode].next:") for line in lines)
    assert any(line.startswith("stages[talker].next:") for line in lines)
    assert "pipeline.entry_stage: unknown stage 'foo'" in lines


def test_config_error_from_single_string() -> None:
    e = ConfigError("x: y")
    assert e.errors == ["x: y"]
    assert str(e) == "x: y"
    assert isinstance(e, ValueError)


def test_validate_function_directly() -> None:
    cfg = PipelineConfig.model_validate(pipe(st("a", next="a"), st("t", terminal=True)))
    with pytest.raises(ConfigError) as ei:
        validate(cfg, resolve=False)
    assert "stages[a].next" in str(ei.value)


def test_single_upstream_does_not_need_wait_for() -> None:
    PipelineConfig.from_dict(pipe(st("a", next="b"), st("b", terminal=True)))


def test_stream_only_target_is_reachable() -> None:
    d = pipe(
        st("a", next="t1", stream_to=["s"]),
        st("s", next="t2"),
        st("t1", terminal=True),
        st("t2", terminal=True),
    )
    cfg = PipelineConfig.from_dict(d)
    assert cfg.reachable_stages("a") == {"a", "s", "t1", "t2"}
    assert cfg.possible_stages_for(["t2"]) == {"a", "s", "t2"}


# -- structural (pydantic) errors are converted with the same locations ------------------

STRUCT_CASES: list[tuple[str, dict[str, Any], list[str]]] = [
    (
        "stage_unknown_field",
        _mut(_set("thinker", bogus=1)),
        ["stages[thinker].bogus: unknown field"],
    ),
    ("pipeline_unknown_field", {**demo(), "bogus": 1}, ["pipeline.bogus: unknown field"]),
    ("missing_factory", _mut(_set("thinker", factory=_DEL)), ["stages[thinker].factory: required"]),
    (
        "missing_name",
        pipe({"factory": F, "terminal": True}),
        ["stages[0].name: required"],
    ),
    (
        "invalid_name",
        pipe(st("a", next="t"), st("t", terminal=True), st("bad name", terminal=True)),
        ["stages[2].name: invalid name 'bad name'"],
    ),
    ("invalid_process", _mut(_set("thinker", process="a/b")), ["stages[thinker].process"]),
    ("replicas_zero", _mut(_set("thinker", replicas=0)), ["stages[thinker].replicas"]),
    (
        "torch_threads_zero",
        _mut(_set("thinker", torch_threads=0)),
        ["stages[thinker].torch_threads"],
    ),
    ("tp_size_zero", _mut(_set("thinker", tp_size=0)), ["stages[thinker].tp_size"]),
    ("gpu_negative", _mut(_set("thinker", gpu=-1)), ["stages[thinker].gpu: expected a GPU id"]),
    ("gpu_bool", _mut(_set("thinker", gpu=True)), ["stages[thinker].gpu: expected a GPU id"]),
    ("gpu_empty_list", _mut(_set("thinker", gpu=[])), ["stages[thinker].gpu"]),
    (
        "stage_relay_pool",
        _mut(_set("thinker", relay={"pool_mb": 0})),
        ["stages[thinker].relay.pool_mb"],
    ),
    (
        "stage_relay_unknown_field",
        _mut(_set("thinker", relay={"slot_size_mb": 1})),
        ["stages[thinker].relay.slot_size_mb: unknown field"],
    ),
    ("pipeline_relay_credits", {**demo(), "relay": {"credits": -1}}, ["pipeline.relay.credits"]),
    ("inline_negative", {**demo(), "relay": {"inline_bytes": -1}}, ["pipeline.relay.inline_bytes"]),
    (
        "relay_rank_out_of_range",
        {**demo(), "relay": {"rank": 2, "world_size": 2}},
        ["pipeline.relay: rank 2 must be < world_size 2"],
    ),
    ("empty_stages", {"stages": []}, ["pipeline.stages"]),
    ("missing_stages", {"name": "x"}, ["pipeline.stages: required"]),
    (
        "bad_transport",
        {**demo(), "endpoints": {"transport": "udp"}},
        ["pipeline.endpoints.transport"],
    ),
    ("timeout_zero", {**demo(), "default_timeout_s": 0}, ["pipeline.default_timeout_s"]),
    ("max_input_zero", {**demo(), "max_input_mb": 0}, ["pipeline.max_input_mb"]),
    ("abort_ack_zero", {**demo(), "abort_ack_timeout_s": 0}, ["pipeline.abort_ack_timeout_s"]),
    ("next_wrong_type", _mut(_set("talker", next=5)), ["stages[talker].next"]),
    (
        "factory_args_not_mapping",
        _mut(_set("talker", factory_args=[1])),
        ["stages[talker].factory_args"],
    ),
]


@pytest.mark.parametrize(
    ("data", "expected"),
    [pytest.param(d, e, id=i) for i, d, e in STRUCT_CASES],
)
def test_structural_error(data: dict[str, Any], expected: list[str]) -> None:
    msg = str(config_error(data))
    for part in expected:
        assert part in msg, f"{part!r} not in:\n{msg}"


def test_from_dict_rejects_non_mapping() -> None:
    assert "expected a mapping" in str(config_error(["x"]))


# -- loading ------------------------------------------------------------------------------


def test_load_yaml_fixture() -> None:
    cfg = load_pipeline(CONFIGS / "demo.yaml")
    assert cfg.name == "demo"
    assert cfg.source_dir == str(CONFIGS.resolve())
    assert cfg.relay.backend == "shm"
    assert cfg.stage("image_encoder").next == ["mm_aggregate"]
    assert cfg.relay_for("thinker").pool_mb == 64
    assert cfg.factory_args_for("thinker") == {"size": 3, "model_path": "/models/demo"}


def test_load_yaml_resolves_relative_to_source_dir() -> None:
    cfg = load_pipeline(str(CONFIGS / "local_helpers.yaml"))
    assert str(CONFIGS.resolve()) in sys.path
    made = dotted.resolve(cfg.stage("only").factory, cfg.source_dir)
    assert made() == {"model_path": None}


def test_load_py_fixture() -> None:
    cfg = load_pipeline(CONFIGS / "demo_pipeline.py")
    assert cfg.name == "py-demo"
    assert cfg.stage_names == ["a", "b"]
    assert cfg.source_dir == str(CONFIGS.resolve())


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_load_py_dict_and_builder(tmp_path: Path) -> None:
    p = _write(
        tmp_path,
        "as_dict.py",
        f"""
        pipeline = {{"name": "d", "stages": [{{"name": "a", "factory": "{F}", "terminal": True}}]}}
        """,
    )
    assert load_pipeline(p).name == "d"
    p = _write(
        tmp_path,
        "builder.py",
        f"""
        from omnirail.config import PipelineConfig, StageConfig

        def build_pipeline():
            stage = StageConfig(name="a", factory="{F}", terminal=True)
            return PipelineConfig(name="b", stages=[stage])
        """,
    )
    assert load_pipeline(p).name == "b"


def test_load_py_runs_semantic_validation(tmp_path: Path) -> None:
    p = _write(
        tmp_path,
        "bad.py",
        f"""
        pipeline = {{"stages": [{{"name": "a", "factory": "{F}", "next": "ghost"}}]}}
        """,
    )
    with pytest.raises(ConfigError) as ei:
        load_pipeline(p)
    assert "stages[a].next: unknown stage 'ghost'" in str(ei.value)
    assert ei.value.source == str(p)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("x = 1\n", "defines neither `pipeline` nor `build_pipeline()`"),
        ("pipeline = 3\n", "must be a PipelineConfig or a dict, got int"),
        ("raise RuntimeError('boom')\n", "error while loading: RuntimeError: boom"),
        (
            "from omnirail.config import StageConfig\n"
            "pipeline = StageConfig(name='a', factory='x.y', replicas=0)\n",
            "StageConfig.replicas",
        ),
    ],
)
def test_load_py_errors(tmp_path: Path, body: str, expected: str) -> None:
    p = _write(tmp_path, "cfg.py", body)
    with pytest.raises(ConfigError) as ei:
        load_pipeline(p)
    assert expected in str(ei.value)


def test_load_missing_file(tmp_path: Path) -> None:
    p = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as ei:
        load_pipeline(p)
    assert str(p) in str(ei.value)
    assert "no such file" in str(ei.value)


def test_load_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    p = _write(tmp_path, "bad.yaml", "stages:\n  - name: a\n    next: [b\n  - name: b\n")
    with pytest.raises(ConfigError) as ei:
        load_pipeline(p)
    msg = str(ei.value)
    assert msg.startswith(f"{p}:")
    assert "YAML syntax error" in msg
    line = int(msg[len(str(p)) + 1 :].split(":", 1)[0])
    assert 3 <= line <= 4


@pytest.mark.parametrize("text", ["", "- a\n- b\n", "just a string\n"])
def test_load_yaml_must_be_mapping(tmp_path: Path, text: str) -> None:
    p = _write(tmp_path, "x.yml", text)
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_pipeline(p)


def test_load_unsupported_suffix(tmp_path: Path) -> None:
    p = _write(tmp_path, "x.json", "{}")
    with pytest.raises(ConfigError, match="unsupported config type"):
        load_pipeline(p)


def test_load_yaml_validation_error_sets_source(tmp_path: Path) -> None:
    p = _write(tmp_path, "x.yaml", f"stages:\n  - name: a\n    factory: {F}\n    bogus: 1\n")
    with pytest.raises(ConfigError) as ei:
        load_pipeline(p)
    assert "stages[a].bogus: unknown field" in ei.value.errors
    assert ei.value.source == str(p)


def test_source_dir_is_private() -> None:
    cfg = PipelineConfig.from_dict(pipe(st("a", terminal=True)), source_dir="/tmp/x")
    assert cfg.source_dir == "/tmp/x"
    assert "source_dir" not in cfg.model_dump()
    assert "source_dir" not in PipelineConfig.model_json_schema()["properties"]
    assert cfg.model_copy().source_dir == "/tmp/x"


def test_import_without_torch() -> None:
    code = "import sys, omnirail.config; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


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
    assert "    route_fn: tests.unit.test_config:route" in text
    assert "    stream_to: talker" in text
    assert "    wait_for: preprocessing, image_encoder, audio_encoder" in text
    assert "    terminal: yes" in text


def test_load_py_with_dataclass(tmp_path: Path) -> None:
    # Dataclasses look their module up in sys.modules while the file executes.
    p = _write(
        tmp_path,
        "with_dc.py",
        f"""
        from dataclasses import dataclass

        @dataclass
        class Opts:
            size: int = 1

        pipeline = {{"stages": [{{"name": "a", "factory": "{F}", "terminal": True,
                                  "factory_args": {{"size": Opts().size}}}}]}}
        """,
    )
    assert load_pipeline(p).stage("a").factory_args == {"size": 1}
