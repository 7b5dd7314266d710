"""`preprocessing`: a request's chat turn through Qwen3-Omni's own processor.

A request is a chat (`messages`, as in the chat template: roles and content parts) or the
shorthand `text` (+ `image`, `audio`, `sample_rate`) for one user turn. Every field is
checked and a bad one fails the request with a message naming it; the processor then
applies the chat template, tokenizes, computes Whisper features for audio (each audio with
silence up to a whole 10 ms frame, and its features as it alone gets them: the processor's
batch would make a shorter audio's depend on the others) and patches for images. The stage
routes a request to the encoders it needs and always to the thinker, so a text-only request
never touches an encoder.

Inputs:
- `messages`: `[{"role": "system"|"user"|"assistant", "content": str | [part, ...]}]`,
  parts `{"type": "text", "text": str}`, `{"type": "image", "image": HxWx3 uint8}`,
  `{"type": "audio", "audio": 1-D float PCM in [-1, 1], "sample_rate": 16000}`.
- `text`, `image`, `audio`, `sample_rate`: the same as one user turn (media first).
- `max_new_tokens` (1..`max_tokens_cap`, default the factory's), `speak` (default true:
  false skips the talker and code2wav).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from omnirail.models.fanin import needed_encoders
from omnirail.stage import InputError

from .processor import load_processor
from .weights import read_config

SAMPLE_RATE = 16_000  # what the processor's Whisper feature extractor takes
MAX_TEXT = 20_000
MAX_IMAGE_SIDE = 4096
MAX_AUDIO_S = 300
ROLES = ("system", "user", "assistant")
PART_TYPES = ("text", "image", "audio")
_SHORTHAND = {"text", "image", "audio", "sample_rate"}
_KNOWN = {"messages", "max_new_tokens", "speak", *_SHORTHAND}


def create_preprocessing(
    model_path: str, max_new_tokens: int = 64, max_tokens_cap: int = 4096
) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """`model_path`: the Hugging Face directory (its processor files); `max_new_tokens`: the
    default when a request sets none; `max_tokens_cap`: the most a request may ask for."""
    if not 1 <= max_new_tokens <= max_tokens_cap:
        raise ValueError(f"max_new_tokens must be within 1..{max_tokens_cap}")
    read_config(model_path)  # a directory of another architecture fails here, by name
    processor = load_processor(model_path)

    def preprocess(inputs: Any) -> dict[str, Any]:
        try:
            messages, options = parse_request(inputs, max_new_tokens, max_tokens_cap)
        except InputError:
            raise
        except ValueError as exc:  # the caller's input: INVALID_ARGUMENT, not INTERNAL
            raise InputError(str(exc)) from None
        return model_inputs(processor, messages, options)

    return preprocess


def parse_request(
    inputs: Any, default_tokens: int, cap: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages with checked parts, options); ValueError names the first bad field."""
    if not isinstance(inputs, dict):
        raise ValueError(f"inputs: expected an object, got {type(inputs).__name__}")
    unknown = set(inputs) - _KNOWN
    if unknown:
        raise ValueError(
            f"inputs: unknown fields {_names(unknown)}; expected some of {sorted(_KNOWN)}"
        )
    if "messages" in inputs:
        given = sorted(_SHORTHAND & set(inputs))
        if given:
            raise ValueError(f"inputs: give either messages or {given}, not both")
        messages = _messages(inputs["messages"])
    else:
        messages = [{"role": "user", "content": _shorthand(inputs)}]
    if not any(m["role"] == "user" for m in messages):
        raise ValueError("inputs.messages: needs at least one user turn")
    n = inputs.get("max_new_tokens", default_tokens)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= cap:
        raise ValueError(f"inputs.max_new_tokens: an integer within 1..{cap}, got {n!r}")
    speak = inputs.get("speak", True)
    if not isinstance(speak, bool):
        raise ValueError(f"inputs.speak: true or false, got {speak!r}")
    return messages, {"max_new_tokens": n, "speak": speak}


