"""Qwen3-Omni's thinker text model as a vLLM model, for the vLLM thinker (`vllm_thinker.py`).

vLLM's own Qwen3-Omni class cannot be imported here: its module imports transformers' Qwen2-VL
image processor, which needs torchvision, whose PyPI build does not run beside torch's CPU
build. It would also load and run the encoders, which run in stages of their own. What the
thinker stage needs from vLLM is the text model: MoE decoder layers with Qwen3-Omni's
interleaved multimodal rope, and the LM head. That is vLLM's `Qwen3MoeForCausalLM` (same
layers, same fused MoE) given:

- the thinker's text config as a `qwen3_moe` config (`write_model_view`: a directory holding
  that config.json and links to the checkpoint's shards, so vLLM never reads the encoders',
  talker's or vocoder's configs), and the weights under `thinker.model.` / `thinker.lm_head.`
  (`load_weights` renames them and skips the rest);
- M-RoPE positions (`get_mrope_input_positions`): the three rows equal the text position for
  a prompt without media, where interleaved M-RoPE is the ordinary rope.

Registered with vLLM under `ARCHITECTURE` (`register`) before the engine is built.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

ARCHITECTURE = "OmnirailQwen3OmniThinkerText"
_PREFIXES = (("thinker.model.", "model."), ("thinker.lm_head.", "lm_head."))


def register() -> None:
    """Makes `ARCHITECTURE` known to vLLM's model registry (idempotent)."""
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, _model_class())


def write_model_view(model_path: str | Path, view: str | Path) -> Path:
    """A directory vLLM loads as the thinker's text model: config.json (the thinker's text
    config, `model_type: qwen3_moe`, `architectures: [ARCHITECTURE]`), an index naming only
    the shards that hold `thinker.model.` and `thinker.lm_head.` tensors, and links to those
    shards. Returns `view`."""
    from .weights import read_config, weight_map

    model_path, view = Path(model_path), Path(view)
    view.mkdir(parents=True, exist_ok=True)
    config = read_config(model_path)
    text = config.thinker_config.text_config.to_dict()
    text.update(model_type="qwen3_moe", architectures=[ARCHITECTURE])
    text.pop("transformers_version", None)
    (view / "config.json").write_text(json.dumps(text, indent=2, sort_keys=True))
    files = weight_map(model_path)
    kept = {k: f for k, f in files.items() if k.startswith(tuple(p for p, _ in _PREFIXES))}
    (view / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": kept}, indent=2, sort_keys=True)
    )
    for shard in sorted(set(kept.values())):
        link = view / shard
        if not link.exists():
            os.symlink((model_path / shard).resolve(), link)
    return view


def _model_class() -> type:
    from vllm.model_executor.models.interfaces import SupportsMRoPE
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

    global _CLASS
    if _CLASS is not None:
        return _CLASS

    class OmnirailQwen3OmniThinkerText(Qwen3MoeForCausalLM, SupportsMRoPE):
        """vLLM's Qwen3-MoE on the thinker's text weights, with M-RoPE positions."""

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            def text_only() -> Iterable[tuple[str, torch.Tensor]]:
                for name, tensor in weights:
                    for prefix, ours in _PREFIXES:
                        if name.startswith(prefix):
                            yield ours + name[len(prefix) :], tensor
                            break

            return super().load_weights(text_only())

        def get_mrope_input_positions(
            self, input_tokens: list[int], mm_features: list[Any]
        ) -> tuple[torch.Tensor, int]:
            if mm_features:
                raise ValueError("the vLLM thinker takes prompts without media for now")
            n = len(input_tokens)
            return torch.arange(n, dtype=torch.long).expand(3, n).clone(), 0

    _CLASS = OmnirailQwen3OmniThinkerText
    return _CLASS


# Made on first use, so that importing this module does not import vLLM.
_CLASS: type | None = None
