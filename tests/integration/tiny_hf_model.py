"""Makes a tiny, randomly initialised Hugging Face causal LM and tokenizer on disk.

For tests of the demo's Hugging Face thinker: a Llama-architecture model small enough to
build in a second, with a word-level tokenizer over the demo's vocabulary, saved with
`save_pretrained` exactly as a downloaded model directory would be laid out.
"""

from __future__ import annotations

from pathlib import Path


def make_tiny_model(path: Path, seed: int = 0) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from omnirail.models.omni_demo.text import VOCAB

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    words = [w for w in VOCAB if not w.startswith("<")]
    vocab = {t: i for i, t in enumerate(specials + words)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        pad_token_id=vocab["<pad>"],
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
