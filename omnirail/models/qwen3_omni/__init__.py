"""Qwen3-Omni (transformers' `Qwen3OmniMoeForConditionalGeneration`) served on the mesh.

`omnirail.testing.tiny.qwen3_omni.make_tiny_model` saves a reduced, randomly initialised
checkpoint (config, safetensors shards, tokenizer, processor) for tests;
`weights.load_submodule` loads one submodule (audio encoder, vision encoder, thinker,
talker, code2wav) of such a directory or of the real checkpoint, reading only that
submodule's tensors; `processor.load_processor` loads the preprocessing (chat template,
tokenizer, Whisper features, image patches).
"""
