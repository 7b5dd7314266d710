"""PCM for HTTP clients: float samples to 16-bit little-endian, and WAV headers.

A streamed WAV starts with a header whose sizes say "unknown length" (0xFFFFFFFF, as
ffmpeg and most streaming servers write): the total is not known until the stream ends.
A complete WAV (a non-streamed answer) has exact sizes.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

FORMATS = {"wav": "audio/wav", "pcm16": "audio/pcm", "pcm": "audio/pcm"}
_UNKNOWN = 0xFFFFFFFF


def pcm16(samples: Any) -> bytes:
    """Samples as int16 LE: floats are clipped to [-1, 1] and scaled; ints pass through."""
    array = np.asarray(samples).reshape(-1)
    if array.dtype.kind == "f":
        array = np.clip(np.nan_to_num(array, nan=0.0), -1.0, 1.0) * 32767.0
        array = np.rint(array)
    return array.astype("<i2").tobytes()


def wav_header(sample_rate: int, data_bytes: int | None = None, channels: int = 1) -> bytes:
    """A 44-byte RIFF/WAVE header for 16-bit PCM; `data_bytes` None: a streamed file."""
    block = 2 * channels
    riff = _UNKNOWN if data_bytes is None else 36 + data_bytes
    data = _UNKNOWN if data_bytes is None else data_bytes
    return (
        b"RIFF"
        + struct.pack("<I", riff)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, channels, sample_rate, sample_rate * block, block, 16)
        + b"data"
        + struct.pack("<I", data)
    )


def wav(pcm: bytes, sample_rate: int) -> bytes:
    """A complete WAV file of 16-bit mono PCM."""
    return wav_header(sample_rate, len(pcm)) + pcm
