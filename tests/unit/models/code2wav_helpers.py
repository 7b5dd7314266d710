"""Helpers of the Qwen3-Omni tests that stream codec frames through code2wav."""

from __future__ import annotations

import torch

from omnirail.models.qwen3_omni.code2wav import Code2WavStreamer
from omnirail.testing.tiny import qwen3_omni as tiny_model

# Streamed audio against the reference's: float rounding (measured ~1e-8).
AUDIO_BOUND = 1e-6


def stream_audio(streamer: Code2WavStreamer, codes: torch.Tensor) -> torch.Tensor:
    """`codes` (groups, frames) pushed one frame at a time, then flushed: the waveform."""
    state = streamer.start()
    parts = [streamer.push(state, frame) for frame in codes.T]
    parts.append(streamer.flush(state))
    return torch.cat(parts)


def assert_audio_close(wav: torch.Tensor, ref: torch.Tensor) -> None:
    assert wav.shape == ref.shape
    assert (wav - ref).abs().max().item() <= AUDIO_BOUND


def random_codes(frames: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(
        0, tiny_model.CODEBOOK_SIZE, (tiny_model.NUM_CODE_GROUPS, frames), generator=gen
    )
