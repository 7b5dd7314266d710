"""A tiny Qwen3-Omni checkpoint made here, for tests: nothing is downloaded, ever.

`make_tiny_model(path)` saves into `path` what a user's real checkpoint directory holds, at a
fraction of the size: a reduced `Qwen3OmniMoeConfig` (config.json), seeded random weights in
several safetensors shards (model.safetensors.index.json), a byte-level BPE tokenizer with
Qwen3-Omni's special tokens and chat template, and the processor's image processor and
Whisper feature extractor. The result loads with
`Qwen3OmniMoeForConditionalGeneration.from_pretrained(path)` (see `load_reference` for the
transformers bug it works around) and `processor.load_processor(path)`, and
`reference_generate` runs the reference `generate()` greedily on it (`generate_kwargs`).
transformers 5.19 leaves the talker's MoE expert weights uninitialised (`torch.empty`);
`make_tiny_model` draws them itself, so the same seed gives the same files.

Shapes (see `tiny_config`): thinker text model 2 layers x 64 wide, 2 heads of 32 (the
smallest head vLLM's CPU attention takes, so the vLLM thinker loads it too) with 4 experts (2
per token); audio encoder 1 layer x 32; vision encoder 2 blocks x 32 (patch 16, merge 2,
deepstack from both blocks); talker 2 layers x 32 with 4 experts and a 1-layer code
predictor; 4 code groups of 32 codes; code2wav 1 layer x 32 with the real upsampling
(1920 samples per code frame, 24 kHz).

Special tokens keep their real names and roles but get small ids, and every id field of the
thinker, talker and top-level configs is set from the tokenizer so they agree. The talker's
vocabulary is the codebook (32) plus 1024, because `generate()` suppresses the top 1024 ids
except `codec_eos`; the codec control ids and speaker ids sit in that top range, at the real
checkpoint's offsets from the codebook size.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from omnirail.models.qwen3_omni.thinker import TalkerPrompt

SPEAKERS = {"chelsie": 253, "ethan": 254, "aiden": 255}  # offsets from the codebook size
SPEAKER = "ethan"
CODEBOOK_SIZE = 32
NUM_CODE_GROUPS = 4
SAMPLE_RATE = 16_000  # the processor's audio input rate
OUTPUT_SAMPLE_RATE = 24_000  # code2wav's output rate (1920 samples per 12.5 Hz code frame)
SHARD_SIZE = "400KB"  # several shards, so that shard handling is exercised
# Init stds: large enough that greedy decoding does not collapse to one repeated token and
# that the top two logits stay well apart (smallest gap ~7e-3 for the thinker and talker on
# the sample prompts, against ~1e-4 at 0.02), so float noise from batching cannot flip a
# greedy choice. Near 0.08 the random vocoder is audible (peaks ~1e-2; ~1e-7 at 0.02).
INIT_STD = 0.2
TALKER_INIT_STD = 0.5
CODE2WAV_INIT_STD = 0.08

# Names (and roles) as in Qwen3-Omni's tokenizer; ids are given in this order after the BPE
# vocabulary.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|audio_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<think>",
    "</think>",
]
ROLE_WORDS = ("system", "user", "assistant")

# Qwen3-Omni's chat template, reduced to what the pipeline uses: system/user/assistant turns
# whose content is a string or a list of text, image, audio and video parts; each media part
# becomes its placeholder, which the processor expands to one token per feature.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}"
    "{{- message['content'] }}"
    "{%- else %}"
    "{%- for content in message['content'] %}"
    "{%- if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
    "{{- '<|audio_start|><|audio_pad|><|audio_end|>' }}"
    "{%- elif content['type'] == 'video' or 'video' in content %}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif content['type'] == 'text' %}"
    "{{- content['text'] }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# The BPE is trained on this text (plus each role word, so that each is one token as
# `generate()` needs: it finds a turn's role as the token after <|im_start|>).
_CORPUS = """
You are a helpful assistant. The user asks and the assistant answers. The system prompt
says who the assistant is. Describe the image. What is in this picture? Listen to the audio
and tell me what you hear. What does the speaker say? Please answer in one short sentence.
The quick brown fox jumps over the lazy dog. A cat sits on the mat near the window. There is
a red car on the street and two people walking in the rain. The music is loud and the voice
is calm. Hello, how are you today? I am fine, thank you. Tell me a story about a small robot
that learns to sing. Once upon a time there was a little robot who lived in a quiet town.
Every morning it watched the birds and tried to copy their songs. Count from one to ten:
one two three four five six seven eight nine ten. Numbers 0 1 2 3 4 5 6 7 8 9 and 2025.
Summarize the text, translate it into French, and explain the main idea. Why is the sky
blue? Because light is scattered by the air. Which animal makes this sound? It is a cow.
Good morning, good night, yes, no, maybe, thanks, please, sorry, welcome.
"""


def _train_bpe(vocab_size: int = 512) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE (Qwen2's pre-tokenizer) trained on `_CORPUS`: every byte is in the
    vocabulary, so any text encodes; returns (vocab, merges)."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [_CORPUS] + [f"{word}\n" for word in ROLE_WORDS for _ in range(20)]
    tok.train_from_iterator(corpus, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return dict(model["vocab"]), merges


def build_tokenizer():
    """A `Qwen2Tokenizer` (the class Qwen3-Omni uses) over a small byte-level BPE, with
    Qwen3-Omni's special tokens after it and its chat template."""
    from transformers import Qwen2Tokenizer

    vocab, merges = _train_bpe()
    base = len(vocab)
    for i, token in enumerate(SPECIAL_TOKENS):
        vocab[token] = base + i
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=SPECIAL_TOKENS,
        image_token="<|image_pad|>",
        video_token="<|video_pad|>",
        audio_token="<|audio_pad|>",
        vision_bos_token="<|vision_start|>",
        vision_eos_token="<|vision_end|>",
        audio_bos_token="<|audio_start|>",
        audio_eos_token="<|audio_end|>",
        model_max_length=32768,
        chat_template=CHAT_TEMPLATE,
    )
    for word in ROLE_WORDS:
        ids = tokenizer.encode(word, add_special_tokens=False)
        if len(ids) != 1:
            raise RuntimeError(f"tiny tokenizer: role {word!r} is not one token ({ids})")
    return tokenizer


