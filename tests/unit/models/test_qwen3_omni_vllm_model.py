"""What the vLLM thinker gives vLLM (no engine needed): a thinker-only view of the checkpoint,
and the thinker factory's choice of engine, refused by name when wrong."""

from __future__ import annotations

import json

import pytest

from omnirail.models.qwen3_omni import vllm_model
from omnirail.models.qwen3_omni.stages import create_thinker
from omnirail.models.qwen3_omni.weights import read_config, weight_map


def test_the_view_holds_the_text_config_and_only_the_thinkers_text_shards(tiny_dir, tmp_path):
    view = vllm_model.write_model_view(tiny_dir, tmp_path / "view")
    config = json.loads((view / "config.json").read_text())
    text = read_config(tiny_dir).thinker_config.text_config
    assert config["model_type"] == "qwen3_moe"
    assert config["architectures"] == [vllm_model.ARCHITECTURE]
    assert config["hidden_size"] == text.hidden_size and config["head_dim"] == 32
    assert config["rope_parameters"]["mrope_section"] == text.rope_parameters["mrope_section"]
    index = json.loads((view / "model.safetensors.index.json").read_text())["weight_map"]
    assert index and all(k.startswith(("thinker.model.", "thinker.lm_head.")) for k in index)
    everything = weight_map(tiny_dir)
    assert set(index) == {
        k for k in everything if k.startswith(("thinker.model.", "thinker.lm_head."))
    }
    for shard in set(index.values()):
        assert (view / shard).resolve() == (tiny_dir / shard).resolve()
    # Written again over itself: the same view.
    assert vllm_model.write_model_view(tiny_dir, view) == view


def test_a_media_prompt_indexes_its_media_and_image_rows():
    import torch

    media = torch.tensor([False, True, True, False, True])
    visual = torch.tensor([False, True, True, False, False])
    prompt = vllm_model.MediaPrompt(
        embeds=torch.zeros(5, 4),
        positions=torch.zeros(3, 5, dtype=torch.long),
        delta=-2,
        visual=visual,
        deepstack=[torch.zeros(2, 4)],
        media=media,
        accept_layer=1,
    )
    assert prompt.media_index[media].tolist() == [0, 1, 2]
    assert prompt.visual_index[visual].tolist() == [0, 1]
    assert prompt.accept.shape == (3, 4)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"engine": "tensorrt"}, r"stages\[thinker\]\.factory_args\.engine: native or vllm"),
        ({"kv_cache_gib": 1}, r"stages\[thinker\]\.factory_args\.kv_cache_gib: an engine option"),
    ],
)
def test_the_thinker_engine_is_checked_by_name(tiny_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        create_thinker(str(tiny_dir), **kwargs)


def test_the_vllm_thinker_keeps_its_engine_in_process(tiny_dir):
    with pytest.raises(ValueError, match=r"stages\[thinker\]\.factory_args\.engine_process: "):
        create_thinker(str(tiny_dir), engine="vllm", engine_process=True)
