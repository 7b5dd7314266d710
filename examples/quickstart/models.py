"""Toy models for the quickstart pipeline: small, seeded, CPU-only.

preprocess ──▶ text_encoder ──┐
           └─▶ image_encoder ─┴─▶ fuse (fan-in; terminal)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

DIM = 64


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def create_preprocess(image_size: int = 128) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def preprocess(inputs: dict[str, Any]) -> dict[str, Any]:
        text = inputs.get("text")
        if not isinstance(text, str) or not text:
            raise ValueError("inputs.text: a non-empty string is required")
        size = int(inputs.get("image_size", image_size))
        if not 8 <= size <= 1024:
            raise ValueError(f"inputs.image_size: must be within 8..1024, got {size}")
        tokens = torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)
        # A deterministic "image" derived from the text, big enough to travel via shm.
        image = torch.rand(3, size, size, generator=_seeded(len(text)))
        return {"text": text, "tokens": tokens, "image": image}

    return preprocess


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
