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

Prompts with media bypass vLLM's multimodal processing (whose Qwen3-Omni processor needs
torchvision): the stage builds what the text model takes, exactly as the hand-written thinker
does (`ThinkerRunner.prompt_inputs`: embeddings with the encoders' rows scattered in, 3D rope
positions, deepstack features) and registers it in `MediaPrompts` under vLLM's id of the
request. For a batch holding such requests, `forward` puts their embedding rows and positions
in place of vLLM's, adds the deepstack features after the first layers at image positions, and
keeps the hidden state after `accept_hidden_layer` layers at media positions (what the talker
reads). It finds which rows of the batch are whose from the model runner's current batch (the
request ids, their first row and their tokens computed before this step): vLLM 0.32's
in-process runner, read only.

Registered with vLLM under `ARCHITECTURE` (`register`) before the engine is built.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ARCHITECTURE = "OmnirailQwen3OmniThinkerText"
_PREFIXES = (("thinker.model.", "model."), ("thinker.lm_head.", "lm_head."))


@dataclass
class MediaPrompt:
    """A prompt with media as the text model takes it (rows of the prompt, L of them).

    `embeds` (L, H); `positions` (3, L) the 3D rope positions; `delta` what later tokens add
    to their text position; `visual` (L,) image positions and `deepstack` one (images' tokens,
    H) tensor per level, or None; `media` (L,) audio/image positions, whose hidden state after
    `accept_layer` layers `forward` writes into `accept` (media positions, H) as prefill runs.
    """

    embeds: torch.Tensor
    positions: torch.Tensor
    delta: int
    visual: torch.Tensor | None
    deepstack: list[torch.Tensor] | None
    media: torch.Tensor
    accept_layer: int | None
    accept: torch.Tensor | None = None
    visual_index: torch.Tensor | None = field(default=None, repr=False)
    media_index: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.media_index = torch.cumsum(self.media.long(), 0) - 1
        if self.visual is not None:
            self.visual_index = torch.cumsum(self.visual.long(), 0) - 1
        if self.accept_layer is not None:
            self.accept = torch.zeros(
                (int(self.media.sum()), self.embeds.shape[1]), dtype=self.embeds.dtype
            )


class MediaPrompts(dict[str, MediaPrompt]):
    """vLLM's request id -> its `MediaPrompt`; touched only on the engine's thread."""


def attach(engine: Any, prompts: MediaPrompts) -> None:
    """Gives the engine's model (built by `register`'s class) the table and the model runner
    it reads each batch's layout from."""
    runner = engine.model_executor.driver_worker.worker.model_runner
    model = runner.get_model()
    if not hasattr(model, "media_prompts"):
        raise TypeError(f"the engine's model is {type(model).__name__}, not the vLLM thinker's")
    model.media_prompts = prompts
    model.runner = runner


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

        media_prompts: MediaPrompts | None = None
        runner: Any = None

        def get_mrope_input_positions(
            self, input_tokens: list[int], mm_features: list[Any]
        ) -> tuple[torch.Tensor, int]:
            # Text positions: right for prompts without media; `forward` puts a media
            # prompt's own in place (vLLM never sees its media).
            n = len(input_tokens)
            return torch.arange(n, dtype=torch.long).expand(3, n).clone(), 0

        def forward(
            self,
            input_ids: torch.Tensor | None,
            positions: torch.Tensor,
            intermediate_tensors: Any = None,
            inputs_embeds: torch.Tensor | None = None,
        ) -> Any:
            plan = self._media_in_batch()
            if not plan:
                return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds)
            return self._forward_media(input_ids, positions, inputs_embeds, plan)

        def _media_in_batch(self) -> list[tuple[int, int, int, MediaPrompt]]:
            """(first row, rows, prompt tokens computed before, prompt) of each media request
            in the batch being run."""
            if not self.media_prompts or self.runner is None:
                return []
            batch = self.runner.input_batch
            n = batch.num_reqs
            starts = self.runner.query_start_loc.np[: n + 1]
            done = batch.num_computed_tokens_cpu[:n]
            plan = []
            for i, rid in enumerate(batch.req_ids[:n]):
                prompt = self.media_prompts.get(rid)
                if prompt is not None:
                    first, rows = int(starts[i]), int(starts[i + 1] - starts[i])
                    plan.append((first, rows, int(done[i]), prompt))
            return plan

        def _forward_media(self, input_ids, positions, inputs_embeds, plan):
            model = self.model
            hidden = model.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
            hidden = hidden.clone()
            positions = positions.clone()
            deep: list[tuple[torch.Tensor, MediaPrompt, torch.Tensor]] = []
            accept: list[tuple[torch.Tensor, MediaPrompt, torch.Tensor]] = []
            for first, rows, done, prompt in plan:
                length = prompt.embeds.shape[0]
                own = max(0, min(rows, length - done))  # prompt rows in this step
                if own:
                    hidden[first : first + own] = prompt.embeds[done : done + own]
                    positions[:, first : first + own] = prompt.positions[:, done : done + own]
                    media = torch.nonzero(prompt.media[done : done + own])[:, 0]
                    if media.numel() and prompt.accept is not None:
                        accept.append((first + media, prompt, prompt.media_index[done + media]))
                    if prompt.visual is not None:
                        vis = torch.nonzero(prompt.visual[done : done + own])[:, 0]
                        if vis.numel():
                            deep.append((first + vis, prompt, prompt.visual_index[done + vis]))
                if rows > own:  # generated tokens: text position plus the prompt's delta
                    later = torch.arange(done + own, done + rows) + prompt.delta
                    positions[:, first + own : first + rows] = later
            layer_of = {p.accept_layer for _, p, _ in accept}
            if 0 in layer_of:
                _keep(accept, 0, hidden)
            residual = None
            layers = model.layers[model.start_layer : model.end_layer]
            for index, layer in enumerate(layers, start=model.start_layer):
                hidden, residual = layer(positions, hidden, residual)
                if index + 1 in layer_of and index + 1 < len(model.layers):
                    _keep(accept, index + 1, hidden + residual)
                for rows_, prompt, src in deep:
                    if prompt.deepstack is not None and index < len(prompt.deepstack):
                        hidden = hidden.index_add(0, rows_, prompt.deepstack[index][src])
            hidden, _ = model.norm(hidden, residual)
            if len(model.layers) in layer_of:
                _keep(accept, len(model.layers), hidden)
            return hidden

    _CLASS = OmnirailQwen3OmniThinkerText
    return _CLASS


def _keep(
    accept: list[tuple[torch.Tensor, MediaPrompt, torch.Tensor]], layer: int, hidden: torch.Tensor
) -> None:
    """Copies the media rows of `hidden` (after `layer` layers) into their prompts' `accept`."""
    for rows, prompt, dest in accept:
        if prompt.accept_layer == layer and prompt.accept is not None:
            prompt.accept[dest] = hidden[rows].to(prompt.accept.dtype)


# Made on first use, so that importing this module does not import vLLM.
_CLASS: type | None = None
