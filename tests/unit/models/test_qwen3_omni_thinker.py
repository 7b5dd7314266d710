"""Qwen3-Omni's encoders and thinker as per-request step machines (omnirail/models/qwen3_omni/
encoders.py, thinker.py), bitwise equal to transformers' `generate()` on the tiny checkpoint.

The runner and the encoders load their own submodules from the checkpoint directory
(`weights.load_submodule`), apart from the reference model, so nothing is shared with it.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("PIL")

from omnirail.models.qwen3_omni.encoders import AudioEncoder, ImageEncoder, InputError
from omnirail.models.qwen3_omni.thinker import ThinkerRunner
from omnirail.testing.tiny import qwen3_omni as tiny_model

KINDS = ["text", "image", "audio"]
MAX_NEW = 16


@pytest.fixture(scope="module")
def runner(tiny_dir):
    return ThinkerRunner.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def audio_encoder(tiny_dir):
    return AudioEncoder.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def image_encoder(tiny_dir):
    return ImageEncoder.from_pretrained(tiny_dir)


def encode(inputs, audio_encoder, image_encoder):
    """The encoders' outputs for one request's processor inputs: (audio, image)."""
    audio = image = None
    if "input_features" in inputs:
        audio = audio_encoder.encode(inputs["input_features"], inputs["feature_attention_mask"])
    if "pixel_values" in inputs:
        image = image_encoder.encode(inputs["pixel_values"], inputs["image_grid_thw"])
    return audio, image


def run(runner, inputs, audio, image, max_new_tokens=MAX_NEW, **kwargs):
    """A request run alone: (prefill result, tokens, fed embeddings)."""
    pre = runner.prefill(
        inputs["input_ids"],
        attention_mask=inputs["attention_mask"],
        audio=audio,
        image=image,
        max_new_tokens=max_new_tokens,
        **kwargs,
    )
    tokens, fed = [pre.first.token], []
    while not pre.state.finished:
        out = runner.step(pre.state)
        tokens.append(out.token)
        fed.append(out.fed_embed)
    return pre, tokens, fed


def reference_run(reference, processor, conversation, **overrides):
    """`generate()` on the full model (thinker, talker, code2wav); returns its text ids, the
    prompt length and what it builds for the talker from the thinker's result."""
    inputs = tiny_model.processor_inputs(processor, conversation)
    captured = {}
    thinker_generate = reference.thinker.generate

    def recording_generate(*args, **kwargs):
        captured["result"] = result = thinker_generate(*args, **kwargs)
        return result

    reference.thinker.generate = recording_generate
    try:
        sequences, _ = tiny_model.reference_generate(
            reference, processor, conversation, **overrides
        )
    finally:
        del reference.thinker.generate  # the instance attribute; the class method is back
    result = captured["result"]
    config = reference.config
    thinker = config.thinker_config
    # As Qwen3OmniMoeForConditionalGeneration.generate builds the talker's inputs.
    hidden = result.hidden_states
    fed = {
        "embed": torch.cat([h[0] for h in hidden], dim=1),
        "hidden": torch.cat([h[config.talker_config.accept_hidden_layer] for h in hidden], dim=1),
        "mask": (
            (result.sequences == thinker.audio_token_id)
            | (result.sequences == thinker.image_token_id)
            | (result.sequences == thinker.video_token_id)
        ),
    }
    assert torch.equal(result.sequences, sequences)
    return sequences, inputs["input_ids"].shape[1], fed, inputs


# ---- encoders ---------------------------------------------------------------------------


def test_audio_encoder_equals_get_audio_features(reference, processor, audio_encoder):
    audios = [tiny_model.sample_audio(0, 1.0), tiny_model.sample_audio(1, 2.3)]
    feats = processor.feature_extractor(
        audios, sampling_rate=tiny_model.SAMPLE_RATE, return_attention_mask=True, padding=True
    )
    features = torch.as_tensor(feats["input_features"])
    mask = torch.as_tensor(feats["attention_mask"])
    out = audio_encoder.encode(features, mask)
    with torch.no_grad():
        ref = reference.thinker.get_audio_features(features, mask).last_hidden_state
    assert torch.equal(out.embeds, ref)
    assert out.feature_lengths.tolist() == mask.sum(1).tolist()
    assert sum(t.shape[0] for t in out.split()) == ref.shape[0]
    assert [t.shape[0] for t in out.split()] == out.token_lengths.tolist()
    assert out.embeds.is_contiguous()


