"""Audio of the Realtime API: pcm16 mono at 24 kHz on the wire, float32 inside.

- `pcm16_to_float` / `float_to_pcm16` convert between little-endian int16 bytes and float32
  in [-1, 1). Both scale by 32768, so int16 -> float -> int16 is the identity (the HTTP
  gateway's `pcm16` scales by 32767, which is symmetric but not an exact round trip).
- `Resampler` converts between sample rates as a stream: fed chunks of any length, it
  gives exactly what one call on the whole signal gives (the same samples, bit for bit),
  once `flush()` has been called. It is a polyphase windowed-sinc filter (Kaiser window)
  in numpy: no resampling library is installed here (no scipy, soxr or torchaudio; see
  scripts/setup.sh for why torchaudio is removed).
- `model_pcm16` is the audio a model that takes `rate` Hz hears for a user turn: the turn's
  24 kHz pcm16 resampled and quantized back to 16-bit PCM, which is exactly what a 16-bit
  WAV at `rate` in a chat API `input_audio` part carries (the gateway reads both as
  int16 / 32768), so the same turn sent either way reaches the model bit for bit.
- The filter is centred (zero phase): output sample n sits at input time n * src / dst
  exactly, so times in milliseconds mean the same in both rates. The price is latency: a
  sample is given out once `HALF_WIDTH` input samples after it have arrived (1 ms at 24 kHz
  -> 16 kHz).
"""

from __future__ import annotations

from functools import cache
from math import ceil, gcd

import numpy as np

WIRE_RATE = 24000  # the Realtime API's pcm16 rate, both directions
VAD_RATE = 16000  # Silero VAD's (and the mesh's speech encoders') rate
BYTES_PER_SAMPLE = 2

# Zero crossings of the sinc on each side of a tap: 16 gives > 80 dB stop band with
# the Kaiser window below, at 32 multiply-adds per output sample for upsampling.
_ZERO_CROSSINGS = 16
_KAISER_BETA = 8.6
# Cutoff as a fraction of the lower Nyquist frequency: the transition band sits just
# below it, so what is aliased is attenuated by the stop band.
_ROLLOFF = 0.94


def pcm16_to_float(data: bytes) -> np.ndarray:
    """int16 little-endian bytes (an even number of them) -> float32 samples in [-1, 1)."""
    if len(data) % BYTES_PER_SAMPLE:
        raise ValueError(f"pcm16: {len(data)} bytes is not a whole number of samples")
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / np.float32(32768.0)


def float_to_pcm16(samples: np.ndarray) -> bytes:
    """Float samples -> int16 little-endian bytes: scaled by 32768, rounded, clipped to the
    int16 range; NaN becomes 0."""
    array = np.nan_to_num(np.asarray(samples, dtype=np.float64).reshape(-1), nan=0.0)
    scaled = np.clip(np.rint(array * 32768.0), -32768, 32767)
    return scaled.astype("<i2").tobytes()


def samples_to_ms(samples: int, rate: int = WIRE_RATE) -> int:
    """Whole milliseconds in `samples` samples (rounded down)."""
    return samples * 1000 // rate


def ms_to_samples(ms: int, rate: int = WIRE_RATE) -> int:
    """Samples in `ms` milliseconds (rounded down)."""
    return ms * rate // 1000


@cache
def _design(up: int, down: int) -> tuple[np.ndarray, int]:
    """The polyphase filter for a rate change by up/down (reduced): one row of taps per
    output phase, each row summing to 1 (unit gain at DC), and the half width in input
    samples."""
    # Cutoff in cycles per input sample: below the lower of the two Nyquist rates.
    cutoff = 0.5 * min(1.0, up / down) * _ROLLOFF
    half = ceil(_ZERO_CROSSINGS / (2 * cutoff) / 2)
    # Output phase p sits p/up of an input sample past its base tap (n*down = base*up + p).
    offsets = np.arange(-half + 1, half + 1)[None, :] - (np.arange(up)[:, None] / up)
    taps = 2 * cutoff * np.sinc(2 * cutoff * offsets)
    taps *= _window(offsets, half)
    taps /= taps.sum(axis=1, keepdims=True)
    return taps.astype(np.float64), half


