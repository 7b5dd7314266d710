"""The registry behind `omnirail serve`: which installed pipeline serves a checkpoint, and
a precise refusal naming the file for a directory it cannot serve."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omnirail.models.registry import MODELS, CheckpointError, by_name, pipeline_for

QWEN = "Qwen3OmniMoeForConditionalGeneration"


def checkpoint(folder: Path, config: object, shards: int = 2) -> Path:
    """A checkpoint's files without weights worth loading: config.json and a sharded index."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {f"w{i}": name for i, name in enumerate(names)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for name in names:
        (folder / name).write_bytes(b"")
    return folder


def test_the_architecture_picks_the_installed_pipeline(tmp_path: Path) -> None:
    model = pipeline_for(checkpoint(tmp_path, {"architectures": [QWEN]}))
    assert model.name == "qwen3-omni" and model.package == "omnirail.models.qwen3_omni"
    assert model.pipeline_file.is_file() and model.pipeline_file.name == "pipeline.yaml"
    # model_type alone is enough (some exports leave architectures out).
    other = checkpoint(tmp_path / "t", {"model_type": "qwen3_omni_moe"})
    assert pipeline_for(other) is model
    assert by_name("qwen3-omni") is model and MODELS == (model,)


def test_an_unknown_architecture_names_the_file_and_what_is_supported(tmp_path: Path) -> None:
    folder = checkpoint(tmp_path, {"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    with pytest.raises(CheckpointError) as err:
        pipeline_for(folder)
    message = str(err.value)
    assert message.startswith(f"{folder / 'config.json'}: architectures ['LlamaForCausalLM']")
    assert f"supported: qwen3-omni ({QWEN}; model_type qwen3_omni_moe)" in message


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (lambda d: d, "config.json: not found; a checkpoint directory holds config.json"),
        (lambda d: (d / "config.json").write_text("{nope"), "config.json: not valid JSON"),
        (lambda d: (d / "config.json").write_text("[1]"), "config.json: expected a JSON object"),
    ],
)
def test_a_directory_that_is_not_a_checkpoint_is_refused(tmp_path, make, problem) -> None:
    make(tmp_path)
    with pytest.raises(CheckpointError, match=problem.replace("(", r"\(")):
        pipeline_for(tmp_path)


def test_a_path_that_is_no_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not a directory"):
        pipeline_for(tmp_path / "missing")


def test_a_missing_shard_is_named(tmp_path: Path) -> None:
    folder = checkpoint(tmp_path, {"architectures": [QWEN]}, shards=3)
    (folder / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError) as err:
        pipeline_for(folder)
    assert str(err.value) == (
        f"{folder / 'model-00002-of-00003.safetensors'}: missing (named by "
        "model.safetensors.index.json)"
    )


def test_weights_without_an_index_are_one_file(tmp_path: Path) -> None:
    folder = checkpoint(tmp_path, {"architectures": [QWEN]})
    (folder / "model.safetensors.index.json").unlink()
    with pytest.raises(CheckpointError, match="no weights"):
        pipeline_for(folder)
    (folder / "model.safetensors").write_bytes(b"")
    assert pipeline_for(folder).name == "qwen3-omni"


def test_by_name_lists_what_is_installed() -> None:
    with pytest.raises(ValueError, match="no installed model pipeline 'x'; installed: qwen3"):
        by_name("x")
