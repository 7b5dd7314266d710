"""The tiny Qwen3-Omni checkpoint (made here, never downloaded) and its reference generate."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("PIL")

from examples.qwen3_omni import tiny_model
from examples.qwen3_omni.processor import load_processor

KINDS = ["text", "image", "audio"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_model.make_tiny_model(tmp_path_factory.mktemp("qwen3_omni") / "tiny")


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return tiny_model.load_reference(tiny_dir)


@pytest.fixture(scope="module")
def processor(tiny_dir):
    return load_processor(tiny_dir)


def test_tiny_model_is_a_sharded_checkpoint(tiny_dir):
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3_omni_moe"
    index = json.loads((tiny_dir / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    assert all((tiny_dir / shard).is_file() for shard in shards)
    for name in ("tokenizer.json", "tokenizer_config.json", "processor_config.json"):
        assert (tiny_dir / name).is_file(), name
    assert json.loads((tiny_dir / "processor_config.json").read_text())["processor_class"] == (
        "Qwen3OmniMoeProcessor"
    )


def test_tiny_model_token_ids_agree(reference, processor):
    tok, config = processor.tokenizer, reference.config
    assert tok.convert_ids_to_tokens(config.im_start_token_id) == "<|im_start|>"
    assert tok.convert_ids_to_tokens(config.im_end_token_id) == "<|im_end|>"
    for role in ("system", "user", "assistant"):
        assert tok.encode(role, add_special_tokens=False) == [getattr(config, f"{role}_token_id")]
    thinker, talker = config.thinker_config, config.talker_config
    for field, token in [
        ("audio_token_id", "<|audio_pad|>"),
        ("image_token_id", "<|image_pad|>"),
        ("video_token_id", "<|video_pad|>"),
        ("audio_start_token_id", "<|audio_start|>"),
        ("vision_start_token_id", "<|vision_start|>"),
    ]:
        assert getattr(thinker, field) == getattr(talker, field) == tok.convert_tokens_to_ids(token)
    assert processor.image_token_id == thinker.image_token_id
    assert processor.audio_token_id == thinker.audio_token_id
    vocab = talker.text_config.vocab_size
    assert vocab == tiny_model.CODEBOOK_SIZE + 1024
    top = range(vocab - 1024, vocab)
    assert tiny_model.SPEAKER in talker.speaker_id
    for field in ("codec_pad_id", "codec_bos_id", "codec_eos_token_id", "codec_nothink_id"):
        assert getattr(talker, field) in top
    assert all(i in top for i in talker.speaker_id.values())
    assert config.thinker_config.text_config.vocab_size >= len(tok)


def test_same_seed_same_checkpoint(tmp_path, tiny_dir):
    from safetensors.torch import load_file

    again = tiny_model.make_tiny_model(tmp_path / "again")
    for name in ("config.json", "tokenizer.json", "model.safetensors.index.json"):
        assert (again / name).read_bytes() == (tiny_dir / name).read_bytes(), name
    index = json.loads((tiny_dir / "model.safetensors.index.json").read_text())
    for shard in sorted(set(index["weight_map"].values())):
        a, b = load_file(tiny_dir / shard), load_file(again / shard)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), shard


@pytest.mark.parametrize("kind", KINDS)
def test_reference_generate_is_deterministic(kind, tiny_dir, reference, processor):
    conversation = tiny_model.sample_conversation(kind)
    seq, wav = tiny_model.reference_generate(reference, processor, conversation)
    # A second model loaded from the same files gives the same text tokens and audio.
    again = tiny_model.load_reference(tiny_dir)
    seq2, wav2 = tiny_model.reference_generate(again, processor, conversation)
    assert torch.equal(seq, seq2)
    assert torch.equal(wav, wav2)
    prompt = tiny_model.processor_inputs(processor, conversation)["input_ids"]
    assert torch.equal(seq[:, : prompt.shape[1]], prompt)
    assert seq.shape[1] > prompt.shape[1]
    assert wav.dim() == 3 and wav.shape[:2] == (1, 1) and wav.shape[-1] > 0
    assert wav.abs().max() > 1e-3  # the random vocoder is audible


def test_reference_generate_audio_and_image(reference, processor):
    """The transformers 5.24 bug `load_reference` works around: the talker's rope reads the
    audio config when a request holds audio and an image."""
    seq, wav = tiny_model.reference_generate(
        reference, processor, tiny_model.sample_conversation("image+audio")
    )
    assert seq.shape[0] == 1 and wav.shape[-1] > 0


def test_processor_prompt(processor):
    conversation = tiny_model.sample_conversation("image+audio", text="Hi")
    text = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
        "<|audio_start|><|audio_pad|><|audio_end|>Hi<|im_end|>\n<|im_start|>assistant\n"
    )
    inputs = tiny_model.processor_inputs(processor, conversation)
    ids = inputs["input_ids"][0]
    # 64 x 96 pixels: 4 x 6 patches of 16, merged 2 x 2 -> 6 image tokens; 1 s -> 13 audio.
    assert int((ids == processor.image_token_id).sum()) == 6
    assert int((ids == processor.audio_token_id).sum()) == 13
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 6]]
    assert inputs["input_features"].shape[:2] == (1, 128)
    with pytest.raises(ValueError, match="video input needs torchvision"):
        processor(text="<|vision_start|><|video_pad|><|vision_end|>", videos=[object()])
