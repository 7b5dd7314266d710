"""Installed model pipelines, served by checkpoint: `omnirail serve MODEL_DIR` picks the
pipeline from the checkpoint's `config.json` (`registry.pipeline_for`).

- `qwen3_omni`: Qwen3-Omni (`Qwen3OmniMoeForConditionalGeneration`), each submodule a
  stage loading only its own weights; needs the `hf` extra.

Model code imports `omnirail.stage` (the public API for model authors), never the stage
runtime; importing this package imports no model code (no torch).
"""