def test_image_encoder_equals_get_image_features(reference, processor, image_encoder):
    images = [tiny_model.sample_image(0), tiny_model.sample_image(1, 96, 64)]
    inputs = processor.image_processor(images=images, return_tensors="pt")
    pixels, grid = inputs["pixel_values"], inputs["image_grid_thw"]
    out = image_encoder.encode(pixels, grid)
    with torch.no_grad():
        ref = reference.thinker.get_image_features(pixels, grid)
    embeds, deepstack = out.split()
    assert len(embeds) == len(ref.pooler_output) == 2
    assert all(torch.equal(a, b) for a, b in zip(embeds, ref.pooler_output, strict=True))
    assert len(deepstack) == len(ref.deepstack_features) == 2
    for mine, theirs in zip(deepstack, ref.deepstack_features, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
    assert torch.equal(out.grid_thw, grid)


# ---- the thinker against generate() -----------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_runner_equals_generate(kind, reference, processor, runner, audio_encoder, image_encoder):
    conversation = tiny_model.sample_conversation(kind)
    sequences, length, ref_fed, inputs = reference_run(reference, processor, conversation)
    audio, image = encode(inputs, audio_encoder, image_encoder)
    pre, tokens, fed = run(runner, inputs, audio, image)

    assert tokens == sequences[0, length:].tolist()
    assert len(tokens) == MAX_NEW  # the random model never says <|im_end|> in 16 tokens
    # What the talker is given: the prompt part, then one embedding per fed token (every
    # generated token but the last), equal to what generate() slices from hidden_states.
    talker = pre.talker
    assert torch.equal(talker.input_ids, inputs["input_ids"])
    assert torch.equal(talker.embeds, ref_fed["embed"][:, :length])
    assert torch.equal(talker.accept_hidden, ref_fed["hidden"][:, :length])
    assert torch.equal(talker.multimodal_mask, ref_fed["mask"][:, :length])
    assert len(fed) == len(tokens) - 1
    assert torch.equal(torch.cat(fed, dim=1), ref_fed["embed"][:, length:])
    assert torch.equal(torch.cat([talker.embeds, *fed], dim=1), ref_fed["embed"])
    mm = talker.multimodal_hidden()
    assert torch.equal(mm, ref_fed["hidden"][:, :length][ref_fed["mask"][:, :length]])
    assert mm.shape[0] == (0 if kind == "text" else int(talker.multimodal_mask.sum()))
    for t in (talker.input_ids, talker.embeds, talker.accept_hidden, talker.multimodal_mask):
        assert t.is_contiguous()
    assert all(f.shape == (1, 1, runner.hidden_size) and f.is_contiguous() for f in fed)
    # The 3D rope: an image prompt's positions run behind its text positions.
    assert pre.state.rope_deltas.item() == (-3 if kind == "image" else 0)


def test_image_and_audio_prompt_equals_generate(
    reference, processor, runner, audio_encoder, image_encoder
):
    conversation = tiny_model.sample_conversation("image+audio")
    sequences, length, ref_fed, inputs = reference_run(reference, processor, conversation)
    pre, tokens, fed = run(runner, inputs, *encode(inputs, audio_encoder, image_encoder))
    assert tokens == sequences[0, length:].tolist()
    assert torch.equal(pre.talker.accept_hidden, ref_fed["hidden"][:, :length])
    assert torch.equal(torch.cat([pre.talker.embeds, *fed], dim=1), ref_fed["embed"])


@pytest.mark.parametrize("kind", ["text", "image"])
def test_eos_stops_as_generate(kind, reference, processor, runner, audio_encoder, image_encoder):
    """The reference's eos handling: generation stops at (and includes) the first token that
    is one of `eos_token_id`, an int or a list."""
    conversation = tiny_model.sample_conversation(kind)
    inputs = tiny_model.processor_inputs(processor, conversation)
    audio, image = encode(inputs, audio_encoder, image_encoder)
    _, free, _ = run(runner, inputs, audio, image)
    for eos in (free[5], [free[9], free[3]]):
        sequences, length, ref_fed, _ = reference_run(
            reference, processor, conversation, thinker_eos_token_id=eos
        )
        pre, tokens, fed = run(runner, inputs, audio, image, eos_token_id=eos)
        assert tokens == sequences[0, length:].tolist()
        stop = {eos} if isinstance(eos, int) else set(eos)
        assert tokens[-1] in stop and not stop & set(tokens[:-1])
        assert len(tokens) < MAX_NEW
        assert torch.equal(torch.cat([pre.talker.embeds, *fed], dim=1), ref_fed["embed"])


def test_max_new_tokens_one_and_default_eos(processor, runner):
    inputs = tiny_model.processor_inputs(processor, tiny_model.sample_conversation("text"))
    pre, tokens, fed = run(runner, inputs, None, None, max_new_tokens=1)
    assert pre.first.finished and len(tokens) == 1 and fed == []
    with pytest.raises(RuntimeError, match="finished"):
        runner.step(pre.state)
    # The default end of turn is the config's <|im_end|>, as the tests' generate() uses.
    assert pre.state.eos_token_ids == {runner.config.im_end_token_id}
    pre, _, _ = run(runner, inputs, None, None, max_new_tokens=2, eos_token_id=None)
    assert pre.state.eos_token_ids == frozenset()


def test_embed_is_the_thinker_embedding(reference, runner):
    """The talker's tts_bos/eos/pad inputs come from the thinker's embedding table."""
    config = reference.config
    ids = torch.tensor(
        [[config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id]]
    )
    with torch.no_grad():
        ref = reference.thinker.get_input_embeddings()(ids)
    assert torch.equal(runner.embed(ids), ref)
    assert runner.embed(ids[0].tolist()).shape == (3, runner.hidden_size)


# ---- continuous batching ----------------------------------------------------------------

PROMPTS = [
    ("text", "Hi."),
    ("image", "Describe the image."),
    ("audio", "What does the speaker say?"),
    ("text", "Tell me a story about a small robot that learns to sing, in one short sentence."),
    ("image", "What is in this picture? Please answer in one short sentence."),
    ("text", "Count from one to ten."),
    ("audio", "Listen to the audio and tell me what you hear."),
    ("text", "Why is the sky blue?"),
]
MAX_NEW_TOKENS = [5, 12, 20, 3, 9, 16, 7, 14]
JOIN_AT = [0, 0, 1, 2, 4, 4, 7, 11]  # the scheduler step at which each request joins


def test_interleaved_requests_equal_solo(processor, runner, audio_encoder, image_encoder):
    """8 requests of different prompt lengths and max_new_tokens join at different steps
    and finish at different steps; each gets exactly (tokens, talker inputs) its solo run
    gets. The loop is ARScheduler's: admit (prefill) between steps, one step_many over the
    running requests, drop the finished."""
    requests = []
    for (kind, text), n in zip(PROMPTS, MAX_NEW_TOKENS, strict=True):
        inputs = tiny_model.processor_inputs(processor, tiny_model.sample_conversation(kind, text))
        audio, image = encode(inputs, audio_encoder, image_encoder)
        requests.append((inputs, audio, image, n))
    lengths = {r[0]["input_ids"].shape[1] for r in requests}
    assert len(lengths) >= 6  # different prompt lengths
    solo = [run(runner, *r[:3], max_new_tokens=r[3], eos_token_id=None) for r in requests]

    tokens: dict[int, list[int]] = {}
    fed: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(requests))}
    prefills, running, finished_at = {}, [], {}
    step = 0
    while len(finished_at) < len(requests):
        for i, at in enumerate(JOIN_AT):
            if at == step:
                inputs, audio, image, n = requests[i]
                pre = runner.prefill(
                    inputs["input_ids"],
                    audio=audio,
                    image=image,
                    max_new_tokens=n,
                    eos_token_id=None,
                )
                prefills[i], tokens[i] = pre, [pre.first.token]
                if pre.first.finished:
                    finished_at[i] = step
                else:
                    running.append(i)
        outs = runner.step_many([prefills[i].state for i in running])
        for i, out in zip(list(running), outs, strict=True):
            tokens[i].append(out.token)
            fed[i].append(out.fed_embed)
            if out.finished:
                running.remove(i)
                finished_at[i] = step
                runner.release(prefills[i].state)
        step += 1

    assert len(set(finished_at.values())) >= 6  # they leave at different steps
    for i, (pre, solo_tokens, solo_fed) in enumerate(solo):
        assert tokens[i] == solo_tokens, i
        assert len(tokens[i]) == MAX_NEW_TOKENS[i]
        assert len(fed[i]) == len(solo_fed)
        assert all(torch.equal(a, b) for a, b in zip(fed[i], solo_fed, strict=True)), i
        assert torch.equal(prefills[i].talker.embeds, pre.talker.embeds)
        assert torch.equal(prefills[i].talker.accept_hidden, pre.talker.accept_hidden)
        assert prefills[i].state.cache is None  # released


