"""Toy models for the quickstart pipeline: small, seeded, CPU-only.

preprocess ──▶ text_encoder ──┐
           └─▶ image_encoder ─┴─▶ fuse (fan-in; terminal)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from omnirail import InputError

DIM = 64


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


_KNOWN = ("text", "image_size")
MAX_TEXT = 4096


def create_preprocess(image_size: int = 128) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def preprocess(inputs: Any) -> dict[str, Any]:
        # Every field is checked here, at the entry stage, so a caller's mistake comes back
        # as INVALID_ARGUMENT naming the field rather than as a model's INTERNAL error.
        if not isinstance(inputs, dict):
            raise InputError(f"inputs: expected an object, got {type(inputs).__name__}")
        unknown = sorted(str(k)[:40] for k in inputs if k not in _KNOWN)
        if unknown:
            more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
            raise InputError(
                f"inputs: unknown fields {unknown[:5]}{more}; expected some of {list(_KNOWN)}"
            )
        text = inputs.get("text")
        if not isinstance(text, str) or not text:
            raise InputError(f"inputs.text: a non-empty string is required, got {_kind(text)}")
        if len(text) > MAX_TEXT:
            raise InputError(f"inputs.text: at most {MAX_TEXT} characters, got {len(text)}")
        size = inputs.get("image_size", image_size)
        if isinstance(size, bool) or not isinstance(size, int) or not 8 <= size <= 1024:
            raise InputError(f"inputs.image_size: an integer within 8..1024, got {_kind(size)}")
        tokens = torch.tensor(list(text.encode("utf-8", errors="replace")), dtype=torch.int64)
        # A deterministic "image" derived from the text, big enough to travel via shm.
        image = torch.rand(3, size, size, generator=_seeded(len(text)))
        return {"text": text, "tokens": tokens, "image": image}

    return preprocess


def _kind(value: Any) -> str:
    """What the caller sent, short: a number as itself, anything else by type."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return repr(value)[:32]
    if isinstance(value, str):
        return "an empty string" if not value else f"a string of {len(value)} characters"
    return "null" if value is None else type(value).__name__


def to_text_encoder(payload: dict[str, Any]) -> dict[str, Any]:
    return {"tokens": payload["tokens"]}


def to_image_encoder(payload: dict[str, Any]) -> dict[str, Any]:
    return {"image": payload["image"]}


def create_text_encoder(seed: int = 1) -> Callable[[dict[str, Any]], dict[str, Any]]:
    table = torch.randn(256, DIM, generator=_seeded(seed))

    def encode(payload: dict[str, Any]) -> dict[str, Any]:
        with torch.no_grad():
            emb = table[payload["tokens"]].mean(dim=0)
        return {"text_embedding": emb}

    return encode


def create_image_encoder(seed: int = 2) -> Callable[[dict[str, Any]], dict[str, Any]]:
    conv = torch.nn.Conv2d(3, DIM, kernel_size=8, stride=8)
    with torch.no_grad():
        for p in conv.parameters():
            p.copy_(torch.randn(p.shape, generator=_seeded(seed)) * 0.05)

    def encode(payload: dict[str, Any]) -> dict[str, Any]:
        with torch.no_grad():
            feats = conv(payload["image"].unsqueeze(0))  # 1 x DIM x H/8 x W/8
            emb = feats.mean(dim=(2, 3)).squeeze(0)
        return {"image_embedding": emb, "patches": int(feats.shape[2] * feats.shape[3])}

    return encode


def merge_for_fuse(arrived: dict[str, Any]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for part in arrived.values():
        merged.update(part)
    return merged


def create_fuse() -> Callable[[dict[str, Any]], dict[str, Any]]:
    def fuse(payload: dict[str, Any]) -> dict[str, Any]:
        text, image = payload["text_embedding"], payload["image_embedding"]
        score = torch.nn.functional.cosine_similarity(text, image, dim=0)
        return {
            "embedding": torch.cat([text, image]),
            "similarity": round(float(score), 6),
            "patches": payload["patches"],
        }

    return fuse
