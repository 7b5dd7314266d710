"""Toy models for the streaming example: real tensors, deterministic, CPU only.

The thinker "decodes" the input text one character per step (a stand-in for an LLM) and
streams each token's hidden state; the talker turns each hidden state into codec codes as
it arrives; the vocoder synthesizes overlapping windows of codes into audio and streams
every window to the client as soon as it is computed.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from omnirail import InputError
from omnirail.stage import CLIENT, ARRequest, ARScheduler, ARStep, StreamingScheduler, StreamState

_MAX_TEXT = 512


def create_thinker(hidden_size: int = 64, step_ms: float = 0.0) -> ARScheduler:
    """Continuous batching over requests: every step emits one token per running request."""
    gen = torch.Generator().manual_seed(0)
    embed = torch.randn(256, hidden_size, generator=gen)
    mix = torch.randn(hidden_size, hidden_size, generator=gen) / math.sqrt(hidden_size)

    def init(req: ARRequest) -> None:
        inputs = req.data or {}
        text = inputs.get("text")
        if not isinstance(text, str) or not text:
            raise InputError("inputs.text: required, a non-empty string")
        if len(text) > _MAX_TEXT:
            raise InputError(f"inputs.text: at most {_MAX_TEXT} characters, got {len(text)}")
        req.state["tokens"] = list(text.encode())
        req.state["hidden"] = torch.zeros(hidden_size)

    def step(batch: list[ARRequest]) -> list[ARStep]:
        if step_ms:
            time.sleep(step_ms / 1000.0)  # one decode step of a real model
        tokens = torch.tensor([r.state["tokens"][r.steps] for r in batch])
        prev = torch.stack([r.state["hidden"] for r in batch])
        hidden = torch.tanh(embed[tokens] + prev @ mix)  # the whole batch in one matmul
        out: list[ARStep] = []
        for i, req in enumerate(batch):
            req.state["hidden"] = hidden[i]
            # The token's text goes to the client; its hidden state to the talker.
            req.emit(chr(int(tokens[i])), target=CLIENT, metadata={"modality": "text"})
            done = req.steps + 1 == len(req.state["tokens"])
            result = {"text": bytes(req.state["tokens"]).decode(errors="replace")}
            out.append(ARStep(chunk=hidden[i].clone(), finished=done, result=result))
        return out

    return ARScheduler(step, init_fn=init, max_batch_size=16, name="thinker")


def create_talker(codebooks: int = 4, codebook_size: int = 1024) -> ARScheduler:
    """Fed by the thinker's stream: one step per hidden state that has arrived."""
    gen = torch.Generator().manual_seed(1)

    def init(req: ARRequest) -> None:
        req.state["used"] = 0  # hidden states turned into codes so far

    proj_cache: dict[int, torch.Tensor] = {}

    def step(batch: list[ARRequest]) -> list[ARStep]:
        out: list[ARStep] = []
        for req in batch:
            used = req.state["used"]
            if req.inputs:
                # Taking the input returns its credit: a fast thinker waits for the talker.
                [hidden] = req.take_inputs(1)
                proj = proj_cache.get(hidden.numel())
                if proj is None:
                    proj = proj_cache[hidden.numel()] = torch.randn(
                        hidden.numel(), codebooks, generator=gen
                    )
                codes = ((hidden @ proj).sigmoid() * (codebook_size - 1)).long()
                req.state["used"] = used + 1
                out.append(ARStep(chunk=codes, metadata={"modality": "codes"}))
            elif req.inputs_done:
                out.append(ARStep(finished=True, result={"frames": used}))
            else:
                out.append(ARStep(needs_input=True))
        return out

    return ARScheduler(step, init_fn=init, max_batch_size=32, hold_inputs=True, name="talker")


class Vocoder(StreamingScheduler):
    """Synthesizes overlapping windows of code frames; streams each window's new audio."""

    def __init__(self, sample_rate: int, frame_ms: int, window: int, hop: int) -> None:
        super().__init__(window=window, hop=hop, metadata={"modality": "audio"}, name="vocoder")
        self.sample_rate = sample_rate
        self.frame = sample_rate * frame_ms // 1000

    def new_request(self, state: StreamState) -> None:
        state.user["emitted"] = 0  # frames already turned into audio
        state.user["samples"] = 0

    def process_window(self, state: StreamState, chunks: list[Any], final: bool) -> Any:
        # The window gives context; only frames not emitted before become new audio.
        first = state.chunks_in - len(chunks)
        new = chunks[state.user["emitted"] - first :]
        if not new:
            return None
        audio = torch.cat([self._frame(codes) for codes in new])
        state.user["emitted"] += len(new)
        state.user["samples"] += audio.numel()
        return audio

    def _frame(self, codes: torch.Tensor) -> torch.Tensor:
        t = torch.arange(self.frame, dtype=torch.float32) / self.sample_rate
        freqs = 100.0 + codes.float() * 2.0
        return (torch.sin(2 * math.pi * freqs[:, None] * t).mean(0) * 0.3).contiguous()

    def finish(self, state: StreamState) -> Any:
        return {
            "samples": state.user["samples"],
            "seconds": state.user["samples"] / self.sample_rate,
            "sample_rate": self.sample_rate,
        }


def create_vocoder(
    sample_rate: int = 16000, frame_ms: int = 20, window: int = 4, hop: int = 2
) -> Vocoder:
    return Vocoder(sample_rate, frame_ms, window, hop)