def test_state_does_not_leak_between_requests(processor, runner, audio_encoder, image_encoder):
    """An image request (rope deltas -3) and a text request (0) stepped in turns: each keeps
    its own deltas, positions and cache, and the shared modules hold no request state."""
    image_inputs = tiny_model.processor_inputs(processor, tiny_model.sample_conversation("image"))
    text_inputs = tiny_model.processor_inputs(processor, tiny_model.sample_conversation("text"))
    image_enc = encode(image_inputs, audio_encoder, image_encoder)
    _, text_solo, _ = run(runner, text_inputs, None, None)
    _, image_solo, _ = run(runner, image_inputs, *image_enc)
    attrs_before = set(vars(runner.model))

    a = runner.prefill(image_inputs["input_ids"], image=image_enc[1], max_new_tokens=MAX_NEW)
    b = runner.prefill(text_inputs["input_ids"], max_new_tokens=MAX_NEW)
    assert a.state.rope_deltas.item() == -3 and b.state.rope_deltas.item() == 0
    assert a.state.cache is not b.state.cache
    a_tokens, b_tokens = [a.first.token], [b.first.token]
    while not (a.state.finished and b.state.finished):
        for state, toks in ((b.state, b_tokens), (a.state, a_tokens)):
            if not state.finished:
                toks.append(runner.step(state).token)
    assert a_tokens == image_solo and b_tokens == text_solo
    for pre, inputs in ((a, image_inputs), (b, text_inputs)):
        fed = MAX_NEW - 1
        assert pre.state.cache.get_seq_length() == inputs["input_ids"].shape[1] + fed
        text_pos = pre.state.position[0].item()
        assert text_pos == inputs["input_ids"].shape[1] - 1 + fed
        assert (pre.state.position[1:] == text_pos + pre.state.rope_deltas).all()
    assert set(vars(runner.model)) == attrs_before
    assert not hasattr(runner.model, "rope_deltas")


