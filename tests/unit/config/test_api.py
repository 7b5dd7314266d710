"""`api:`: the front doors' declarations load, and every bad one names its place."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from omnirail.config import ConfigError, PipelineConfig, load_pipeline, validate
from omnirail.config.api import ApiConfig, TensorSpec, api_problems, pick
from omnirail.wire.errors import Code, OmniError
from tests.unit.config.helpers import config_error, pipe, st

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = [
    "examples/quickstart",
    "examples/omni_demo",
    "omnirail/models/omni_demo",
    "omnirail/models/qwen3_omni",
]


def _pipe(api: dict[str, Any], **kw: Any) -> dict[str, Any]:
    """Two stages, `b` the only terminal one, with the given `api:` section."""
    return pipe(st("a", next="b"), st("b", terminal=True), api=api, **kw)


def _in(name: str, datatype: str = "BYTES", shape: list[int] | None = None, **kw: Any) -> dict:
    return {"name": name, "datatype": datatype, "shape": [1] if shape is None else shape, **kw}


def _out(name: str, datatype: str = "BYTES", stage: str = "b", **kw: Any) -> dict[str, Any]:
    return {"name": name, "datatype": datatype, "shape": [1], "stage": stage, "result": ".", **kw}


def _openai_api(**openai: Any) -> dict[str, Any]:
    base = {"text_input": "text", "text_output": "text"}
    return {
        "inputs": [_in("text"), _in("speak", "BOOL", optional=True)],
        "outputs": [_out("text"), _out("audio", "FP32", shape=[-1])],
        "openai": {**base, **openai},
    }


def _error(api: dict[str, Any]) -> str:
    return str(config_error(_pipe(api)))


# -- valid declarations ----------------------------------------------------------------------


@pytest.mark.parametrize("example", EXAMPLES)
def test_example_pipelines_load_their_api(example: str) -> None:
    cfg = load_pipeline(ROOT / example / "pipeline.yaml", resolve=False)
    assert cfg.api.inputs and cfg.api.outputs
    assert api_problems(cfg.api, set(cfg.terminal_stages)) == []


def test_omni_demo_api_is_typed() -> None:
    api = load_pipeline(ROOT / "omnirail/models/omni_demo/pipeline.yaml").api
    assert api.openai is not None and api.openai.text_input == "text"
    image = api.input("image")
    assert image is not None and image.datatype == "UINT8" and image.shape == [-1, -1, 3]
    assert api.input("text").scalar and not image.scalar  # type: ignore[union-attr]
    assert api.output("audio").chunks == "pcm"  # type: ignore[union-attr]
    assert api.input("nope") is None and api.output("nope") is None


def test_qwen3_api_passes_messages() -> None:
    api = load_pipeline(ROOT / "omnirail/models/qwen3_omni/pipeline.yaml", resolve=False).api
    assert api.openai is not None
    assert api.openai.messages_input == "messages" and api.openai.text_input is None
    assert api.input("messages").format == "json"  # type: ignore[union-attr]


def test_no_api_section_is_empty() -> None:
    cfg = PipelineConfig.from_dict(pipe(st("a", terminal=True)))
    assert cfg.api == ApiConfig() and cfg.api.openai is None


def test_openai_defaults() -> None:
    cfg = PipelineConfig.from_dict(_pipe(_openai_api()))
    oa = cfg.api.openai
    assert oa is not None
    assert (oa.sample_rate, oa.input_sample_rate) == (16000, 16000)
    assert oa.voices == {"default": {}} and oa.speech_template == "{input}"


# -- model_name --------------------------------------------------------------------------------


def test_model_name_prefers_api_model() -> None:
    cfg = PipelineConfig.from_dict(_pipe({"model": "served"}, name="pipe-name"))
    assert cfg.model_name == "served"


def test_model_name_defaults_to_pipeline_name() -> None:
    assert PipelineConfig.from_dict(_pipe({}, name="pipe-name")).model_name == "pipe-name"


@pytest.mark.parametrize("path", ["/models/X", "/models/X/"])
def test_model_name_from_model_path_is_its_last_part(path: str) -> None:
    assert PipelineConfig.from_dict(_pipe({}, model_path=path)).model_name == "X"


def test_model_name_without_name_or_path() -> None:
    assert PipelineConfig.from_dict(_pipe({})).model_name == "pipeline"


def test_api_model_must_be_a_name() -> None:
    assert "pipeline.api.model: invalid model name '/models/x'" in _error({"model": "/models/x"})


# -- tensor specs ------------------------------------------------------------------------------


def test_negative_dimension_other_than_minus_one() -> None:
    text = _error({"inputs": [_in("t", shape=[-2])]})
    assert "pipeline.api.inputs[0].shape: dimensions are -1 (any) or a size >= 0, got -2" in text


def test_empty_shape() -> None:
    assert "pipeline.api.inputs[0].shape" in _error({"inputs": [_in("t", shape=[])]})


def test_too_many_dims() -> None:
    assert "pipeline.api.inputs[0].shape" in _error({"inputs": [_in("t", shape=[1] * 9)]})


def test_format_on_non_bytes_tensor() -> None:
    text = _error({"inputs": [_in("n", "INT64", format="json")]})
    assert "pipeline.api.inputs[0]: format: only BYTES tensors have one, not INT64" in text


def test_format_text_explicit_on_non_bytes_is_refused_too() -> None:
    with pytest.raises(ValueError, match="only BYTES"):
        TensorSpec.model_validate(_in("n", "FP32", format="text"))


def test_bad_tensor_name() -> None:
    assert "pipeline.api.inputs[0].name: " in _error({"inputs": [_in("bad name")]})


def test_unknown_datatype() -> None:
    assert "pipeline.api.inputs[0].datatype" in _error({"inputs": [_in("t", "STRING")]})


def test_unknown_field_is_refused() -> None:
    assert "pipeline.api.inputs[0].dims" in _error({"inputs": [_in("t", dims=[1])]})


def test_output_with_neither_result_nor_chunks() -> None:
    spec = {"name": "t", "datatype": "BYTES", "shape": [1], "stage": "b"}
    text = _error({"outputs": [spec]})
    assert "pipeline.api.outputs[0]: set result: FIELD and/or chunks: FIELD" in text


def test_output_with_chunks_only_is_fine() -> None:
    spec = {"name": "t", "datatype": "FP32", "shape": [-1], "stage": "b", "chunks": "pcm"}
    assert PipelineConfig.from_dict(_pipe({"outputs": [spec]})).api.outputs[0].result is None


# -- cross-field rules ----------------------------------------------------------------------


def test_output_from_non_terminal_stage() -> None:
    text = _error({"outputs": [_out("x", stage="a")]})
    assert "pipeline.api.outputs[x].stage: 'a' is not a terminal stage (terminal: ['b'])" in text


def test_output_from_unknown_stage() -> None:
    assert "pipeline.api.outputs[x].stage: 'zz' is not a terminal" in _error(
        {"outputs": [_out("x", stage="zz")]}
    )


def test_duplicate_input_name() -> None:
    text = _error({"inputs": [_in("t"), _in("t", "INT64")]})
    assert "pipeline.api.inputs[t]: duplicate name" in text


def test_duplicate_output_name() -> None:
    assert "pipeline.api.outputs[o]: duplicate name" in _error({"outputs": [_out("o"), _out("o")]})


def test_same_name_for_an_input_and_an_output_is_fine() -> None:
    PipelineConfig.from_dict(_pipe({"inputs": [_in("text")], "outputs": [_out("text")]}))


def test_both_messages_and_text_input() -> None:
    text = _error(_openai_api(messages_input="text"))
    assert "pipeline.api.openai: set exactly one of messages_input and text_input" in text


def test_neither_messages_nor_text_input() -> None:
    text = _error(_openai_api(text_input=None))
    assert "pipeline.api.openai: set exactly one of messages_input and text_input" in text


@pytest.mark.parametrize(
    "field",
    ["text_input", "image_input", "audio_input", "max_tokens_input", "seed_input",
     "temperature_input", "speak_input"],
)  # fmt: skip
def test_openai_input_must_be_declared(field: str) -> None:
    text = _error(_openai_api(**{field: "ghost"}))
    assert f"pipeline.api.openai.{field}: 'ghost' is not one of api.inputs" in text


def test_openai_messages_input_must_be_declared() -> None:
    text = _error(_openai_api(text_input=None, messages_input="ghost"))
    assert "pipeline.api.openai.messages_input: 'ghost' is not one of api.inputs" in text


@pytest.mark.parametrize("field", ["text_output", "audio_output"])
def test_openai_output_must_be_declared(field: str) -> None:
    text = _error(_openai_api(**{field: "ghost"}))
    assert f"pipeline.api.openai.{field}: 'ghost' is not one of api.outputs" in text


def test_openai_without_any_output() -> None:
    text = _error(_openai_api(text_output=None))
    assert "pipeline.api.openai: set text_output and/or audio_output" in text


def test_text_output_must_be_bytes() -> None:
    text = _error(_openai_api(text_output="audio"))
    assert "pipeline.api.openai.text_output: audio must be BYTES" in text


@pytest.mark.parametrize("datatype", ["BYTES", "INT32", "UINT8", "BOOL"])
def test_audio_output_of_wrong_datatype(datatype: str) -> None:
    api = _openai_api(audio_output="pcm")
    api["outputs"].append(_out("pcm", datatype, shape=[-1]))
    text = _error(api)
    assert "pipeline.api.openai.audio_output: pcm must be FP32/FP16/FP64 PCM" in text
    assert f"not {datatype}" in text


@pytest.mark.parametrize("datatype", ["FP32", "FP16", "FP64", "INT16"])
def test_audio_output_pcm_datatypes(datatype: str) -> None:
    api = _openai_api(audio_output="pcm")
    api["outputs"].append(_out("pcm", datatype, shape=[-1]))
    assert PipelineConfig.from_dict(_pipe(api)).api.openai.audio_output == "pcm"  # type: ignore


def test_voices_naming_unknown_inputs() -> None:
    text = _error(_openai_api(voices={"alto": {"speak": True}, "bass": {"pitch": 1}}))
    assert "pipeline.api.openai.voices['bass']: 'pitch' is not one of api.inputs" in text
    assert "voices['alto']" not in text


def test_voices_must_not_be_empty() -> None:
    assert "pipeline.api.openai: voices: at least one" in _error(_openai_api(voices={}))


def test_speech_template_needs_input() -> None:
    text = _error(_openai_api(speech_template="say it"))
    assert "pipeline.api.openai: speech_template: must contain {input}" in text


@pytest.mark.parametrize("rate", [0, -1, 384001])
def test_sample_rate_bounds(rate: int) -> None:
    assert "pipeline.api.openai.sample_rate" in _error(_openai_api(sample_rate=rate))


def test_qwen3_declares_the_realtime_api() -> None:
    api = load_pipeline(ROOT / "omnirail/models/qwen3_omni/pipeline.yaml", resolve=False).api
    assert api.openai is not None and api.openai.realtime is not None
    assert api.openai.realtime.max_sessions == 16
    assert (api.openai.text_output, api.openai.audio_output) == ("text", "audio")


def _realtime_api(realtime: Any, **openai: Any) -> dict[str, Any]:
    api = _openai_api(**{"audio_output": "audio", "realtime": realtime, **openai})
    api["inputs"].append(_in("messages", format="json", optional=True))
    return api


def test_realtime_defaults() -> None:
    cfg = PipelineConfig.from_dict(
        _pipe(_realtime_api({}, text_input=None, messages_input="messages"))
    )
    assert cfg.api.openai is not None and cfg.api.openai.realtime is not None
    realtime = cfg.api.openai.realtime
    assert (realtime.max_sessions, realtime.max_items) == (16, 512)
    assert (realtime.max_buffer_s, realtime.max_audio_s) == (120.0, 1800.0)


def test_realtime_needs_the_conversation_as_messages() -> None:
    text = _error(_realtime_api({}))
    assert "pipeline.api.openai.realtime: needs openai.messages_input" in text


def test_realtime_needs_text_and_audio_out() -> None:
    text = _error(_realtime_api({}, text_input=None, messages_input="messages", audio_output=None))
    assert "pipeline.api.openai.realtime: needs openai.audio_output" in text


@pytest.mark.parametrize(
    ("realtime", "where"),
    [
        ({"max_sessions": 0}, "pipeline.api.openai.realtime.max_sessions"),
        ({"max_items": 1}, "pipeline.api.openai.realtime.max_items"),
        ({"max_buffer_s": 0}, "pipeline.api.openai.realtime.max_buffer_s"),
        ({"max_audio_s": "long"}, "pipeline.api.openai.realtime.max_audio_s"),
        ({"vad": "silero"}, "pipeline.api.openai.realtime.vad"),
        ("yes", "pipeline.api.openai.realtime"),
    ],
)
def test_realtime_fields_are_checked_by_name(realtime: Any, where: str) -> None:
    assert where in _error(_realtime_api(realtime, text_input=None, messages_input="messages"))


def test_every_problem_is_listed() -> None:
    api = _openai_api(seed_input="ghost", audio_output="nothing")
    api["outputs"].append(_out("late", stage="a"))
    errors = config_error(_pipe(api)).errors
    assert any("openai.seed_input" in e for e in errors)
    assert any("openai.audio_output" in e for e in errors)
    assert any("outputs[late].stage" in e for e in errors)


def test_validate_runs_api_problems() -> None:
    cfg = PipelineConfig.from_dict(_pipe({"outputs": [_out("x")]}))
    cfg.api = ApiConfig.model_validate({"outputs": [_out("x", stage="a")]})
    with pytest.raises(ConfigError, match=r"pipeline\.api\.outputs\[x\]\.stage"):
        validate(cfg, resolve=False)


# -- pick ----------------------------------------------------------------------------------------


def test_pick_whole_value() -> None:
    value = object()
    assert pick(value, ".", "here") is value


def test_pick_field() -> None:
    assert pick({"text": "hi", "n": 1}, "text", "here") == "hi"


def test_pick_missing_field_is_internal() -> None:
    with pytest.raises(OmniError) as ei:
        pick({"b": 1, "a": 2}, "text", "output 'x'")
    assert ei.value.code == Code.INTERNAL
    assert "output 'x': has no field 'text' (got ['a', 'b'])" in ei.value.message


def test_pick_from_non_mapping_names_its_type() -> None:
    with pytest.raises(OmniError, match="got list"):
        pick([1, 2], "text", "here")
