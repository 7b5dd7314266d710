"""The docs' generated reference (docs/hooks/reference.py): every config field described,
and what the code declares appears in the reference without editing a page."""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest
from pydantic import BaseModel, Field

from omnirail.config import PipelineConfig, RestartConfig, StageConfig
from omnirail.config.api import ApiConfig, InputSpec, OpenAIConfig, OutputSpec
from omnirail.config.models import EndpointsConfig, MetricsConfig, RelayConfig, StreamConfig
from omnirail.config.security import SecurityConfig, TLSConfig
from omnirail.relay import registry

DOCS = Path(__file__).parents[3] / "docs"


@pytest.fixture(scope="module")
def ref() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "omnirail_docs_reference", DOCS / "hooks/reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reference_covers_every_config_model(ref: ModuleType) -> None:
    models = ref.config_models()
    named = {
        PipelineConfig, StageConfig, RelayConfig, StreamConfig, RestartConfig, EndpointsConfig,
        MetricsConfig, SecurityConfig, TLSConfig, ApiConfig, InputSpec, OutputSpec, OpenAIConfig,
    }  # fmt: skip
    assert named <= set(models)
    assert {b.options for b in registry.BACKENDS.values()} <= set(models)


def test_every_config_field_has_a_description(ref: ModuleType) -> None:
    assert ref.missing_descriptions(ref.config_models()) == []


def test_a_field_without_a_description_is_reported(ref: ModuleType) -> None:
    class Bare(BaseModel):
        described: int = Field(1, description="says what it is")
        bare: int = 2

    assert ref.missing_descriptions([Bare]) == ["Bare.bare"]


def test_every_field_is_in_the_generated_reference(ref: ModuleType) -> None:
    text = ref.config_reference()
    for model in ref.config_models():
        assert f"{{ #{model.__name__.lower()} }}" in text
        section = text.split(f"{{ #{model.__name__.lower()} }}", 1)[1].split("\n#", 1)[0]
        for name, field in model.model_fields.items():
            assert f"| `{name}` |" in section, (model.__name__, name)
            assert ref.cell(field.description) in section, (model.__name__, name)


def test_a_field_added_to_a_model_appears_without_editing_a_doc(ref: ModuleType) -> None:
    class NewStage(StageConfig):
        warmup_requests: int = Field(
            3, ge=0, le=100, description="Requests the stage runs before it serves."
        )

    class NewPipeline(PipelineConfig):
        stages: list[NewStage] = Field(min_length=1, description="The stages.")

    text = ref.config_reference(NewPipeline)
    row = next(line for line in text.splitlines() if line.startswith("| `warmup_requests` |"))
    assert row == (
        "| `warmup_requests` | `int` | `3` | ≥ 0, ≤ 100 | "
        "Requests the stage runs before it serves. |"
    )
    assert "### NewStage { #newstage }" in text
    assert "[NewStage](#newstage)" in text  # linked from the pipeline's `stages`


def test_types_defaults_and_bounds_read_as_in_yaml(ref: ModuleType) -> None:
    fields = StageConfig.model_fields
    assert ref.type_name(fields["gpu"].annotation) == "int | list[int] | None"
    assert ref.type_name(PipelineConfig.model_fields["balance"].annotation) == (
        '"least_outstanding" | "round_robin" | "request_id"'
    )
    assert ref.default_text(fields["name"]) == "required"
    assert ref.default_text(fields["terminal"]) == "`false`"
    assert ref.default_text(fields["process"]) == "unset"
    assert ref.default_text(fields["stream_to"]) == "`[]`"
    assert ref.default_text(PipelineConfig.model_fields["relay"]) == "its fields' defaults"
    assert ref.bounds_text(fields["replicas"]) == "≥ 1, ≤ 1024"
    assert "matches" in ref.bounds_text(SecurityConfig.model_fields["tokens_env"])


def test_cells_escape_table_syntax_outside_code(ref: ModuleType) -> None:
    assert ref.cell("a | b <x> `c | <d>`") == "a \\| b &lt;x&gt; `c | <d>`"


def test_the_cli_reference_lists_every_command_and_flag(ref: ModuleType) -> None:
    from omnirail.cli.commands import build_parser

    parser = build_parser()
    text = ref.cli_reference(parser)
    for name, sub in ref._subparsers(parser):
        section = text.split(f"## `omnirail {name}`\n", 1)[1].split("\n## ", 1)[0]
        for action in sub._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert re.search(rf"\| `[^`]*{flag}\b", section), (name, flag)


def test_a_flag_added_to_a_parser_appears_without_editing_a_doc(ref: ModuleType) -> None:
    parser = argparse.ArgumentParser(prog="omnirail")
    sub = parser.add_subparsers(dest="command")
    up = sub.add_parser("up", help="start a mesh")
    up.add_argument("file")
    up.add_argument("--warm", type=int, default=2, metavar="N", help="warm-up requests")
    text = ref.cli_reference(parser)
    assert "| `--warm N` |  | `2` | warm-up requests |" in text
    assert "| [`up`](#omnirail-up) | start a mesh |" in text