# ---- bad input --------------------------------------------------------------------------


def test_bad_image_input_names_the_field(processor, image_encoder):
    inputs = processor.image_processor(images=[tiny_model.sample_image(0)], return_tensors="pt")
    pixels, grid = inputs["pixel_values"], inputs["image_grid_thw"]
    with pytest.raises(InputError, match=r"^pixel_values: expected rank 2") as err:
        image_encoder.encode(pixels.unsqueeze(0), grid)
    assert err.value.field == "pixel_values"
    with pytest.raises(InputError, match=r"^pixel_values: expected rank 2"):
        image_encoder.encode(pixels[:, :100], grid)
    with pytest.raises(InputError, match=r"^pixel_values: image_grid_thw \[\[1, 4, 6\]\]"):
        image_encoder.encode(pixels[:-4], grid)
    with pytest.raises(InputError, match=r"^image_grid_thw: expected an integer tensor"):
        image_encoder.encode(pixels, grid[0])
    with pytest.raises(InputError, match=r"^image_grid_thw: h and w must be multiples"):
        image_encoder.encode(pixels, torch.tensor([[1, 3, 8]]))
    with pytest.raises(InputError, match=r"^pixel_values: expected a float tensor"):
        image_encoder.encode(pixels.long(), grid)


def test_bad_audio_input_names_the_field(processor, audio_encoder):
    feats = processor.feature_extractor(
        [tiny_model.sample_audio(0)],
        sampling_rate=tiny_model.SAMPLE_RATE,
        return_attention_mask=True,
    )
    features = torch.as_tensor(feats["input_features"])
    mask = torch.as_tensor(feats["attention_mask"])
    with pytest.raises(InputError, match=r"^input_features: expected 128 mel bins") as err:
        audio_encoder.encode(features[:, :80], mask)
    assert err.value.field == "input_features"
    with pytest.raises(InputError, match=r"^input_features: expected shape"):
        audio_encoder.encode(features[0], mask)
    with pytest.raises(InputError, match=r"^feature_attention_mask: expected shape"):
        audio_encoder.encode(features, mask[:, :-1])
    holed = mask.clone()
    holed[0, 0] = 0
    with pytest.raises(InputError, match=r"^feature_attention_mask: each row must be ones"):
        audio_encoder.encode(features, holed)
    with pytest.raises(InputError, match=r"^feature_attention_mask: every audio needs"):
        audio_encoder.encode(features, mask * 0)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8", None, 10**9])
