"""`image_encoder`, `audio_encoder` and `mm_aggregate` (toy models, seeded weights).

Each encoder turns its modality into a short sequence of embeddings in the thinker's
width; `mm_aggregate` waits for exactly the encoders a request used (the fan-in hooks of
`omnirail.models.fanin`) and lays out the thinker's prompt: `<image>` embeddings, `<audio>`
embeddings, then text.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .thinker import DIM
from .weights import seeded

_SCALE = 0.1  # weight std of the toy encoders


def create_image_encoder(tokens: int = 16, seed: int = 11) -> Callable[[Any], Any]:
    """Patches → an MLP per patch → pooled to `tokens` embeddings (a 4x4 grid by default)."""
    side = int(tokens**0.5)
    if side * side != tokens:
        raise ValueError(f"tokens must be a square number, got {tokens}")
    mlp = seeded(nn.Sequential(nn.Linear(192, 128), nn.GELU(), nn.Linear(128, DIM)), seed, _SCALE)

    def encode(payload: dict[str, Any]) -> dict[str, Any]:
        patches = payload["patches"]
        grid = int(patches.shape[0] ** 0.5)
        with torch.inference_mode():
            feats = mlp(patches)  # P x DIM
            feats = feats.T.reshape(1, DIM, grid, grid)
            pooled = nn.functional.adaptive_avg_pool2d(feats, side)
        return {"image_embeds": pooled.reshape(DIM, tokens).T.contiguous()}

    return encode


def create_audio_encoder(stride: int = 4, seed: int = 12) -> Callable[[Any], Any]:
    """Frames → two strided 1-D convolutions: one embedding per `stride` frames (40 ms)."""
    convs = seeded(
        nn.Sequential(
            nn.Conv1d(64, 128, 3, stride=2, padding=1),
            nn.GELU(),
            nn.Conv1d(128, DIM, 3, stride=stride // 2, padding=1),
        ),
        seed,
        _SCALE,
    )

    def encode(payload: dict[str, Any]) -> dict[str, Any]:
        with torch.inference_mode():
            out = convs(payload["frames"].T[None])  # 1 x DIM x T/stride
        return {"audio_embeds": out[0].T.contiguous()}

    return encode


# ---- mm_aggregate -------------------------------------------------------------------


def create_mm_aggregate(seed: int = 13) -> Callable[[Any], Any]:
    """Projects each modality's embeddings into the thinker's input space (the "merger")."""
    proj = {
        "image_embeds": seeded(nn.Linear(DIM, DIM), seed, _SCALE),
        "audio_embeds": seeded(nn.Linear(DIM, DIM), seed + 1, _SCALE),
    }

    def aggregate(payload: dict[str, Any]) -> dict[str, Any]:
        parts = []
        with torch.inference_mode():
            for key, layer in proj.items():
                if key in payload:
                    parts.append(layer(payload[key]))
        mm = torch.cat(parts) if parts else torch.zeros(0, DIM)
        return {
            "text": payload["text"],
            "tokens": payload["tokens"],
            "mm_embeds": mm.contiguous(),
            "mm_layout": {
                "image": int(payload["image_embeds"].shape[0]) if "image_embeds" in payload else 0,
                "audio": int(payload["audio_embeds"].shape[0]) if "audio_embeds" in payload else 0,
            },
            "options": payload["options"],
        }

    return aggregate
