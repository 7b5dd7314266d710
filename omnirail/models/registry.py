"""Which installed pipeline serves a checkpoint: the registry behind `omnirail serve`.

A Hugging Face checkpoint directory names its model in `config.json`: `architectures`
(e.g. ``Qwen3OmniMoeForConditionalGeneration``) and `model_type`. Each installed model
pipeline declares which it serves; `pipeline_for(MODEL_DIR)` checks the directory (a
config.json that parses, every weight shard its index names) and picks the pipeline, or
raises `CheckpointError` naming the file and what is supported. Reading a checkpoint here
loads no weights and imports neither torch nor transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any


class CheckpointError(ValueError):
    """A model directory that cannot be served: the message names the file."""


@dataclass(frozen=True)
class ModelPipeline:
    """An installed model pipeline and the checkpoints it serves."""

    name: str  # what users call it ("qwen3-omni")
    package: str  # where its code and pipeline.yaml live
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    # The pip extra its code needs, for the error when it is missing.
    extra: str = "hf"

    @property
    def pipeline_file(self) -> Path:
        return Path(str(resources.files(self.package) / "pipeline.yaml"))

    def describe(self) -> str:
        return f"{self.name} ({', '.join(self.architectures)}; model_type {self.model_types[0]})"


MODELS: tuple[ModelPipeline, ...] = (
    ModelPipeline(
        "qwen3-omni",
        "omnirail.models.qwen3_omni",
        ("Qwen3OmniMoeForConditionalGeneration",),
        ("qwen3_omni_moe",),
    ),
)


def supported() -> str:
    """The served models, for error messages."""
    return "; ".join(m.describe() for m in MODELS)


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """The checkpoint's config.json, checked to be one."""
    folder = Path(model_dir)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a directory (expected a checkpoint directory)")
    path = folder / "config.json"
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise CheckpointError(
            f"{path}: not found; a checkpoint directory holds config.json, the weights "
            f"and the tokenizer files. Supported models: {supported()}"
        ) from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def check_weights(model_dir: str | Path) -> None:
    """Every safetensors shard the checkpoint's index names is there (or, without an
    index, one `model.safetensors`)."""
    folder = Path(model_dir)
    index = folder / "model.safetensors.index.json"
    if not index.exists():
        if not (folder / "model.safetensors").is_file():
            raise CheckpointError(
                f"{folder}: no weights (neither model.safetensors.index.json nor model.safetensors)"
            )
        return
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{index}: not a safetensors index ({exc})") from None
    for shard in shards:
        if not isinstance(shard, str) or not (folder / shard).is_file():
            raise CheckpointError(f"{folder / str(shard)}: missing (named by {index.name})")


def pipeline_for(model_dir: str | Path) -> ModelPipeline:
    """The installed pipeline that serves the checkpoint in `model_dir`."""
    config = read_config(model_dir)
    architectures = config.get("architectures") or []
    model_type = config.get("model_type")
    if not isinstance(architectures, list):
        architectures = [architectures]
    found = next((m for m in MODELS if set(m.architectures) & set(map(str, architectures))), None)
    if found is None:
        found = next((m for m in MODELS if model_type in m.model_types), None)
    if found is None:
        raise CheckpointError(
            f"{Path(model_dir) / 'config.json'}: architectures {architectures} (model_type "
            f"{model_type!r}) have no installed pipeline; supported: {supported()}"
        )
    check_weights(model_dir)
    return found


def by_name(name: str) -> ModelPipeline:
    """An installed pipeline by its name ("qwen3-omni")."""
    for model in MODELS:
        if model.name == name:
            return model
    raise ValueError(f"no installed model pipeline {name!r}; installed: {supported()}")
