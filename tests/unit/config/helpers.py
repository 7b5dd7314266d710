"""Dotted targets and config builders shared by the config tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from omnirail.config import (
    ConfigError,
    PipelineConfig,
)

CONFIGS = Path(__file__).parent.parent / "configs"
T = "tests.unit.config.helpers"
F = f"{T}:factory"


# -- dotted targets used by the configs below ---------------------------------------------


def factory(**kwargs: Any) -> dict[str, Any]:
    return kwargs


def factory_with_model_path(model_path: str | None = None, size: int = 1) -> dict[str, Any]:
    return {"model_path": model_path, "size": size}


def merge(payloads: dict[str, Any]) -> Any:
    return payloads


def select_sources(request_id: str, from_stage: str, payload: Any) -> list[str] | None:
    return None


def route(request_id: str, output: Any) -> list[str]:
    return []


def project(payload: Any) -> Any:
    return payload


NOT_CALLABLE = 42


# -- helpers ------------------------------------------------------------------------------


def st(name: str, **kw: Any) -> dict[str, Any]:
    return {"name": name, "factory": F, **kw}


def pipe(*stages: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {"stages": list(stages), **kw}


def demo() -> dict[str, Any]:
    """A valid omni-like topology: fan-out, fan-in, streaming, two terminals."""
    return pipe(
        st("preprocessing", next=["image_encoder", "audio_encoder", "mm_aggregate"]),
        st("image_encoder", next="mm_aggregate"),
        st("audio_encoder", next="mm_aggregate"),
        st(
            "mm_aggregate",
            wait_for=["preprocessing", "image_encoder", "audio_encoder"],
            merge_fn=f"{T}:merge",
            next="thinker",
        ),
        st("thinker", next=["decode", "talker"], stream_to=["talker"]),
        st("decode", terminal=True),
        st("talker", next="code2wav"),
        st("code2wav", terminal=True),
        model_path="/models/demo",
    )


def stage_of(d: dict[str, Any], name: str) -> dict[str, Any]:
    return next(s for s in d["stages"] if s["name"] == name)


def config_error(d: Any, resolve: bool = True) -> ConfigError:
    with pytest.raises(ConfigError) as ei:
        PipelineConfig.from_dict(d, resolve=resolve)
    return ei.value
