"""The omni demo: the shape of a Qwen3-Omni speech pipeline with small toy torch models.

The models are deterministic, seeded, randomly initialised toys that run on a CPU in
seconds: what they say is word salad and what they sing is a chord of tones. The stages,
tensors, streams and scheduling are the real thing; see README.md next to this file.
"""