def _window(offsets: np.ndarray, half: int) -> np.ndarray:
    """A Kaiser window evaluated at fractional offsets in (-half, half]."""
    ratio = np.clip(offsets / half, -1.0, 1.0)
    return np.i0(_KAISER_BETA * np.sqrt(1.0 - ratio**2)) / np.i0(_KAISER_BETA)


class Resampler:
    """A streaming resampler from `src_rate` to `dst_rate` (mono float32).

    After `process(a)`, `process(b)`, `flush()` the outputs concatenated equal
    `resample(concat(a, b), src, dst)`: ceil(len * dst / src) samples, the first at input
    time 0. Between calls it keeps at most 2 * half-width input samples.
    """

    def __init__(self, src_rate: int, dst_rate: int) -> None:
        if src_rate <= 0 or dst_rate <= 0:
            raise ValueError(f"sample rates must be positive, got {src_rate} -> {dst_rate}")
        self.src_rate = src_rate
        self.dst_rate = dst_rate
        g = gcd(src_rate, dst_rate)
        self._up = dst_rate // g
        self._down = src_rate // g
        self._taps, self._half = (
            (None, 0) if self._up == self._down else _design(self._up, self._down)
        )
        # The input kept, and the absolute input index of its first sample. The signal
        # is taken as zero before index 0 and (at flush) after its end.
        self._buffer = np.zeros(self._half, dtype=np.float64)
        self._start = -self._half
        self._received = 0  # input samples seen
        self._produced = 0  # output samples given out
        self._flushed = False

    def process(self, samples: np.ndarray) -> np.ndarray:
        """Feed input samples; returns the output samples they complete (float32)."""
        if self._flushed:
            raise RuntimeError("Resampler: process() after flush()")
        x = np.asarray(samples, dtype=np.float64).reshape(-1)
        if self._taps is None:
            self._received += x.size
            self._produced += x.size
            return x.astype(np.float32)
        self._buffer = np.concatenate([self._buffer, x])
        self._received += x.size
        # Output n needs input up to base(n) + half, base(n) = n * down // up: so those
        # with n * down < (received - half) * up are ready.
        ready = -(-(self._received - self._half) * self._up // self._down)
        return self._emit(ready)

    def flush(self) -> np.ndarray:
        """The outputs still held back (the input is padded with zeros); ends the stream."""
        if self._flushed:
            return np.zeros(0, dtype=np.float32)
        self._flushed = True
        if self._taps is None:
            return np.zeros(0, dtype=np.float32)
        self._buffer = np.concatenate([self._buffer, np.zeros(self._half + 1)])
        total = -(-self._received * self._up // self._down)  # ceil
        return self._emit(total)

    def _emit(self, upto: int) -> np.ndarray:
        count = upto - self._produced
        if count <= 0:
            return np.zeros(0, dtype=np.float32)
        assert self._taps is not None
        n = np.arange(self._produced, upto)
        base, phase = np.divmod(n * self._down, self._up)
        # Taps base-half+1 .. base+half, as indices into the kept buffer.
        first = base - self._half + 1 - self._start
        index = first[:, None] + np.arange(2 * self._half)[None, :]
        out = np.einsum("ij,ij->i", self._buffer[index], self._taps[phase])
        self._produced = upto
        # Keep what the next output's first tap needs.
        next_first = (upto * self._down) // self._up - self._half + 1
        drop = max(0, next_first - self._start)
        self._buffer = self._buffer[drop:]
        self._start += drop
        return out.astype(np.float32)


def resample(samples: np.ndarray, src_rate: int, dst_rate: int) -> np.ndarray:
    """The whole signal at another rate: ceil(len * dst / src) float32 samples."""
    stream = Resampler(src_rate, dst_rate)
    head = stream.process(samples)
    return np.concatenate([head, stream.flush()])


def model_pcm16(pcm: bytes, rate: int) -> bytes:
    """A user turn's audio (pcm16 at 24 kHz) as the model at `rate` Hz hears it: 16-bit
    PCM at `rate` (`float_to_pcm16(resample(pcm16_to_float(pcm), 24000, rate))`). The
    model gets `pcm16_to_float` of it; a chat client that sends these samples as a 16-bit
    WAV at `rate` gets the same floats to the model."""
    return float_to_pcm16(resample(pcm16_to_float(pcm), WIRE_RATE, rate))