def build_processor(tokenizer):
    """The processor over `tokenizer`: Qwen2-VL image processor (patch 16, merge 2, at most
    16x16 patches) and a 128-bin Whisper feature extractor, as Qwen3-Omni's."""
    from transformers import WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from omnirail.models.qwen3_omni.processor import Qwen3OmniMoeProcessorNoVideo

    image_processor = Qwen2VLImageProcessorPil(
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        size={"shortest_edge": 32 * 32, "longest_edge": 256 * 256},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    feature_extractor = WhisperFeatureExtractor(
        feature_size=128,
        sampling_rate=SAMPLE_RATE,
        hop_length=160,
        chunk_length=300,
        n_fft=400,
        padding_value=0.0,
        return_attention_mask=True,
    )
    return Qwen3OmniMoeProcessorNoVideo(
        image_processor=image_processor,
        feature_extractor=feature_extractor,
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
    )


# `size="bench"`: a thinker far larger than the talker and code2wav, as in the real model
# (whose thinker is 30B with 3B active, its talker about a tenth of that): 8 layers x 512,
# 8 heads of 64, 16 experts of which 4 per token (about 56M parameters, 18M active per
# token, against the talker's 0.1M). For `omnirail bench omni --size bench`.
BENCH_THINKER = {
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "moe_intermediate_size": 256,
    "num_experts": 16,
    "num_experts_per_tok": 4,
}
BENCH_INIT_STD = 0.05


def tiny_config(tokenizer, size: str = "tiny") -> Any:
    """The reduced `Qwen3OmniMoeConfig`, its token ids taken from `tokenizer`; `size`:
    `tiny` or `bench` (`BENCH_THINKER`)."""
    from transformers import Qwen3OmniMoeConfig

    def tid(token: str) -> int:
        return tokenizer.convert_tokens_to_ids(token)

    def word(text: str) -> int:
        (only,) = tokenizer.encode(text, add_special_tokens=False)
        return only

    ids = {
        "audio_token_id": tid("<|audio_pad|>"),
        "image_token_id": tid("<|image_pad|>"),
        "video_token_id": tid("<|video_pad|>"),
        "audio_start_token_id": tid("<|audio_start|>"),
        "vision_start_token_id": tid("<|vision_start|>"),
    }
    vocab_size = 64 * math.ceil(len(tokenizer) / 64)

    def mrope(section: list[int]) -> dict[str, Any]:
        return {
            "rope_type": "default",
            "rope_theta": 1_000_000.0,
            "mrope_section": section,  # sums to head_dim / 2
            "interleaved": True,
            "mrope_interleaved": True,
        }

    if size not in ("tiny", "bench"):
        raise ValueError(f"size: tiny or bench, got {size!r}")
    width = BENCH_THINKER["hidden_size"] if size == "bench" else 64
    codebook = CODEBOOK_SIZE
    thinker = {
        "audio_config": {
            "num_mel_bins": 128,
            "encoder_layers": 1,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 64,
            "d_model": 32,
            "output_dim": width,
            "downsample_hidden_size": 16,
            "n_window": 50,
            "n_window_infer": 800,
            "conv_chunksize": 500,
            "max_source_positions": 1500,
            "initializer_range": INIT_STD,
        },
        "vision_config": {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "in_channels": 3,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": width,
            "num_position_embeddings": 576,  # a 24 x 24 grid, interpolated per image
            "deepstack_visual_indexes": [0, 1],
            "initializer_range": INIT_STD,
        },
        "text_config": {
            "vocab_size": vocab_size,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            # head_dim 32: the smallest vLLM's CPU attention takes (the vLLM thinker).
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "moe_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
            "norm_topk_prob": True,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": False,
            "rope_parameters": mrope([6, 5, 5]),
            "initializer_range": INIT_STD,
        },
        "position_id_per_seconds": 13,
        "user_token_id": word("user"),
        "initializer_range": INIT_STD,
        **ids,
    }
    if size == "bench":
        thinker["text_config"].update(BENCH_THINKER, initializer_range=BENCH_INIT_STD)
        thinker["text_config"]["rope_parameters"] = mrope([12, 10, 10])  # head_dim 64
    talker = {
        "text_config": {
            "vocab_size": codebook + 1024,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
            "norm_topk_prob": False,
            "max_position_embeddings": 4096,
            "rope_parameters": mrope([4, 2, 2]),
            "initializer_range": TALKER_INIT_STD,
        },
        "code_predictor_config": {
            "vocab_size": codebook,
            "hidden_size": 32,  # the talker's width
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "num_code_groups": NUM_CODE_GROUPS,
            "max_position_embeddings": 64,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "initializer_range": TALKER_INIT_STD,
        },
        "num_code_groups": NUM_CODE_GROUPS,
        "thinker_hidden_size": width,
        "accept_hidden_layer": 1,
        "codec_pad_id": codebook + 100,
        "codec_bos_id": codebook + 101,
        "codec_eos_token_id": codebook + 102,
        "codec_nothink_id": codebook + 107,
        "codec_think_bos_id": codebook + 108,
        "codec_think_eos_id": codebook + 109,
        "speaker_id": {name: codebook + offset for name, offset in SPEAKERS.items()},
        "position_id_per_seconds": 13,
        "spatial_merge_size": 2,
        "initializer_range": TALKER_INIT_STD,
        **ids,
    }
    code2wav = {
        "codebook_size": codebook,
        "hidden_size": 32,
        "max_position_embeddings": 8000,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "sliding_window": 72,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_quantizers": NUM_CODE_GROUPS,
        "upsample_rates": [8, 5, 4, 3],
        "upsampling_ratios": [2, 2],
        "decoder_dim": 32,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0},
        "initializer_range": CODE2WAV_INIT_STD,
    }
    return Qwen3OmniMoeConfig(
        thinker_config=thinker,
        talker_config=talker,
        code2wav_config=code2wav,
        enable_audio_output=True,
        im_start_token_id=tid("<|im_start|>"),
        im_end_token_id=tid("<|im_end|>"),
        tts_pad_token_id=tid("<tts_pad>"),
        tts_bos_token_id=tid("<tts_text_bos>"),
        tts_eos_token_id=tid("<tts_text_eod>"),
        system_token_id=word("system"),
        user_token_id=word("user"),
        assistant_token_id=word("assistant"),
        initializer_range=INIT_STD,
    )


