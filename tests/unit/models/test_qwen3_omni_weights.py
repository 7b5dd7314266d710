"""The tiny Qwen3-Omni checkpoint (made here, never downloaded) and its reference generate."""

from __future__ import annotations

import json
import os
import re
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("PIL")

from omnirail.models.qwen3_omni import weights
from omnirail.testing.tiny import qwen3_omni as tiny_model

KINDS = ["text", "image", "audio"]


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
    """The transformers 5.19 bug `load_reference` works around: the talker's rope reads the
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


# --- load_submodule ------------------------------------------------------------------------


class _CountingOpen:
    """Wraps `safe_open` to record the files opened and the tensors read."""

    def __init__(self):
        self.files: list[str] = []
        self.tensors: list[str] = []

    def __call__(self, file, *args, **kwargs):
        from safetensors import safe_open

        self.files.append(os.path.basename(file))
        counter, handle = self, safe_open(file, *args, **kwargs)

        class Handle:
            def __enter__(self):
                self.f = handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def keys(self):
                return self.f.keys()

            def get_tensor(self, name):
                counter.tensors.append(name)
                return self.f.get_tensor(name)

        return Handle()


def _index(model_dir) -> dict[str, str]:
    return json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]


@pytest.mark.parametrize("name", list(weights.SUBMODULES))
def test_load_submodule_equals_reference(name, tiny_dir, reference, monkeypatch):
    spec = weights.SUBMODULES[name]
    opened = _CountingOpen()
    monkeypatch.setattr(weights, "safe_open", opened)
    module = weights.load_submodule(tiny_dir, name, torch.device("cpu"))
    assert not module.training
    own = dict(module.named_parameters())
    ref = weights.reference_parameters(reference, name)
    assert own.keys() == ref.keys()
    assert all(torch.equal(own[k], ref[k]) for k in own)
    assert sum(p.numel() for p in own.values()) == sum(p.numel() for p in ref.values())
    # Buffers (rope frequencies, codebook offsets, ...) as from_pretrained builds them.
    ref_buffers = {
        own_prefix + key: buf
        for (own_prefix, _), attr in zip(spec.parts, spec.reference, strict=True)
        for key, buf in reference.get_submodule(attr).named_buffers()
    }
    buffers = dict(module.named_buffers())
    assert buffers.keys() == ref_buffers.keys()
    assert all(torch.equal(buffers[k], ref_buffers[k]) for k in buffers)
    # Exactly the tensors under the submodule's prefixes were read, each once, from only the
    # shards holding them.
    index = _index(tiny_dir)
    wanted = sorted(k for k in index if k.startswith(spec.prefixes))
    assert sorted(opened.tensors) == wanted
    assert sorted(opened.files) == sorted({index[k] for k in wanted})


def test_a_submodule_opens_only_its_shards(tiny_dir, monkeypatch):
    shards = set(_index(tiny_dir).values())
    opened = _CountingOpen()
    monkeypatch.setattr(weights, "safe_open", opened)
    weights.load_submodule(tiny_dir, "thinker.audio_tower", "cpu")
    assert 0 < len(opened.files) < len(shards)


def test_load_submodule_runs_as_the_reference(tiny_dir, reference):
    codes = torch.randint(0, tiny_model.CODEBOOK_SIZE, (1, tiny_model.NUM_CODE_GROUPS, 12))
    code2wav = weights.load_submodule(tiny_dir, "code2wav")
    with torch.no_grad():
        assert torch.equal(code2wav(codes), reference.code2wav(codes))
    thinker = weights.load_submodule(tiny_dir, "thinker.text")
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        ours = thinker.lm_head(thinker.model(input_ids=ids).last_hidden_state)
        theirs = reference.thinker(input_ids=ids).logits
    assert torch.equal(ours, theirs)


def _copy_dir(src, dst):
    shutil.copytree(src, dst)
    return dst


def _rewrite_shard(model_dir, tensor: str, edit) -> str:
    """Applies `edit(tensors)` to the shard holding `tensor` and updates the index."""
    from safetensors.torch import load_file, save_file

    index_file = model_dir / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shard = index["weight_map"][tensor]
    tensors = load_file(model_dir / shard)
    edit(tensors)
    save_file(tensors, model_dir / shard, metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard}
    index["weight_map"].update(dict.fromkeys(tensors, shard))
    index_file.write_text(json.dumps(index))
    return shard


def _error(model_dir, name="thinker.audio_tower") -> str:
    with pytest.raises(weights.ModelDirError) as excinfo:
        weights.load_submodule(model_dir, name, "cpu")
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_error_no_config(tiny_dir, tmp_path):
    model_dir = _copy_dir(tiny_dir, tmp_path / "m")
    (model_dir / "config.json").unlink()
    assert _error(model_dir) == (
        f"{model_dir}/config.json: no such file (a model directory needs config.json)"
    )
    assert _error(tmp_path / "nowhere") == (
        f"model_path {str(tmp_path / 'nowhere')!r} is not a directory"
    )


def test_error_another_architecture(tiny_dir, tmp_path):
    model_dir = _copy_dir(tiny_dir, tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    config["model_type"] = "qwen2"
    (model_dir / "config.json").write_text(json.dumps(config))
    assert _error(model_dir) == (
        f"{model_dir}/config.json: model_type is 'qwen2', not 'qwen3_omni_moe'"
        " (another architecture)"
    )


def test_error_missing_shard(tiny_dir, tmp_path):
    model_dir = _copy_dir(tiny_dir, tmp_path / "m")
    shard = _index(model_dir)["thinker.audio_tower.conv2d1.weight"]
    (model_dir / shard).unlink()
    assert _error(model_dir) == (
        f"{model_dir}/{shard}: no such file (a shard named by model.safetensors.index.json)"
    )
    # A stage whose tensors are all in other shards still loads.
    others = [
        n
        for n, s in weights.SUBMODULES.items()
        if all(_index(model_dir)[k] != shard for k in _index(model_dir) if k.startswith(s.prefixes))
    ]
    assert others
    weights.load_submodule(model_dir, others[0], "cpu")


def test_error_missing_tensor(tiny_dir, tmp_path):
    model_dir = _copy_dir(tiny_dir, tmp_path / "m")
    _rewrite_shard(
        model_dir,
        "thinker.audio_tower.conv2d1.weight",
        lambda t: t.pop("thinker.audio_tower.conv2d1.weight"),
    )
    assert _error(model_dir) == (
        "thinker.audio_tower: missing tensor thinker.audio_tower.conv2d1.weight"
        f" (in no file of {model_dir})"
    )
    # One expert's weight, in the checkpoint's one-tensor-per-expert layout.
    expert = "thinker.model.layers.1.mlp.experts.2.up_proj.weight"
    _rewrite_shard(model_dir, expert, lambda t: t.pop(expert))
    assert _error(model_dir, "thinker.model") == (
        f"thinker.model: missing tensor {expert} (in no file of {model_dir})"
    )


def test_error_index_names_a_tensor_the_shard_lacks(tiny_dir, tmp_path):
    model_dir = _copy_dir(tiny_dir, tmp_path / "m")
    name = "thinker.audio_tower.conv2d1.weight"
    shard = _rewrite_shard(model_dir, name, lambda t: t.pop(name))
    index_file = model_dir / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"][name] = shard
    index_file.write_text(json.dumps(index))
    assert _error(model_dir).startswith(f"{model_dir}/{shard}: cannot read tensor {name} (")


def test_error_unexpected_tensors(tiny_dir, tmp_path):
    model_dir = _copy_dir(tiny_dir, tmp_path / "m")

    def add(tensors):
        tensors["thinker.audio_tower.extra.weight"] = torch.zeros(2)
        tensors["thinker.audio_tower.layers.9.fc1.bias"] = torch.zeros(2)

    _rewrite_shard(model_dir, "thinker.audio_tower.conv2d1.weight", add)
    assert _error(model_dir) == (
        "thinker.audio_tower: unexpected tensors under thinker.audio_tower.:"
        " thinker.audio_tower.extra.weight, thinker.audio_tower.layers.9.fc1.bias"
        " (not in the module)"
    )


def test_error_shape_mismatch(tiny_dir, tmp_path):
    model_dir = _copy_dir(tiny_dir, tmp_path / "m")
    name = "thinker.audio_tower.conv2d1.weight"

    def reshape(tensors):
        tensors[name] = torch.zeros(3, 1, 3, 3)

    shard = _rewrite_shard(model_dir, name, reshape)
    assert _error(model_dir) == (
        f"tensor {name} in {model_dir}/{shard} has shape [3, 1, 3, 3],"
        " the module's conv2d1.weight needs [16, 1, 3, 3]"
    )
    expert = "talker.model.layers.0.mlp.experts.3.down_proj.weight"

    def reshape_expert(tensors):
        tensors[expert] = torch.zeros(32, 31)

    shard = _rewrite_shard(model_dir, expert, reshape_expert)
    assert _error(model_dir, "talker") == (
        f"tensor {expert} in {model_dir}/{shard} has shape [32, 31],"
        " the module's model.layers.0.mlp.experts.down_proj needs [32, 32] per expert"
    )


def test_unknown_submodule(tiny_dir):
    with pytest.raises(
        ValueError, match=re.escape("unknown submodule 'thinker.foo'; one of thinker.audio")
    ):
        weights.load_submodule(tiny_dir, "thinker.foo")


def test_single_file_checkpoint_with_fused_experts(tiny_dir, tmp_path, reference):
    """One model.safetensors (no index), the thinker's experts stored fused as transformers
    holds them: read as is."""
    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / "single"
    model_dir.mkdir()
    shutil.copy(tiny_dir / "config.json", model_dir / "config.json")
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(_index(tiny_dir).values())):
        tensors.update(load_file(tiny_dir / shard))
    for key, value in dict(reference.thinker.model.named_parameters()).items():
        if ".mlp.experts." in key:
            tensors[f"thinker.model.{key}"] = value.detach().clone()
    tensors = {
        k: v
        for k, v in tensors.items()
        if not re.search(r"experts\.\d+\.", k) or not k.startswith("thinker.")
    }
    assert "thinker.model.layers.0.mlp.experts.gate_up_proj" in tensors
    assert "talker.model.layers.0.mlp.experts.0.gate_proj.weight" in tensors
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    for name in ("thinker.model", "talker"):
        module = weights.load_submodule(model_dir, name)
        ref = weights.reference_parameters(reference, name)
        assert all(torch.equal(p, ref[k]) for k, p in module.named_parameters())
    (model_dir / "model.safetensors").unlink()
    assert _error(model_dir) == (
        f"{model_dir}: neither model.safetensors.index.json nor model.safetensors is there"
    )


def test_load_submodule_in_another_dtype(tiny_dir, reference):
    module = weights.load_submodule(tiny_dir, "code2wav", "cpu", dtype=torch.bfloat16)
    ref = weights.reference_parameters(reference, "code2wav")
    for key, param in module.named_parameters():
        assert param.dtype == torch.bfloat16
        assert torch.equal(param, ref[key].to(torch.bfloat16))
    assert module.code_offset.dtype == reference.code2wav.code_offset.dtype  # integer buffer


def test_stage_sizes_from_headers_match_the_loaded_submodules(tiny_dir, reference):
    from omnirail.models.qwen3_omni import sizes

    stages = sizes.stage_bytes(tiny_dir)
    for stage, part in sizes.STAGE_SUBMODULES.items():
        params = weights.reference_parameters(reference, part).values()
        assert stages[stage][1] == sum(p.numel() * p.element_size() for p in params), stage
    every = sizes.tensor_bytes(tiny_dir)
    assert sum(b for _, b in stages.values()) == sum(every.values())  # nothing left out
