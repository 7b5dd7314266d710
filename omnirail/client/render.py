"""What `omnirail run/generate --stream` shows: text as it decodes, audio into a WAV file.

Chunks with modality "text" are printed as they arrive, without newlines of their own;
"audio" chunks (float PCM in [-1, 1] or int16, 1-D mono or channels x samples, either bare
or as `{"pcm": ..., "sample_rate": N}`) are appended to a 16-bit WAV file as they arrive,
so the file is playable up to the last chunk even if the request fails later; any other
chunk is printed as one JSON line. `--jsonl` prints every chunk as a JSON line instead.
"""

from __future__ import annotations

import json
import sys
import time
import wave
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from omnirail.client.jsonio import to_jsonable

DEFAULT_SAMPLE_RATE = 16000


@dataclass
class StreamStats:
    """Timings of one streamed request, in seconds from when it was sent."""

    first_chunk_s: float | None = None
    first_text_s: float | None = None
    first_audio_s: float | None = None
    audio_samples: int = 0
    sample_rate: int | None = None
    chunks: dict[str, int] = field(default_factory=dict)

    @property
    def audio_seconds(self) -> float:
        return self.audio_samples / self.sample_rate if self.sample_rate else 0.0


class WavSink:
    """Appends PCM chunks to a WAV file, fixing rate and channels from the first one."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._wav: wave.Wave_write | None = None
        self.rate: int | None = None
        self.channels: int | None = None
        self.frames = 0

    def write(self, data: Any) -> int:
        """Appends one chunk; returns its sample frames. ValueError on a malformed chunk."""
        pcm, rate = pcm_of(data)
        channels = 1 if pcm.ndim == 1 else pcm.shape[0]
        if self._wav is None:
            self._wav = wave.open(str(self.path), "wb")
            self._wav.setnchannels(channels)
            self._wav.setsampwidth(2)
            self._wav.setframerate(rate)
            self.rate, self.channels = rate, channels
        elif (rate, channels) != (self.rate, self.channels):
            raise ValueError(
                f"audio chunk at {rate} Hz x {channels} channels after {self.rate} Hz x "
                f"{self.channels}"
            )
        frames = pcm if pcm.ndim == 1 else pcm.T  # WAV interleaves channels
        self._wav.writeframes(np.ascontiguousarray(frames).astype("<i2").tobytes())
        n = pcm.shape[-1]
        self.frames += n
        return n

    def close(self) -> None:
        if self._wav is not None:
            self._wav.close()
            self._wav = None

    def __enter__(self) -> WavSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def pcm_of(data: Any) -> tuple[np.ndarray, int]:
    """An audio chunk's int16 samples (1-D, or channels x samples) and sample rate."""
    rate = DEFAULT_SAMPLE_RATE
    if isinstance(data, dict):
        if "pcm" not in data:
            raise ValueError(f"audio chunk: expected a 'pcm' field, got {sorted(data)}")
        rate = data.get("sample_rate", rate)
        if isinstance(rate, bool) or not isinstance(rate, int) or not 1 <= rate <= 1_000_000:
            raise ValueError(f"audio chunk: bad sample_rate {rate!r}")
        data = data["pcm"]
    arr = np.asarray(data)
    if arr.ndim not in (1, 2) or arr.dtype.kind not in "if":
        raise ValueError(f"audio chunk: expected 1-D or 2-D numbers, got {arr.dtype} {arr.shape}")
    if arr.dtype.kind == "f":
        arr = np.clip(np.nan_to_num(arr), -1.0, 1.0) * 32767.0
    return np.asarray(arr).astype(np.int16), rate


class StreamRenderer:
    """Shows one request's stream chunks as they come; see the module docstring."""

    def __init__(
        self,
        started: float,
        *,
        out: TextIO | None = None,
        err: TextIO | None = None,
        audio_out: str | None = None,
        jsonl: bool = False,
    ) -> None:
        self.started = started
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.audio_out = audio_out
        self.jsonl = jsonl
        self.stats = StreamStats()
        self.sink: WavSink | None = None
        self._mid_line = False  # text printed without a newline yet

    def chunk(self, chunk: Any) -> None:
        now = time.perf_counter() - self.started
        st = self.stats
        st.chunks[chunk.modality] = st.chunks.get(chunk.modality, 0) + 1
        if st.first_chunk_s is None:
            st.first_chunk_s = now
        if chunk.modality == "audio" and st.first_audio_s is None:
            st.first_audio_s = now
        if chunk.modality == "text" and st.first_text_s is None:
            st.first_text_s = now
        if chunk.modality == "audio" and not self.jsonl:
            self._audio(chunk)
        if self.jsonl or chunk.modality not in ("text", "audio"):
            self._end_line()
            line = {
                "t_ms": round(now * 1000, 1),
                "stage": chunk.stage,
                "chunk_id": chunk.chunk_id,
                "modality": chunk.modality,
                "data": to_jsonable(chunk.data),
            }
            print(json.dumps(line), file=self.out, flush=True)
        elif chunk.modality == "text":
            self.out.write(str(chunk.data))
            self.out.flush()
            self._mid_line = True

    def _audio(self, chunk: Any) -> None:
        if self.sink is None:
            path = self.audio_out or f"omnirail-{chunk.request_id}.wav"
            self.sink = WavSink(Path(path))
        try:
            self.stats.audio_samples += self.sink.write(chunk.data)
            self.stats.sample_rate = self.sink.rate
        except ValueError as exc:
            print(f"[omnirail] skipped {exc}", file=self.err, flush=True)

    def _end_line(self) -> None:
        if self._mid_line:
            self.out.write("\n")
            self._mid_line = False

    def close(self) -> None:
        """Ends the text line and the WAV file (call once the stream is over)."""
        self._end_line()
        if self.sink is not None:
            self.sink.close()

    def summary(self, total_s: float) -> str:
        """One line for stderr: first text/audio times, audio length and real-time factor."""
        st = self.stats
        parts = []
        if st.first_text_s is not None:
            parts.append(f"first text {st.first_text_s * 1000:.0f} ms")
        if st.first_audio_s is not None:
            parts.append(f"first audio {st.first_audio_s * 1000:.0f} ms")
        if self.sink is not None and st.audio_seconds > 0:
            parts.append(
                f"{st.audio_seconds:.2f} s of audio in {self.sink.path} "
                f"(real-time factor {total_s / st.audio_seconds:.3f})"
            )
        counts = ", ".join(f"{n} {m}" for m, n in sorted(st.chunks.items()))
        return f"stream: {counts or 'no chunks'}" + ("; " + "; ".join(parts) if parts else "")