def make_tiny_model(path: str | Path, seed: int = 0, size: str = "tiny") -> Path:
    """Saves a tiny random Qwen3-Omni checkpoint (config, sharded safetensors weights,
    tokenizer, processor) into `path` and returns it. Same `seed`, same files. `size="bench"`
    makes the thinker far larger (`BENCH_THINKER`)."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    processor = build_processor(tokenizer)
    config = tiny_config(tokenizer, size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3OmniMoeForConditionalGeneration(config)
        _init_talker_experts(model, seed)
    for name, param in model.named_parameters():
        if not torch.isfinite(param).all():
            raise RuntimeError(f"tiny model: parameter {name} was left uninitialised")
    model.eval()
    shard = SHARD_SIZE if size == "tiny" else "64MB"
    model.save_pretrained(path, max_shard_size=shard, safe_serialization=True)
    processor.save_pretrained(path)
    return path


def _init_talker_experts(model, seed: int) -> None:
    """transformers 5.19 leaves the talker's fused MoE expert weights (`torch.empty`) out of
    `_init_weights`: they would hold whatever memory they were given, and differ from run to
    run. Draws them here, seeded, with the talker's init std."""
    gen = torch.Generator().manual_seed(seed + 1)
    std = model.config.talker_config.text_config.initializer_range
    with torch.no_grad():
        for name, param in sorted(model.talker.model.named_parameters()):
            if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
                param.copy_(torch.randn(param.shape, generator=gen) * std)


