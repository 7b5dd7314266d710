"""Pipeline hooks shared by the installed omni pipelines (the omni demo and Qwen3-Omni):
the fan-in of preprocessing and the encoders in front of the thinker.

Preprocessing marks what a request carries (`has_image`, `has_audio`); its `route_fn`
sends the request to the encoders it needs (`needed_encoders`), and the fan-in stage
waits for exactly those (`wait_for`, its `wait_for_fn`) and merges their outputs over
preprocessing's (`merge_for_thinker`, its `merge_fn`). The pipeline files name them
`omnirail.models.fanin:wait_for` and `omnirail.models.fanin:merge_for_thinker`.
"""

from __future__ import annotations

from typing import Any

# The encoder stages, and the flag of preprocessing's payload that says a request needs it.
ENCODERS = (("image_encoder", "has_image"), ("audio_encoder", "has_audio"))


def needed_encoders(payload: dict[str, Any]) -> list[str]:
    """The encoders a request's preprocessed payload needs."""
    return [encoder for encoder, has in ENCODERS if payload[has]]


def wait_for(request_id: str, from_stage: str, payload: Any) -> list[str] | None:
    """The encoders to wait for, known once preprocessing's payload is in."""
    if from_stage != "preprocessing":
        return None
    return ["preprocessing", *needed_encoders(payload)]


def merge_for_thinker(arrived: dict[str, Any]) -> dict[str, Any]:
    """Preprocessing's payload with each encoder's output laid over it."""
    merged = dict(arrived["preprocessing"])
    for encoder, _ in ENCODERS:
        if encoder in arrived:
            merged.update(arrived[encoder])
    return merged
