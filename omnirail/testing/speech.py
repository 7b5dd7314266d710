"""Synthetic speech for voice tests and `omnirail bench realtime`: nothing is recorded or
downloaded, and no TTS engine is needed (espeak-ng is not installed here).

What Silero VAD takes for speech (found by trying): vowel-like sounds, that is a glottal
source (harmonics of a pitch of 110-150 Hz that drifts and falls through each syllable)
shaped by the first three formants of a vowel, in syllables of 120-250 ms with short
noise bursts (consonants) between them. It scores that 0.6-1.0 from the first 32 ms
window. What it does not take for speech: silence, white noise at the same level, a pure
tone, and an amplitude-modulated tone (at most ~0.3).
"""

from __future__ import annotations

import numpy as np

# First three formants (Hz) of five vowels, from Peterson and Barney's averages.
_VOWELS = (
    (730, 1090, 2440),
    (270, 2290, 3010),
    (300, 870, 2240),
    (530, 1840, 2480),
    (570, 840, 2410),
)
_BANDWIDTHS = (80, 100, 120)


def _syllable(
    seconds: float, f0: float, vowel: tuple[int, ...], rate: int, rng: np.random.Generator
) -> np.ndarray:
    n = int(seconds * rate)
    drift = 1 + 0.01 * rng.standard_normal(n).cumsum() / np.sqrt(n)
    pitch = np.linspace(f0, f0 * rng.uniform(0.85, 1.05), n) * drift
    phase = 2 * np.pi * np.cumsum(pitch) / rate
    out = np.zeros(n)
    for k in range(1, 40):
        freq = k * pitch
        gain = sum(1 / (1 + ((freq - f) / b) ** 2) for f, b in zip(vowel, _BANDWIDTHS, strict=True))
        out += gain / np.sqrt(k) * (freq < 0.45 * rate) * np.sin(k * phase)
    return out * np.sin(np.pi * np.arange(n) / n) ** 0.5


def speech(seconds: float, rate: int = 24000, seed: int = 0, peak: float = 0.3) -> np.ndarray:
    """`seconds` of speech-like audio (float32, peak `peak`), the same for the same seed."""
    rng = np.random.default_rng(seed)
    parts: list[np.ndarray] = []
    total = 0
    while total < seconds * rate:
        vowel = _VOWELS[int(rng.integers(len(_VOWELS)))]
        parts.append(_syllable(rng.uniform(0.12, 0.25), rng.uniform(110, 150), vowel, rate, rng))
        burst = int(rng.uniform(0.03, 0.07) * rate)
        parts.append(0.05 * rng.standard_normal(burst) * np.hanning(burst))
        total += len(parts[-2]) + burst
    out = np.concatenate(parts)[: int(seconds * rate)]
    return (peak * out / np.max(np.abs(out))).astype(np.float32)


def silence(seconds: float, rate: int = 24000) -> np.ndarray:
    return np.zeros(int(seconds * rate), dtype=np.float32)
