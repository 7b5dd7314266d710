"""`preprocessing`: checks a request's inputs and turns them into model inputs.

text → token ids; image (HxWx3 or 3xHxW, uint8 or float in [0, 1]) → 8x8 patches;
audio (mono PCM at 16 kHz, float in [-1, 1] or int16) → log-magnitude frames (25 ms
windows every 10 ms). It routes to the encoders a request needs and always to
`mm_aggregate`, so a text-only request never touches an encoder.

For command-line demos an image or audio input may also be the string "synthetic": a
deterministic test pattern (a colour gradient, a chirp), not a real picture or recording.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from omnirail.models.fanin import needed_encoders
from omnirail.stage import InputError

from .text import tokenize

SAMPLE_RATE = 16000
PATCH = 8
MAX_TEXT = 4000
MAX_NEW_TOKENS = 256
_FRAME, _HOP = 400, 160  # 25 ms windows every 10 ms at 16 kHz
_MAX_IMAGE_SIDE = 1024
_MAX_AUDIO_S = 60
_KNOWN = {"text", "image", "audio", "max_new_tokens", "speak", "seed", "temperature"}


def create_preprocessing(
    max_new_tokens: int = 24, image_size: int = 64
) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """`max_new_tokens`: the default when a request sets none; `image_size`: the side
    images are resized to (a multiple of 8)."""
    if image_size % PATCH or not PATCH <= image_size <= _MAX_IMAGE_SIDE:
        raise ValueError(f"image_size must be a multiple of {PATCH} within 8..1024")

    def preprocess(inputs: Any) -> dict[str, Any]:
        if not isinstance(inputs, dict):
            raise InputError(f"inputs: expected an object, got {type(inputs).__name__}")
        unknown = sorted(map(str, set(inputs) - _KNOWN))
        if unknown:
            names = [str(name)[:40] for name in unknown[:5]]
            more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
            raise InputError(
                f"inputs: unknown fields {names}{more}; expected some of {sorted(_KNOWN)}"
            )
        text = inputs.get("text")
        if not isinstance(text, str) or not text.strip():
            raise InputError("inputs.text: required, a non-empty string")
        if len(text) > MAX_TEXT:
            raise InputError(f"inputs.text: at most {MAX_TEXT} characters, got {len(text)}")
        out: dict[str, Any] = {
            "text": text,
            "tokens": torch.tensor(tokenize(text), dtype=torch.int64),
            "options": _options(inputs, max_new_tokens),
            "has_image": False,
            "has_audio": False,
        }
        if inputs.get("image") is not None:
            out["patches"] = _patches(_image(inputs["image"], image_size))
            out["has_image"] = True
        if inputs.get("audio") is not None:
            out["frames"] = _frames(_audio(inputs["audio"]))
            out["has_audio"] = True
        return out

    return preprocess


def _options(inputs: dict[str, Any], default_tokens: int) -> dict[str, Any]:
    n = inputs.get("max_new_tokens", default_tokens)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_NEW_TOKENS:
        raise InputError(f"inputs.max_new_tokens: an integer within 1..{MAX_NEW_TOKENS}")
    speak = inputs.get("speak", True)
    if not isinstance(speak, bool):
        raise InputError("inputs.speak: true or false")
    seed = inputs.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise InputError("inputs.seed: a non-negative integer")
    temperature = inputs.get("temperature", 0.8)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise InputError("inputs.temperature: a number")
    if not 0.0 <= float(temperature) <= 5.0:
        raise InputError("inputs.temperature: within 0..5 (0: greedy)")
    return {"max_new_tokens": n, "speak": speak, "seed": seed, "temperature": float(temperature)}


def _image(value: Any, size: int) -> torch.Tensor:
    """3 x size x size float32 in [0, 1]."""
    if isinstance(value, str):
        if value != "synthetic":
            raise InputError('inputs.image: an array, or the string "synthetic"')
        ramp = torch.linspace(0.0, 1.0, size)
        return torch.stack(
            [
                ramp[None, :].expand(size, size),
                ramp[:, None].expand(size, size),
                (ramp[None, :] * ramp[:, None]),
            ]
        )
    arr = _array(value, "inputs.image")
    if arr.ndim != 3 or 3 not in (arr.shape[0], arr.shape[-1]):
        raise InputError(f"inputs.image: expected HxWx3 or 3xHxW, got shape {list(arr.shape)}")
    if max(arr.shape) > 4096:
        raise InputError(f"inputs.image: at most 4096 pixels a side, got {list(arr.shape)}")
    img = torch.from_numpy(np.ascontiguousarray(arr)).float()
    if arr.shape[0] != 3:
        img = img.permute(2, 0, 1)
    if arr.dtype == np.uint8:
        img = img / 255.0
    if not bool(torch.isfinite(img).all()):
        raise InputError("inputs.image: holds NaN or infinite values")
    img = torch.nn.functional.interpolate(img[None], size=(size, size), mode="bilinear")
    return img[0].clamp(0.0, 1.0)


def _audio(value: Any) -> torch.Tensor:
    """Mono float32 PCM at 16 kHz in [-1, 1]."""
    if isinstance(value, str):
        if value != "synthetic":
            raise InputError('inputs.audio: an array, or the string "synthetic"')
        t = torch.arange(SAMPLE_RATE, dtype=torch.float32) / SAMPLE_RATE  # one second
        return 0.5 * torch.sin(2 * math.pi * (220.0 + 220.0 * t) * t)
    arr = _array(value, "inputs.audio")
    if arr.ndim != 1:
        raise InputError(f"inputs.audio: expected mono samples (1-D), got shape {list(arr.shape)}")
    if not 0 < arr.shape[0] <= _MAX_AUDIO_S * SAMPLE_RATE:
        raise InputError(f"inputs.audio: 1 sample to {_MAX_AUDIO_S} s at {SAMPLE_RATE} Hz")
    pcm = torch.from_numpy(np.ascontiguousarray(arr)).float()
    if arr.dtype == np.int16:
        pcm = pcm / 32768.0
    if not bool(torch.isfinite(pcm).all()):
        raise InputError("inputs.audio: holds NaN or infinite values")
    return pcm.clamp(-1.0, 1.0)


def _array(value: Any, field: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if not isinstance(value, np.ndarray):
        raise InputError(f"{field}: expected an array, got {type(value).__name__}")
    if value.dtype.kind not in "uif":
        raise InputError(f"{field}: expected numbers, got dtype {value.dtype}")
    return value


def _patches(img: torch.Tensor) -> torch.Tensor:
    """(H/8 · W/8) x 192: each row one 8x8 RGB patch."""
    c, h, w = img.shape
    p = img.reshape(c, h // PATCH, PATCH, w // PATCH, PATCH).permute(1, 3, 0, 2, 4)
    return p.reshape(-1, c * PATCH * PATCH).contiguous()


def _frames(pcm: torch.Tensor) -> torch.Tensor:
    """T x 64 log-magnitude spectra (the first 64 bins of a Hann-windowed FFT)."""
    if pcm.numel() < _FRAME:
        pcm = torch.nn.functional.pad(pcm, (0, _FRAME - pcm.numel()))
    spec = torch.stft(
        pcm, n_fft=_FRAME, hop_length=_HOP, window=torch.hann_window(_FRAME), return_complex=True
    )
    return torch.log1p(spec.abs()[:64].T).contiguous()


# ---- routing hooks (named by pipeline.yaml) -----------------------------------------


def route(request_id: str, output: dict[str, Any]) -> list[str]:
    """The encoders this request needs, and always the aggregator."""
    return ["mm_aggregate", *needed_encoders(output)]


def to_image_encoder(payload: dict[str, Any]) -> dict[str, Any]:
    return {"patches": payload["patches"]}


def to_audio_encoder(payload: dict[str, Any]) -> dict[str, Any]:
    return {"frames": payload["frames"]}


def to_mm_aggregate(payload: dict[str, Any]) -> dict[str, Any]:
    keys = ("text", "tokens", "options", "has_image", "has_audio")
    return {k: payload[k] for k in keys}


def terminal_stages(request_id: str, inputs: dict[str, Any]) -> list[str] | None:
    """Text only when the request says `"speak": false`; text and audio otherwise.

    A malformed `speak` is left to `preprocessing`, which fails the request naming it.
    """
    speak = inputs.get("speak", True) if isinstance(inputs, dict) else True
    if speak is False:
        return ["decode"]
    return ["decode", "code2wav"]