def load_reference(path: str | Path, device: str | torch.device = "cpu"):
    """`Qwen3OmniMoeForConditionalGeneration.from_pretrained(path)` in eval mode, offline, with
    a transformers 5.19 bug worked around: with audio and an image (or video) in one request
    and `return_audio=True`, the talker's 3D rope reads `config.audio_config.n_window`, which
    the talker's config lacks (AttributeError); the talker is given the thinker's audio config,
    which changes nothing else."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        str(path), local_files_only=True, dtype=torch.float32
    )
    if getattr(model, "has_talker", False) and not hasattr(model.talker.config, "audio_config"):
        model.talker.config.audio_config = model.config.thinker_config.audio_config
    return model.to(device).eval()


def generate_kwargs(
    model, thinker_max_new_tokens: int = 16, talker_max_new_tokens: int = 64
) -> dict[str, Any]:
    """The reference `generate()` arguments the tests compare with: greedy thinker and talker,
    the tiny config's speaker and end-of-turn token, audio returned."""
    return {
        "return_audio": True,
        "speaker": SPEAKER,
        "thinker_do_sample": False,
        "talker_do_sample": False,
        "thinker_max_new_tokens": thinker_max_new_tokens,
        "talker_max_new_tokens": talker_max_new_tokens,
        "thinker_eos_token_id": model.config.im_end_token_id,
    }


def sample_image(seed: int = 0, height: int = 64, width: int = 96) -> np.ndarray:
    """A seeded RGB image, uint8 (height, width, 3)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)


def sample_audio(seed: int = 0, seconds: float = 1.0) -> np.ndarray:
    """Seeded mono audio at 16 kHz, float32 in [-0.5, 0.5]: a tone plus noise."""
    rng = np.random.default_rng(seed)
    n = int(seconds * SAMPLE_RATE)
    t = np.arange(n) / SAMPLE_RATE
    wave = 0.3 * np.sin(2 * np.pi * (220 + 40 * seed) * t) + 0.1 * rng.standard_normal(n)
    return np.clip(wave, -0.5, 0.5).astype(np.float32)


def sample_conversation(kind: str, text: str = "Describe this.") -> list[dict[str, Any]]:
    """A one-turn user chat: `kind` is "text", "image", "audio" or "image+audio" (the seeded
    samples before the text)."""
    parts = kind.split("+")
    if kind != "text" and not set(parts) <= {"image", "audio"}:
        raise ValueError(f"kind must be text, image, audio or image+audio, not {kind!r}")
    content: list[dict[str, Any]] = []
    if "image" in parts:
        content.append({"type": "image", "image": sample_image()})
    if "audio" in parts:
        content.append({"type": "audio", "audio": sample_audio()})
    content.append({"type": "text", "text": text})
    return [{"role": "user", "content": content}]


def processor_inputs(processor, conversation: list[dict[str, Any]]) -> dict[str, Any]:
    """The model inputs for `conversation`: its chat template text through the processor with
    the conversation's images and audio (in order)."""
    text = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    images = [c["image"] for m in conversation for c in _parts(m) if c.get("type") == "image"]
    audio = [c["audio"] for m in conversation for c in _parts(m) if c.get("type") == "audio"]
    return dict(
        processor(
            text=text,
            images=images or None,
            audio=audio or None,
            return_tensors="pt",
            padding=True,
        )
    )


