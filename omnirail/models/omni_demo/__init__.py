"""The omni demo: the shape of a Qwen3-Omni speech pipeline with small toy torch models.

The models are deterministic, seeded, randomly initialised toys that run on a CPU in
seconds: what they say is word salad and what they sing is a chord of tones. The stages,
tensors, streams and scheduling are the real thing (see docs/models/omni-demo.md).

Its pipeline files ship with it: `pipeline.yaml` (the toy models) and `pipeline_hf.yaml`
(a local Hugging Face causal LM as the thinker), found with `pipeline_file()`. It serves
no checkpoint, so the registry does not list it.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def pipeline_file(name: str = "pipeline.yaml") -> Path:
    """The installed pipeline file `name` of the omni demo."""
    return Path(str(resources.files(__name__) / name))
