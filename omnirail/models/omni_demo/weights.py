"""Deterministic toy weights: every parameter drawn from one seeded generator."""

from __future__ import annotations

import torch
from torch import nn


def seeded(module: nn.Module, seed: int, scale: float) -> nn.Module:
    """`module` with N(0, scale²) weights from `seed`, in eval mode."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return module.eval()
