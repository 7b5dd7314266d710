"""Tiny checkpoints with random weights, made on the spot: each has the files a user's real
checkpoint directory holds (config.json, safetensors shards, tokenizer, processor) at a
fraction of the size, so a pipeline can be served and tested without downloading anything.

    python -m omnirail.testing.tiny qwen3-omni DIR [--seed N]

`make(kind, path, seed)` does the same from Python. The builders need the `hf` extra
(torch, transformers); this module imports neither until one runs.
"""

from __future__ import annotations

import importlib
from pathlib import Path

# kind -> the module whose `make_tiny_model(path, seed)` builds it.
BUILDERS = {
    "qwen3": "omnirail.testing.tiny.qwen3",
    "qwen3-omni": "omnirail.testing.tiny.qwen3_omni",
}


def make(kind: str, path: str | Path, seed: int = 0) -> Path:
    """Saves a tiny `kind` checkpoint into `path` (made if missing); returns it."""
    if kind not in BUILDERS:
        raise ValueError(f"unknown tiny checkpoint {kind!r}; known: {', '.join(sorted(BUILDERS))}")
    builder = importlib.import_module(BUILDERS[kind])
    return builder.make_tiny_model(path, seed=seed)
