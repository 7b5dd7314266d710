"""`decode`, `talker` and `code2wav`: the stages that consume the thinker's streams.

- `decode` turns each streamed token id into text and streams it to the client.
- `talker` turns each streamed hidden state into `frames_per_token` codec frames
  (`codebooks` codes each), autoregressively: every frame is conditioned on the hidden
  state and on the previous frame's codes, through a GRU cell stepped for the whole batch.
- `code2wav` is a windowed vocoder: it synthesizes windows of frames with left context
  (`window` chunks, advancing by `hop`) and streams only the new audio of each window,
  phase-continuous across windows, as float32 PCM chunks `{"pcm", "sample_rate"}`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from omnirail.stage import ARRequest, ARScheduler, ARStep, StreamingScheduler, StreamState

from .text import detokenize_piece
from .weights import seeded

SAMPLE_RATE = 16000
FRAME_MS = 20
_SCALE = 0.3  # weight std of the toy talker and vocoder

# ---- decode ---------------------------------------------------------------------------


class Detokenizer(StreamingScheduler):
    """One streamed token in, its text out to the client; the result is the whole text.

    `tokenizer`: a local Hugging Face tokenizer directory (for a Hugging Face thinker);
    None uses the demo's own vocabulary.
    """

    def __init__(self, tokenizer: str | None = None) -> None:
        super().__init__(window=1, metadata={"modality": "text"}, name="decode")
        self._hf = None
        if tokenizer is not None:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)

    def new_request(self, state: StreamState) -> None:
        state.user["tokens"] = []
        state.user["text"] = ""

    def process_window(self, state: StreamState, chunks: list[Any], final: bool) -> Any:
        if not chunks:
            return None
        tokens = state.user["tokens"]
        tokens.append(int(chunks[-1]))
        if self._hf is None:
            piece = detokenize_piece(tokens[-1], first=not state.user["text"])
            state.user["text"] += piece
        else:
            # Decoding the whole sequence keeps multi-token characters and spacing right.
            text = self._hf.decode(tokens, skip_special_tokens=True)
            piece, state.user["text"] = text[len(state.user["text"]) :], text
        return piece or None

    def finish(self, state: StreamState) -> Any:
        return {"text": state.user.get("text", ""), "tokens": len(state.user.get("tokens", []))}


def create_decode(tokenizer: str | None = None) -> Detokenizer:
    return Detokenizer(tokenizer)


# ---- talker ---------------------------------------------------------------------------


def create_talker(
    codebooks: int = 4,
    codebook_size: int = 64,
    frames_per_token: int = 4,
    width: int = 64,
    max_batch_size: int = 32,
    seed: int = 21,
) -> ARScheduler:
    """Fed by the thinker's hidden-state stream; one step = one token's frames for every
    request that has a hidden state waiting."""
    gen = torch.Generator().manual_seed(seed)
    cell = seeded(nn.GRUCell(width, width), seed, _SCALE)
    code_embed = seeded(nn.Embedding(codebooks * codebook_size, width), seed + 1, _SCALE)
    heads = seeded(nn.Linear(width, codebooks * codebook_size), seed + 2, _SCALE)
    offsets = torch.arange(codebooks) * codebook_size
    # Thinkers differ in width (a Hugging Face model's hidden size): one projection each.
    projections: dict[int, nn.Linear] = {}

    def project(hidden: torch.Tensor) -> torch.Tensor:
        size = hidden.numel()
        if size not in projections:
            layer = nn.Linear(size, width)
            with torch.no_grad():
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) / math.sqrt(size))
                layer.bias.zero_()
            projections[size] = layer
        return projections[size](hidden.float().reshape(-1))

    def init(req: ARRequest) -> None:
        req.state["h"] = torch.zeros(width)
        req.state["prev"] = torch.zeros(codebooks, dtype=torch.int64)
        req.state["frames"] = 0

    def step(batch: list[ARRequest]) -> list[ARStep]:
        out: list[ARStep | None] = [None] * len(batch)
        ready = []
        for i, req in enumerate(batch):
            if req.inputs:
                ready.append(i)
            elif req.inputs_done:
                out[i] = ARStep(finished=True, result={"frames": req.state["frames"]})
            else:
                out[i] = ARStep(needs_input=True)
        if ready:
            reqs = [batch[i] for i in ready]
            with torch.inference_mode():
                # Taking the input returns its credit: a fast thinker waits for the talker.
                cond = torch.stack([project(r.take_inputs(1)[0]) for r in reqs])
                h = torch.stack([r.state["h"] for r in reqs])
                prev = torch.stack([r.state["prev"] for r in reqs])
                frames = []
                for _ in range(frames_per_token):
                    h = cell(cond + code_embed(prev + offsets).sum(1), h)
                    logits = heads(h).reshape(len(reqs), codebooks, codebook_size)
                    prev = logits.argmax(-1)
                    frames.append(prev)
                codes = torch.stack(frames, 1)  # B x frames x codebooks
            for j, i in enumerate(ready):
                req = batch[i]
                req.state["h"], req.state["prev"] = h[j], prev[j]
                req.state["frames"] += frames_per_token
                out[i] = ARStep(chunk=codes[j].contiguous(), metadata={"modality": "codes"})
        return [o for o in out if o is not None]

    return ARScheduler(
        step, init_fn=init, max_batch_size=max_batch_size, hold_inputs=True, name="talker"
    )


# ---- code2wav -------------------------------------------------------------------------


class Code2Wav(StreamingScheduler):
    """A windowed toy vocoder: per-frame synthesis parameters come from a convolution over
    the window's frames (so each frame hears its neighbours), then a sum of harmonics."""

    def __init__(
        self, codebooks: int, codebook_size: int, window: int, hop: int, seed: int
    ) -> None:
        super().__init__(window=window, hop=hop, metadata={"modality": "audio"}, name="code2wav")
        self.samples_per_frame = SAMPLE_RATE * FRAME_MS // 1000
        self.embed = seeded(nn.Embedding(codebooks * codebook_size, 32), seed, _SCALE)
        self.conv = seeded(nn.Conv1d(32, 32, 3, padding=1), seed + 1, _SCALE)
        self.params = seeded(nn.Linear(32, 5), seed + 2, _SCALE)  # pitch, loudness, 3 harmonics
        self.offsets = torch.arange(codebooks) * codebook_size

    def new_request(self, state: StreamState) -> None:
        state.user.update(emitted=0, samples=0, phase=0.0, amp=torch.zeros(3))

    def process_window(self, state: StreamState, chunks: list[Any], final: bool) -> Any:
        first_frame = (state.chunks_in - len(chunks)) * chunks[0].shape[0] if chunks else 0
        codes = torch.cat(chunks) if chunks else None
        if codes is None:
            return None
        new_from = state.user["emitted"] - first_frame
        if new_from >= codes.shape[0]:
            return None
        with torch.inference_mode():
            x = self.embed(codes + self.offsets).sum(1)  # frames x 32
            x = torch.tanh(self.conv(x.T[None])[0].T)  # context from the whole window
            p = self.params(x[new_from:])
        audio = self._synthesize(state, p)
        state.user["emitted"] += p.shape[0]
        state.user["samples"] += audio.numel()
        return {"pcm": audio, "sample_rate": SAMPLE_RATE}

    def _synthesize(self, state: StreamState, p: torch.Tensor) -> torch.Tensor:
        n = self.samples_per_frame
        pitch = 110.0 * torch.pow(2.0, 1.5 + torch.tanh(p[:, 0]))  # ~190..880 Hz
        loud = 0.05 + 0.15 * torch.sigmoid(p[:, 1])
        harm = torch.softmax(p[:, 2:], -1)
        # Per-sample frequency (held within a frame) integrated to phase: no clicks.
        freq = pitch.repeat_interleave(n)
        phase = state.user["phase"] + 2 * math.pi * torch.cumsum(freq, 0) / SAMPLE_RATE
        state.user["phase"] = float(phase[-1] % (2 * math.pi))
        k = torch.arange(1, 4, dtype=torch.float32)
        waves = torch.sin(phase[:, None] * k)  # samples x 3 harmonics
        # Harmonic amplitudes glide from the previous frame's to each frame's: no steps.
        target = harm * loud[:, None]  # frames x 3
        start = torch.cat([state.user["amp"][None], target[:-1]])
        ramp = (torch.arange(n, dtype=torch.float32) / n)[None, :, None]
        amp = (start[:, None] + (target - start)[:, None] * ramp).reshape(-1, 3)
        state.user["amp"] = target[-1]
        return (waves * amp).sum(1).float().contiguous()

    def finish(self, state: StreamState) -> Any:
        samples = state.user.get("samples", 0)
        return {
            "samples": samples,
            "seconds": round(samples / SAMPLE_RATE, 3),
            "sample_rate": SAMPLE_RATE,
        }


def create_code2wav(
    codebooks: int = 4, codebook_size: int = 64, window: int = 4, hop: int = 2, seed: int = 31
) -> Code2Wav:
    return Code2Wav(codebooks, codebook_size, window, hop, seed)