def model_inputs(
    processor: Any, messages: list[dict[str, Any]], options: dict[str, Any]
) -> dict[str, Any]:
    """The processor's tensors for `messages` (batch of one), the options, and which
    encoders the request needs."""
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    images = [p["image"] for m in messages for p in m["content"] if p["type"] == "image"]
    hop = processor.feature_extractor.hop_length
    audio = [
        _whole_frames(p["audio"], hop)
        for m in messages
        for p in m["content"]
        if p["type"] == "audio"
    ]
    batch = processor(
        text=text, images=images or None, audio=audio or None, return_tensors="pt", padding=True
    )
    out: dict[str, Any] = {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        "options": options,
        "has_image": bool(images),
        "has_audio": bool(audio),
    }
    if images:
        out["pixel_values"] = batch["pixel_values"]
        out["image_grid_thw"] = batch["image_grid_thw"]
    if audio:
        features, mask = batch["input_features"], batch["feature_attention_mask"]
        if len(audio) > 1:
            features, mask = _features_alone(processor, audio, features, mask)
        out["input_features"] = features
        out["feature_attention_mask"] = mask
    return out


def _whole_frames(audio: Any, hop: int) -> Any:
    """`audio` with silence up to a whole number of feature frames (`hop` samples, 10 ms):
    alone, a partial last frame is dropped, beside a longer audio it is counted, so without
    this an audio's frames, and tokens, would depend on the other audios of the prompt."""
    extra = -len(audio) % hop
    if not extra:
        return audio
    return np.concatenate([np.asarray(audio), np.zeros(extra, dtype=np.asarray(audio).dtype)])


