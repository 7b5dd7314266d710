"""Installed model pipelines, served by checkpoint: `omnirail serve MODEL_DIR` picks the
pipeline from the checkpoint's `config.json` (`registry.pipeline_for`).

- `qwen3_omni`: Qwen3-Omni (`Qwen3OmniMoeForConditionalGeneration`), each submodule a
  stage loading only its own weights; needs the `hf` extra.
- `omni_demo`: the omni demo, the same shape with small seeded toy models (no checkpoint,
  so not in the registry; `omni_demo.pipeline_file()`), what `omnirail bench demo` runs.
- `fanin`: the fan-in hooks both share (the encoders a request needs, waited for and
  merged in front of the thinker).

Model code imports `omnirail.stage` (the public API for model authors), never the stage
runtime; importing this package imports no model code (no torch).
"""