def test_max_new_tokens_out_of_range(bad, processor, runner):
    inputs = tiny_model.processor_inputs(processor, tiny_model.sample_conversation("text"))
    with pytest.raises(InputError, match=r"^max_new_tokens: expected an integer within 1\.\.") as e:
        runner.prefill(inputs["input_ids"], max_new_tokens=bad)
    assert e.value.field == "max_new_tokens"


def test_bad_thinker_input_names_the_field(processor, runner, audio_encoder, image_encoder):
    image_inputs = tiny_model.processor_inputs(processor, tiny_model.sample_conversation("image"))
    audio_inputs = tiny_model.processor_inputs(processor, tiny_model.sample_conversation("audio"))
    audio, _ = encode(audio_inputs, audio_encoder, image_encoder)
    _, image = encode(image_inputs, audio_encoder, image_encoder)
    ids = image_inputs["input_ids"]

    def fails(field, **kwargs):
        kwargs.setdefault("max_new_tokens", 4)
        kwargs.setdefault("input_ids", ids)
        with pytest.raises(InputError) as err:
            runner.prefill(kwargs.pop("input_ids"), **kwargs)
        assert err.value.field == field, str(err.value)
        assert str(err.value).startswith(f"{field}: ")
        return str(err.value)

    fails("input_ids", input_ids=ids.float())
    fails("input_ids", input_ids=ids.repeat(2, 1), image=image)
    fails("input_ids", input_ids=ids + 10_000, image=image)
    fails("attention_mask", image=image, attention_mask=torch.zeros_like(ids))
    assert "image tokens" in fails("image")  # image tokens, no image
    assert "audio tokens" in fails("audio", input_ids=audio_inputs["input_ids"])
    fails("audio.embeds", input_ids=audio_inputs["input_ids"], audio=_replace(audio, -2))
    short = _replace(image, 3)
    assert "3 rows for 6 image tokens" in fails("image.embeds", image=short)
    wide = type(image)(image.embeds[:, :10], image.deepstack, image.grid_thw, image.token_lengths)
    fails("image.embeds", image=wide)
    two = type(image)(
        image.embeds, image.deepstack, image.grid_thw.repeat(2, 1), image.token_lengths
    )
    fails("image.grid_thw", image=two)
    video = ids.clone()
    video[0, -1] = runner.video_token_id
    assert "video" in fails("input_ids", input_ids=video, image=image)
    fails("eos_token_id", image=image, eos_token_id=-5)


def _replace(encoding, rows):
    """`encoding` with only its first `rows` embedding rows (negative: all but the last)."""
    from dataclasses import replace

    return replace(encoding, embeds=encoding.embeds[:rows])


def test_steps_leave_the_module_as_loaded(tiny_dir, processor):
    """Decode steps run the MoE experts as `batched_mm` by calling it (see `rows`), never by
    switching the module's implementation: the module is only read."""
    runner = ThinkerRunner.from_pretrained(tiny_dir)
    assert runner.text_config._experts_implementation == "grouped_mm"
    inputs = tiny_model.processor_inputs(processor, tiny_model.sample_conversation("text"))
    pre = runner.prefill(inputs["input_ids"], max_new_tokens=4)
    runner.step(pre.state)
    assert runner.text_config._experts_implementation == "grouped_mm"