def _features_alone(
    processor: Any, audio: list[Any], batched: torch.Tensor, batched_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each audio's Whisper features as it alone gets them, stacked as the processor stacks
    them. The processor pads the waveforms to the longest before the STFT, so a shorter
    audio's last frames see zeros where alone they see its own reflection: its features
    would then depend on the other audios of the prompt, and a conversation's history audio
    would change as turns are added (no kept turn would match it, `ThinkerRunner.keep`).
    The frame counts, and so the prompt's tokens, are the batch's."""
    extractor = processor.feature_extractor
    rate = extractor.sampling_rate
    alone = [
        extractor(
            [a],
            sampling_rate=rate,
            padding=True,
            truncation=False,
            return_attention_mask=True,
            return_tensors="pt",
        )
        for a in audio
    ]
    features = torch.zeros_like(batched)
    mask = torch.zeros_like(batched_mask)
    for i, one in enumerate(alone):
        frames = int(one["attention_mask"][0].sum())
        if frames != int(batched_mask[i].sum()):  # not expected: keep the processor's
            return batched, batched_mask
        features[i, :, :frames] = one["input_features"][0, :, :frames]
        mask[i, :frames] = 1
    return features, mask


# ---- checks ----------------------------------------------------------------------------


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise ValueError("inputs.messages: a non-empty list of {role, content}")
    out = []
    for i, message in enumerate(value):
        where = f"inputs.messages[{i}]"
        if not isinstance(message, dict) or set(message) - {"role", "content"}:
            raise ValueError(f"{where}: an object with role and content only")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}.role: one of {list(ROLES)}, got {role!r}")
        content = message.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list) or not content:
            raise ValueError(f"{where}.content: a string or a non-empty list of parts")
        parts = [_part(p, f"{where}.content[{j}]") for j, p in enumerate(content)]
        if role != "user" and any(p["type"] != "text" for p in parts):
            raise ValueError(f"{where}.content: only user turns may hold images or audio")
        out.append({"role": role, "content": parts})
    return out


def _shorthand(inputs: dict[str, Any]) -> list[dict[str, Any]]:
    parts = []
    if inputs.get("image") is not None:
        parts.append(_part({"type": "image", "image": inputs["image"]}, "inputs.image", "inputs"))
    if inputs.get("audio") is not None:
        audio = {"type": "audio", "audio": inputs["audio"]}
        if "sample_rate" in inputs:
            audio["sample_rate"] = inputs["sample_rate"]
        parts.append(_part(audio, "inputs.audio", "inputs"))
    elif "sample_rate" in inputs:
        raise ValueError("inputs.sample_rate: only with inputs.audio")
    parts.append(_part({"type": "text", "text": inputs.get("text")}, "inputs.text", "inputs"))
    return parts


def _names(keys: set[Any]) -> str:
    """Unknown field names for a message, bounded: the caller controls how many and how long."""
    names = sorted(str(key)[:40] for key in keys)
    more = f" and {len(names) - 5} more" if len(names) > 5 else ""
    return f"{names[:5]}{more}"


def _part(part: Any, where: str, prefix: str | None = None) -> dict[str, Any]:
    """A checked content part; `prefix` names its fields when the part is the shorthand."""
    if not isinstance(part, dict):
        raise ValueError(f"{where}: an object with a type, got {type(part).__name__}")
    kind = part.get("type")
    if kind not in PART_TYPES:
        raise ValueError(
            f"{where}.type: unknown content type {repr(kind)[:40]}"
            f" (expected one of {list(PART_TYPES)})"
        )
    field = (lambda name: f"{prefix}.{name}") if prefix else (lambda name: f"{where}.{name}")
    allowed = {"type", kind} | ({"sample_rate"} if kind == "audio" else set())
    extra = set(part) - allowed
    if extra:
        raise ValueError(f"{where}: unknown fields {_names(extra)} for a {kind} part")
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{field('text')}: required, a non-empty string")
        if len(text) > MAX_TEXT:
            raise ValueError(f"{field('text')}: at most {MAX_TEXT} characters, got {len(text)}")
        return {"type": "text", "text": text}
    if kind == "image":
        return {"type": "image", "image": _image(part.get("image"), field("image"))}
    rate = part.get("sample_rate", SAMPLE_RATE)
    if isinstance(rate, bool) or not isinstance(rate, int):
        raise ValueError(f"{field('sample_rate')}: an integer (Hz), got {rate!r}")
    if rate != SAMPLE_RATE:
        raise ValueError(
            f"{field('sample_rate')}: audio must be at {SAMPLE_RATE} Hz, got {rate} "
            "(resample it first)"
        )
    return {"type": "audio", "audio": _audio(part.get("audio"), field("audio"))}


def _array(value: Any, field: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if not isinstance(value, np.ndarray):
        raise ValueError(f"{field}: expected an array, got {type(value).__name__}")
    if value.dtype.kind not in "uif":
        raise ValueError(f"{field}: expected numbers, got dtype {value.dtype}")
    return value


def _image(value: Any, field: str) -> np.ndarray:
    """HxWx3 uint8 (floats in [0, 1] are scaled)."""
    arr = _array(value, field)
    if arr.ndim != 3 or arr.shape[-1] != 3:
        raise ValueError(f"{field}: expected an HxWx3 RGB image, got shape {list(arr.shape)}")
    if min(arr.shape[:2]) < 1 or max(arr.shape[:2]) > MAX_IMAGE_SIDE:
        raise ValueError(f"{field}: sides of 1..{MAX_IMAGE_SIDE} pixels, got {list(arr.shape)}")
    if arr.dtype == np.uint8:
        return np.ascontiguousarray(arr)
    if not np.isfinite(arr).all():
        raise ValueError(f"{field}: holds NaN or infinite values")
    if arr.dtype.kind == "f":
        return np.ascontiguousarray(np.clip(arr, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)
    return np.ascontiguousarray(np.clip(arr, 0, 255)).astype(np.uint8)


def _audio(value: Any, field: str) -> np.ndarray:
    """Mono float32 PCM in [-1, 1] (int16 is scaled)."""
    arr = _array(value, field)
    if arr.ndim != 1:
        raise ValueError(f"{field}: expected mono samples (1-D), got shape {list(arr.shape)}")
    if not 0 < arr.shape[0] <= MAX_AUDIO_S * SAMPLE_RATE:
        raise ValueError(f"{field}: 1 sample to {MAX_AUDIO_S} s at {SAMPLE_RATE} Hz")
    pcm = arr.astype(np.float32) / 32768.0 if arr.dtype == np.int16 else arr.astype(np.float32)
    if not np.isfinite(pcm).all():
        raise ValueError(f"{field}: holds NaN or infinite values")
    return np.clip(pcm, -1.0, 1.0)


# ---- routing hooks (named by pipeline.yaml) ---------------------------------------------


def route(request_id: str, output: dict[str, Any]) -> list[str]:
    """The encoders this request needs, and always the thinker."""
    return ["thinker", *needed_encoders(output)]


def to_image_encoder(payload: dict[str, Any]) -> dict[str, Any]:
    return {"pixel_values": payload["pixel_values"], "image_grid_thw": payload["image_grid_thw"]}


def to_audio_encoder(payload: dict[str, Any]) -> dict[str, Any]:
    return {
        "input_features": payload["input_features"],
        "feature_attention_mask": payload["feature_attention_mask"],
    }


def to_thinker(payload: dict[str, Any]) -> dict[str, Any]:
    """What the thinker takes from preprocessing itself (the encoders send the rest)."""
    keep = ("input_ids", "attention_mask", "options", "has_image", "has_audio", "image_grid_thw")
    out = {k: payload[k] for k in keep if k in payload}
    if payload["has_audio"]:
        # The thinker's audio positions and rope need each audio's feature length.
        out["audio_feature_lengths"] = payload["feature_attention_mask"].sum(-1)
    return out
