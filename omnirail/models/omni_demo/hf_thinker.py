"""A real Hugging Face causal LM as the demo's thinker, loaded from a local directory.

Use it by pointing the thinker's factory here and the decode stage at the same tokenizer
(`pipeline_hf.yaml` does both, reading the directory from `OMNI_DEMO_HF_MODEL`):

    - name: thinker
      factory: omnirail.models.omni_demo.hf_thinker:create_hf_thinker
      factory_args: {model_path: /models/my-lm}
    - name: decode
      factory: omnirail.models.omni_demo.speech:create_decode
      factory_args: {tokenizer: /models/my-lm}

The prompt is the request's text through the model's own tokenizer, after the image and
audio embeddings projected to the model's width (a seeded projection: the model was not
trained on them, so for a real multimodal model replace `_project` with its own merger).
Each request keeps its own KV cache (`past_key_values`); a step runs every running
request one token forward, one model call per request, and streams the token id to
`decode` and the last layer's hidden state to `talker`. Needs `transformers`
(`pip install 'omnirail[hf]'`); nothing is downloaded: `local_files_only=True`.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from omnirail.stage import ARRequest, ARScheduler, ARStep

from .thinker import sample


def create_hf_thinker(
    model_path: str | None = None,
    max_batch_size: int = 8,
    dtype: str = "float32",
    seed: int = 7,
) -> ARScheduler:
    """`model_path`: a local model directory (default: `$OMNI_DEMO_HF_MODEL`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # stage logs are line-oriented

    path = _model_dir(model_path, "thinker", "model_path")
    if not os.path.isdir(path):
        raise ValueError(f"hf thinker: model_path {path!r} is not a directory")
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"hf thinker: unknown dtype {dtype!r}")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch_dtype)
    model.eval()
    embed = model.get_input_embeddings()
    width = embed.embedding_dim
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else -1
    projections: dict[int, torch.nn.Linear] = {}

    def _project(mm: torch.Tensor) -> torch.Tensor:
        size = mm.shape[-1]
        if size not in projections:
            layer = torch.nn.Linear(size, width, bias=False)
            gen = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) / math.sqrt(size))
            projections[size] = layer.to(torch_dtype)
        return projections[size](mm.to(torch_dtype))

    def _forward(**kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, Any]:
        out = model(**kwargs, use_cache=True, output_hidden_states=True, return_dict=True)
        return out.logits[0, -1].float(), out.hidden_states[-1][0, -1].float(), out.past_key_values

    def init(req: ARRequest) -> None:
        data, options = req.data, req.data["options"]
        ids = tokenizer(data["text"], return_tensors="pt").input_ids
        if tokenizer.bos_token_id is not None and (
            ids.numel() == 0 or ids[0, 0] != tokenizer.bos_token_id
        ):
            ids = torch.cat([torch.tensor([[tokenizer.bos_token_id]]), ids], dim=1)
        with torch.inference_mode():
            x = embed(ids)
            if data["mm_embeds"].numel():
                x = torch.cat([_project(data["mm_embeds"])[None], x], dim=1)
            logits, hidden, cache = _forward(inputs_embeds=x)
        gen = torch.Generator().manual_seed(options["seed"])
        req.state.update(cache=cache, gen=gen, options=options, tokens=[], hidden=hidden)
        # At least one token before <eos>: an empty answer says nothing.
        forbid = [eos] if 0 <= eos < logits.numel() else []
        req.state["next"] = sample(logits, options["temperature"], gen, forbid)

    def step(batch: list[ARRequest]) -> list[ARStep]:
        out = []
        for req in batch:
            st = req.state
            token = st["next"]
            st["tokens"].append(token)
            if token != eos:
                req.emit(torch.tensor(token), target="decode", metadata={"modality": "token"})
                req.emit(st["hidden"].clone(), target="talker", metadata={"modality": "hidden"})
            if token == eos or len(st["tokens"]) >= st["options"]["max_new_tokens"]:
                made = [t for t in st["tokens"] if t != eos]
                reason = "eos" if token == eos else "length"
                out.append(ARStep(finished=True, result={"tokens": made, "finish_reason": reason}))
                continue
            with torch.inference_mode():
                logits, st["hidden"], st["cache"] = _forward(
                    input_ids=torch.tensor([[token]]), past_key_values=st["cache"]
                )
            temperature = st["options"]["temperature"]
            st["next"] = sample(logits, temperature, st["gen"], [])
            out.append(ARStep())
        return out

    return ARScheduler(step, init_fn=init, max_batch_size=max_batch_size, name="thinker")


def _model_dir(given: str | None, what: str, field: str) -> str:
    path = given or os.environ.get("OMNI_DEMO_HF_MODEL")
    if not path:
        raise ValueError(f"hf {what}: set factory_args.{field} or OMNI_DEMO_HF_MODEL")
    return path


def create_hf_decode(tokenizer: str | None = None) -> Any:
    """The decode stage with the thinker's tokenizer (default: `$OMNI_DEMO_HF_MODEL`)."""
    from .speech import create_decode

    return create_decode(_model_dir(tokenizer, "decode", "tokenizer"))
