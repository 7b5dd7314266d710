"""PCM for HTTP clients: float samples to 16-bit little-endian, and WAV headers."""

from __future__ import annotations

import io
import struct
import wave

import numpy as np
import pytest

from omnirail.gateway.audio import FORMATS, pcm16, wav, wav_header


def _samples(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype="<i2").tolist()


def test_pcm16_scales_floats() -> None:
    assert _samples(pcm16([0.0, 1.0, -1.0, 0.5])) == [0, 32767, -32767, 16384]


def test_pcm16_clips_floats() -> None:
    assert _samples(pcm16(np.array([2.0, -3.5, np.inf, -np.inf], np.float32))) == [
        32767,
        -32767,
        32767,
        -32767,
    ]


def test_pcm16_nan_is_silence() -> None:
    assert _samples(pcm16(np.array([np.nan, 0.25]))) == [0, 8192]


def test_pcm16_passes_ints_through() -> None:
    assert _samples(pcm16(np.array([1, -2, 32767, -32768], np.int32))) == [1, -2, 32767, -32768]


def test_pcm16_flattens_and_is_little_endian() -> None:
    data = pcm16(np.array([[1], [256]], np.int16))
    assert data == b"\x01\x00\x00\x01"


def test_pcm16_empty() -> None:
    assert pcm16(np.zeros(0, np.float32)) == b""


def test_wav_reads_back_with_the_wave_module() -> None:
    pcm = pcm16(np.linspace(-1, 1, 101))
    with wave.open(io.BytesIO(wav(pcm, 24000))) as w:
        params = (w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes())
        frames = w.readframes(w.getnframes())
    assert params == (1, 2, 24000, 101)
    assert frames == pcm


def test_wav_has_exact_sizes() -> None:
    data = wav(b"\x00\x00" * 10, 16000)
    assert len(data) == 44 + 20
    assert struct.unpack_from("<I", data, 4)[0] == 36 + 20
    assert struct.unpack_from("<I", data, 40)[0] == 20


def test_streamed_header_says_unknown_length() -> None:
    header = wav_header(16000)
    assert len(header) == 44
    assert header[:4] == b"RIFF" and header[8:16] == b"WAVEfmt " and header[36:40] == b"data"
    assert struct.unpack_from("<I", header, 4)[0] == 0xFFFFFFFF
    assert struct.unpack_from("<I", header, 40)[0] == 0xFFFFFFFF


@pytest.mark.parametrize(("rate", "channels"), [(16000, 1), (48000, 2)])
def test_header_format_chunk(rate: int, channels: int) -> None:
    fmt = struct.unpack_from("<IHHIIHH", wav_header(rate, 0, channels), 16)
    assert fmt == (16, 1, channels, rate, rate * 2 * channels, 2 * channels, 16)


def test_formats_are_the_http_media_types() -> None:
    assert FORMATS["wav"] == "audio/wav" and FORMATS["pcm16"] == FORMATS["pcm"] == "audio/pcm"
