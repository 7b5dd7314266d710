"""pcm16 <-> float32, and the streaming resampler (rates, lengths, chunking, quality)."""

from __future__ import annotations

import numpy as np
import pytest

from omnirail.gateway.realtime.audio import (
    Resampler,
    float_to_pcm16,
    ms_to_samples,
    pcm16_to_float,
    resample,
    samples_to_ms,
)

RATES = [(24000, 16000), (16000, 24000), (22050, 24000), (44100, 24000), (8000, 24000)]


def test_pcm16_round_trip_is_exact() -> None:
    every = np.arange(-32768, 32768, dtype="<i2").tobytes()
    samples = pcm16_to_float(every)
    assert samples.dtype == np.float32 and samples.min() == -1.0 and samples.max() < 1.0
    assert float_to_pcm16(samples) == every


def test_float_to_pcm16_clips_and_zeroes_nan() -> None:
    out = np.frombuffer(float_to_pcm16(np.array([2.0, -3.0, np.nan, 0.5])), "<i2")
    assert out.tolist() == [32767, -32768, 0, 16384]


def test_odd_byte_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="whole number of samples"):
        pcm16_to_float(b"\x00\x00\x00")


def test_ms_conversions() -> None:
    assert ms_to_samples(1000) == 24000 and samples_to_ms(2400) == 100
    assert ms_to_samples(32, 16000) == 512 and samples_to_ms(23) == 0


@pytest.mark.parametrize(("src", "dst"), RATES)
def test_length_is_the_rate_ratio_rounded_up(src: int, dst: int) -> None:
    for n in (0, 1, 2, 3, 999, 12345):
        out = resample(np.ones(n, np.float32), src, dst)
        assert len(out) == -(-n * dst // src)


@pytest.mark.parametrize(("src", "dst"), RATES)
def test_streaming_gives_what_one_call_gives(src: int, dst: int) -> None:
    rng = np.random.default_rng(7)
    signal = rng.standard_normal(20000).astype(np.float32)
    whole = resample(signal, src, dst)
    for seed in range(3):
        sizes = np.random.default_rng(seed).integers(1, 900, size=100)
        stream = Resampler(src, dst)
        pieces, at = [], 0
        for size in sizes:
            pieces.append(stream.process(signal[at : at + size]))
            at += size
        pieces.append(stream.process(signal[at:]))
        pieces.append(stream.flush())
        assert np.array_equal(np.concatenate(pieces), whole)


@pytest.mark.parametrize(("src", "dst"), RATES)
def test_a_tone_keeps_its_shape_and_timing(src: int, dst: int) -> None:
    # Centred filter: output sample n is the input at time n / dst, with no delay.
    t_in = np.arange(src) / src
    out = resample(np.sin(2 * np.pi * 1000 * t_in), src, dst)
    t_out = np.arange(len(out)) / dst
    inner = slice(100, -100)  # away from the zero padding at both ends
    error = np.abs(out - np.sin(2 * np.pi * 1000 * t_out))[inner]
    assert error.max() < 1e-3


def test_downsampling_removes_what_the_lower_rate_cannot_hold() -> None:
    t = np.arange(24000) / 24000
    aliased = resample(np.sin(2 * np.pi * 10000 * t), 24000, 16000)  # above 8 kHz
    assert np.sqrt(np.mean(aliased[100:-100] ** 2)) < 1e-3


def test_down_and_up_again_keeps_speech_band_audio() -> None:
    rng = np.random.default_rng(1)
    t = np.arange(24000) / 24000
    freqs = rng.uniform(100, 6000, size=20)
    signal = sum(np.sin(2 * np.pi * f * t + rng.uniform(0, 6)) for f in freqs) / 20
    back = resample(resample(signal, 24000, 16000), 16000, 24000)
    assert len(back) == len(signal)
    assert np.abs(back - signal)[200:-200].max() < 5e-3


def test_same_rate_passes_through() -> None:
    x = np.linspace(-1, 1, 100, dtype=np.float32)
    stream = Resampler(24000, 24000)
    assert np.array_equal(stream.process(x), x) and len(stream.flush()) == 0


def test_bad_use() -> None:
    with pytest.raises(ValueError):
        Resampler(0, 16000)
    stream = Resampler(24000, 16000)
    stream.flush()
    with pytest.raises(RuntimeError):
        stream.process(np.zeros(10))
