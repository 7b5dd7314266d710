"""Qwen3-Omni's codec vocoder (code2wav) decoding a stream of codec frames as they arrive.

    streamer = Code2WavStreamer(code2wav)  # or Code2WavStreamer.from_pretrained(path, device)
    state = streamer.start()
    audio = streamer.push(state, frame)    # frame (num_quantizers,): samples, often empty
    audio = streamer.flush(state)          # at the end of the stream: the rest

Every call returns a 1-D float32 tensor of 24 kHz samples (possibly empty) on the module's
device; their concatenation is the request's waveform, equal to the reference's
`code2wav.chunked_decode(codes, chunk_size=300, left_context_size=25)` (what
`Qwen3OmniMoeForConditionalGeneration.generate()` returns) up to float rounding.

How, and why that bound: code2wav is a sliding-window transformer over the 12.5 Hz code frames
followed by a convolution stack that upsamples each frame to `total_upsample` (1920) samples.
Both are causal up to a fixed tail: decoding `t` frames gives `1920 t - d` samples (`d`, 555
for Qwen3-Omni's decoder, is what the causal transposed convolutions drop at the end), and
those are the first samples of decoding any longer prefix. The reference decodes in
*segments* of 300 frames, each with 25 frames of left context whose samples it drops, so its
waveform restarts the transformer at every segment boundary and lacks `d` samples there.
The streamer decodes the same segments (segment k: frames `[300k - 25, 300(k+1))`, the first
25 only as context), and inside a segment it emits audio every `chunk_frames` frames:

- the transformer runs incrementally over the segment with its own KV cache (a sliding-window
  cache: equal to a full forward up to float rounding, ~1e-7 relative), and
- the convolution stack runs incrementally too (`conv_stream.ConvStream`: every convolution
  keeps the inputs it will need again), so a chunk costs its own samples only, and its
  output is the module's whole-segment output in order.

So the streamed waveform equals the reference within float rounding for any length, past 300
frames included (no samples are added or lost at boundaries: the same `d` samples per segment
are missing, as in the reference). Measured on the tiny model (audio peaks ~2.5e-2): at most
~1.2e-8 absolute, for 1 to 700 frames and chunks of 1 to 25 frames; the tests hold it to 1e-6.

With `segment_frames=None` the stream is one segment: equal (same bound) to `code2wav(codes)`,
the decode of all frames at once, instead. The two differ only past 300 frames, where the
reference is the worse audio: it loses `d` samples (23 ms) at each boundary, and its 25
frames of context are less than the transformer's window (72 frames per layer), so the first
~50 frames after a boundary differ from a full decode (up to 8e-5 on the tiny model).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from .conv_stream import ConvState, ConvStream

SEGMENT_FRAMES = 300  # the reference chunked_decode's chunk_size
SEGMENT_CONTEXT = 25  # and its left_context_size
CHUNK_FRAMES = 12  # frames per emitted audio chunk (0.96 s at 12.5 Hz)
FIRST_CHUNK_FRAMES = 4  # the first chunk of a request, sooner (0.32 s)


def chunk_due(chunks: int, first: int, growth: int, most: int) -> int:
    """Frames in audio chunk number `chunks` (0 for a request's first): `first`, then
    growing by `growth` up to `most` (with `growth` 1: `most` after the first)."""
    if not chunks:
        return first
    if growth == 1:
        return most
    return min(most, first * growth**chunks)


@dataclass(eq=False)
class Code2WavState:
    """One request's decoding state (build it with `Code2WavStreamer.start`)."""

    frames_in: int = 0  # code frames received
    samples_out: int = 0  # samples emitted
    segment_start: int = 0  # first frame of the current segment (after its context)
    window: list[torch.Tensor] = field(default_factory=list)  # the segment's frames, context first
    context: int = 0  # how many of `window` are context
    cache: Any = None  # the transformer's cache over `window`
    fed: int = 0  # frames of `window` through the transformer and the convolutions
    convs: ConvState = field(default_factory=dict)  # the convolutions' kept inputs
    emitted: int = 0  # samples of the segment window emitted (or dropped as context)
    chunks: int = 0
    finished: bool = False


class Code2WavStreamer:
    """Streams code2wav (`Qwen3OmniMoeCode2Wav`) per request; see the module docstring.

    `chunk_frames`: emit once this many new frames have arrived (`first_chunk_frames` for a
    request's first chunk); with `growth` > 1 the chunks after the first grow by that factor
    up to `chunk_frames` (first, first*g, first*g^2, ...): a small first chunk for an early
    first sound, then fewer, longer chunks (each chunk is a pass over ~60 modules: fewer
    passes, less Python). Doubling keeps the audio already sent longer than the wait for the
    next chunk while the stream runs at least twice faster than real time;
    `segment_frames`/`segment_context`: the reference's chunking (None: one segment).
    """

    def __init__(
        self,
        code2wav: Any,
        *,
        chunk_frames: int = CHUNK_FRAMES,
        first_chunk_frames: int | None = FIRST_CHUNK_FRAMES,
        growth: int = 1,
        segment_frames: int | None = SEGMENT_FRAMES,
        segment_context: int = SEGMENT_CONTEXT,
    ) -> None:
        if chunk_frames < 1:
            raise ValueError(f"chunk_frames must be >= 1, got {chunk_frames}")
        if first_chunk_frames is not None and first_chunk_frames < 1:
            raise ValueError(f"first_chunk_frames must be >= 1, got {first_chunk_frames}")
        if growth < 1:
            raise ValueError(f"growth must be >= 1, got {growth}")
        if segment_frames is not None and segment_frames < 1:
            raise ValueError(f"segment_frames must be >= 1, got {segment_frames}")
        if segment_context < 0:
            raise ValueError(f"segment_context must be >= 0, got {segment_context}")
        self.code2wav = code2wav
        self.config = code2wav.config
        self.device = next(code2wav.parameters()).device
        self.chunk_frames = chunk_frames
        self.first_chunk_frames = first_chunk_frames or chunk_frames
        self.growth = growth
        self.segment_frames = segment_frames
        self.segment_context = segment_context
        self.num_quantizers = self.config.num_quantizers
        self.codebook_size = self.config.codebook_size
        self.upsample = int(code2wav.total_upsample)
        self.convs = ConvStream(code2wav)
        with torch.no_grad():
            self.tail = self._measure_tail()

    @classmethod
    def from_pretrained(
        cls, model_path: str | Path, device: Any = "cpu", **options: Any
    ) -> Code2WavStreamer:
        """Loads only code2wav's tensors from the checkpoint directory `model_path`."""
        from .weights import load_submodule

        return cls(load_submodule(model_path, "code2wav", device), **options)

    # ---- per request ------------------------------------------------------------------

    def start(self) -> Code2WavState:
        return Code2WavState()

    def push(self, state: Code2WavState, frames: torch.Tensor) -> torch.Tensor:
        """Adds code frame(s): `(num_quantizers,)` for one, `(n, num_quantizers)` for several.
        Returns the samples this makes ready (often none)."""
        if state.finished:
            raise RuntimeError("frames pushed after flush")
        frames = torch.as_tensor(frames)
        if frames.ndim == 1:
            frames = frames.unsqueeze(0)
        if frames.ndim != 2 or frames.shape[1] != self.num_quantizers:
            raise ValueError(
                f"code frames must be ({self.num_quantizers},) or (n, {self.num_quantizers}), "
                f"got {tuple(frames.shape)}"
            )
        if frames.dtype not in (torch.int64, torch.int32) or (
            frames.numel()
            and not (0 <= int(frames.min()) and int(frames.max()) < self.codebook_size)
        ):
            raise ValueError(f"codes must be integers in [0, {self.codebook_size})")
        out = []
        for frame in frames.to(self.device, torch.long):
            if self._segment_full(state):  # its samples are all out: start the next one
                self._next_segment(state)
            state.window.append(frame)
            state.frames_in += 1
            new = len(state.window) - state.context - self._emitted_frames(state)
            due = chunk_due(state.chunks, self.first_chunk_frames, self.growth, self.chunk_frames)
            if new >= due or self._segment_full(state):
                out.append(self._emit(state))
        return self._cat(out)

    def flush(self, state: Code2WavState) -> torch.Tensor:
        """The samples of every frame not yet emitted; the request's stream ends here."""
        out = self._emit(state) if state.window else self._cat([])
        state.finished = True
        self.release(state)
        return out

    def release(self, state: Code2WavState) -> None:
        """Drops the request's cache and buffers (at its end, or when it is aborted)."""
        state.window = []
        state.cache = None
        state.convs = {}

    # ---- decoding ---------------------------------------------------------------------

    def samples(self, frames: int) -> int:
        """Samples the decode of `frames` frames gives (0 for none)."""
        return max(frames * self.upsample - self.tail, 0)

    def _segment_full(self, state: Code2WavState) -> bool:
        return (
            self.segment_frames is not None
            and len(state.window) - state.context >= self.segment_frames
        )

    def _emitted_frames(self, state: Code2WavState) -> int:
        """Frames of the window (after its context) whose samples have all been emitted."""
        return max((state.emitted + self.tail) // self.upsample - state.context, 0)

    def _next_segment(self, state: Code2WavState) -> None:
        """Starts the next segment as the reference's chunked_decode does: its left context
        is the last `segment_context` frames (fewer only if the stream is shorter)."""
        start = state.segment_start + len(state.window) - state.context
        context = self.segment_context if start - self.segment_context > 0 else start
        state.window = state.window[len(state.window) - context :] if context else []
        state.context = context
        state.segment_start = start
        state.cache = None
        state.convs = {}
        state.fed = 0
        state.emitted = context * self.upsample  # the context's samples are dropped

    def _emit(self, state: Code2WavState) -> torch.Tensor:
        """Runs the transformer and the convolutions over the window's new frames; returns
        the samples they complete (less any of the segment's context)."""
        c2w = self.code2wav
        n = len(state.window)
        if state.fed == n:
            return self._cat([])
        with torch.inference_mode():
            codes = torch.stack(state.window[state.fed :], dim=-1).unsqueeze(0)  # (1, Q, new)
            embeds = c2w.code_embedding(codes + c2w.code_offset).mean(1)
            if state.cache is None:
                state.cache = DynamicCache(config=self.config)
            hidden = c2w.pre_transformer(
                inputs_embeds=embeds, past_key_values=state.cache, use_cache=True
            ).last_hidden_state.permute(0, 2, 1)
            wav = self.convs(state.convs, hidden)[0, 0]
        # The convolutions have now given samples(n) of the segment window's samples.
        start, end = self.samples(state.fed), self.samples(n)
        if wav.shape[0] != end - start:
            raise AssertionError("code2wav streamer: the convolutions gave an unexpected length")
        state.fed = n
        out = wav[max(state.emitted - start, 0) :]
        state.emitted = max(state.emitted, end)
        state.samples_out += out.shape[0]
        state.chunks += 1
        return out.float()

    def _measure_tail(self) -> int:
        """Samples a decode drops at its end (`d`, see the module docstring): what the
        convolution stack gives for a few frames of zeros, against frames * upsample."""
        frames = 8
        p = next(self.code2wav.parameters())
        hidden = torch.zeros((1, self.config.hidden_size, frames), dtype=p.dtype, device=p.device)
        return frames * self.upsample - self.convs({}, hidden).shape[-1]

    def _cat(self, parts: list[torch.Tensor]) -> torch.Tensor:
        parts = [p for p in parts if p.numel()]
        if not parts:
            return torch.zeros(0, dtype=torch.float32, device=self.device)
        return parts[0] if len(parts) == 1 else torch.cat(parts)
