"""A tiny dense Qwen3 causal LM made here, for tests of LLM stages: nothing is downloaded.

`make_tiny_model(path)` saves a `Qwen3ForCausalLM` with seeded random weights, the byte-level
BPE tokenizer of the tiny Qwen3-Omni (`qwen3_omni.build_tokenizer`, with its chat template and
special tokens) and a generation config whose end of turn is `<|im_end|>`. The shapes are the
smallest a vLLM CPU build serves: head_dim 32 (its attention takes 32, 64, 80, ... and refuses
16), 2 layers x 64 wide, 2 query heads and 1 key/value head. The weights' std (`INIT_STD`)
keeps the top two logits well apart, so float noise from batching cannot flip a greedy choice
and an engine's tokens equal transformers' `generate()`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from omnirail.testing.tiny.qwen3_omni import build_tokenizer

INIT_STD = 0.2
HEAD_DIM = 32


def tiny_config(tokenizer: Any) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=HEAD_DIM,
        max_position_embeddings=4096,
        initializer_range=INIT_STD,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def make_tiny_model(path: str | Path, seed: int = 0) -> Path:
    """Saves the tiny Qwen3 (config, safetensors, tokenizer, generation config) into `path`
    and returns it. Same `seed`, same files."""
    from transformers import GenerationConfig, Qwen3ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = tiny_config(tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.eval()
    model.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, do_sample=False
    )
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def reference_generate(
    path: str | Path, prompts: list[str], max_new_tokens: int
) -> list[list[int]]:
    """transformers' greedy `generate()` on each prompt alone: the generated token ids (the
    end-of-turn token included when it comes), the oracle an engine must equal."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(path), local_files_only=True, dtype=torch.float32
    ).eval()
    out: list[list[int]] = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(
                ids,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                attention_mask=torch.ones_like(ids),
            )
        out.append(gen[0, ids.shape[1] :].tolist())
    return out