def _parts(message: dict[str, Any]) -> list[dict[str, Any]]:
    content = message["content"]
    return [] if isinstance(content, str) else content


def reference_generate(model, processor, conversation: list[dict[str, Any]], **overrides: Any):
    """transformers' `generate()` on `conversation`: (text token ids of the whole sequence,
    waveform float32 (1, 1, samples) at 24 kHz)."""
    inputs = processor_inputs(processor, conversation)
    kwargs = {**generate_kwargs(model), **overrides}
    with torch.no_grad():
        return model.generate(**inputs, **kwargs)


def reference_outputs(model, processor, conversation: list[dict[str, Any]], **overrides: Any):
    """`reference_generate`, also capturing the talker's codes: (sequences (1, S + n),
    codes (groups, frames) long, waveform (samples,) float32)."""
    captured: dict[str, Any] = {}
    talker_generate = model.talker.generate

    def talker(*args: Any, **kwargs: Any) -> Any:
        captured["talker"] = out = talker_generate(*args, **kwargs)
        return out

    model.talker.generate = talker
    try:
        sequences, wav = reference_generate(model, processor, conversation, **overrides)
    finally:
        del model.talker.generate
    steps = captured["talker"].hidden_states
    codes = torch.stack([h[-1] for h in steps if h[-1] is not None], dim=1).transpose(1, 2)[0]
    return sequences, codes, wav.reshape(-1)


def inputs_from_thinker_generate(
    config: Any, inputs: dict[str, Any], thinker_result: Any
) -> tuple[TalkerPrompt, dict[str, Any], torch.Tensor]:
    """What a thinker hands the talker, derived from transformers' `thinker.generate(...,
    output_hidden_states=True, return_dict_in_generate=True)` on the processor's `inputs`
    exactly as `Qwen3OmniMoeForConditionalGeneration.generate()` derives it (one request):
    the `TalkerPrompt`, the media keyword arguments of `TalkerRunner.start`, and the
    generated tokens' input embeddings `(n - 1, D)` (every generated token but the last,
    which the thinker never feeds back). Tests use it on the reference thinker."""
    from omnirail.models.qwen3_omni.thinker import TalkerPrompt

    layer = config.talker_config.accept_hidden_layer
    steps = thinker_result.hidden_states
    embeds = torch.cat([h[0] for h in steps], dim=1)
    hidden = torch.cat([h[layer] for h in steps], dim=1)
    input_ids = inputs["input_ids"]
    seq = input_ids.shape[1]
    thinker = config.thinker_config
    mm_ids = (thinker.audio_token_id, thinker.image_token_id, thinker.video_token_id)
    mask = inputs.get("feature_attention_mask")
    media = {
        "image_grid_thw": inputs.get("image_grid_thw"),
        "audio_feature_lengths": None if mask is None else torch.sum(mask, dim=1),
        "video_grid_thw": inputs.get("video_grid_thw"),
        "video_second_per_grid": inputs.get("video_second_per_grid"),
        "use_audio_in_video": bool(inputs.get("use_audio_in_video", False)),
    }
    prompt = TalkerPrompt(
        input_ids=input_ids,
        embeds=embeds[:, :seq],
        accept_hidden=hidden[:, :seq],
        multimodal_mask=torch.isin(input_ids, torch.tensor(mm_ids)),
    )
    return prompt, media, embeds[0, seq:]
