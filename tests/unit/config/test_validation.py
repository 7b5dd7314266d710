"""validate(): every semantic and structural rule names the stage and the field."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from omnirail.config import (
    ConfigError,
    PipelineConfig,
    validate,
)
from tests.unit.config.helpers import (
    F,
    T,
    config_error,
    demo,
    pipe,
    st,
    stage_of,
)

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
        "tp_with_one_gpu",
        _mut(_set("thinker", gpu=0, tp_size=2)),
        ["stages[thinker].gpu: tp_size 2 needs a list of 2 GPU ids, one per rank"],
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
    # Fault handling (coordinator/failover.py, omnirail/ops/supervise.py).
    ("liveness_too_short", {**demo(), "liveness_s": 1}, ["pipeline.liveness_s"]),
    ("liveness_not_number", {**demo(), "liveness_s": "soon"}, ["pipeline.liveness_s"]),
    (
        "redispatch_negative",
        {**demo(), "redispatch_attempts": -1},
        ["pipeline.redispatch_attempts"],
    ),
    ("redispatch_huge", {**demo(), "redispatch_attempts": 11}, ["pipeline.redispatch_attempts"]),
    (
        "retry_safe_not_bool",
        _mut(_set("talker", retry_safe="maybe")),
        ["stages[talker].retry_safe"],
    ),
    (
        "restart_max_negative",
        _mut(_set("talker", restart={"max": -1})),
        ["stages[talker].restart.max"],
    ),
    ("drain_negative", {**demo(), "drain_s": -1}, ["pipeline.drain_s"]),
    ("max_queue_zero", _mut(_set("talker", max_queue=0)), ["stages[talker].max_queue"]),
    ("max_live_zero", {**demo(), "max_live_requests": 0}, ["pipeline.max_live_requests"]),
    ("balance_unknown", {**demo(), "balance": "random"}, ["pipeline.balance"]),
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
