"""The Qwen3-Omni talker (+ code predictor) and code2wav as streaming step machines, against
transformers' reference `Qwen3OmniMoeForConditionalGeneration.generate()` on the tiny
checkpoint: identical codec codes, streamed audio within float rounding of the reference."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded

import random
from dataclasses import dataclass
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("PIL")

from omnirail.models.qwen3_omni.code2wav import Code2WavStreamer
from omnirail.models.qwen3_omni.talker import TalkerRunner
from omnirail.models.qwen3_omni.talker_prompt import read_tts_embeds
from omnirail.models.qwen3_omni.thinker import TalkerPrompt
from omnirail.testing.tiny import qwen3_omni as tiny_model
from omnirail.testing.tiny.qwen3_omni import inputs_from_thinker_generate
from tests.unit.models.code2wav_helpers import assert_audio_close, stream_audio

# Streamed audio against the reference waveform; measured here: ~1e-8 (peaks ~2e-2).
KINDS = ["text", "image", "audio", "image+audio", "system+image"]


def conversation(kind: str, text: str = "Describe this.") -> list[dict[str, Any]]:
    """`tiny_model.sample_conversation`, and "system+...": the same after a system turn
    (which the talker's prompt leaves out)."""
    if kind.startswith("system+"):
        system = {"role": "system", "content": "You are a helpful assistant."}
        return [system, *tiny_model.sample_conversation(kind[len("system+") :], text)]
    return tiny_model.sample_conversation(kind, text)


@dataclass
class Reference:
    inputs: dict[str, Any]
    sequences: torch.Tensor  # (1, S + n)
    thinker: Any  # thinker.generate's output
    codes: torch.Tensor  # (groups, frames): generate()'s talker_codes
    wav: torch.Tensor  # (samples,)
    prompt: TalkerPrompt
    media: dict[str, Any]  # TalkerRunner.start's media arguments
    text: torch.Tensor  # (n - 1, D): the generated tokens' thinker embeddings


def run_reference(model, processor, kind: str, **overrides: Any) -> Reference:
    """The reference generate() on `kind`'s conversation, capturing its thinker output and
    its talker codes."""
    captured: dict[str, Any] = {}
    thinker_generate, talker_generate = model.thinker.generate, model.talker.generate

    def thinker(*args, **kwargs):
        captured["thinker"] = out = thinker_generate(*args, **kwargs)
        return out

    def talker(*args, **kwargs):
        captured["talker"] = out = talker_generate(*args, **kwargs)
        return out

    model.thinker.generate, model.talker.generate = thinker, talker
    try:
        conv = conversation(kind)
        sequences, wav = tiny_model.reference_generate(model, processor, conv, **overrides)
    finally:
        del model.thinker.generate, model.talker.generate
    inputs = tiny_model.processor_inputs(processor, conv)
    steps = captured["talker"].hidden_states
    codes = torch.stack([h[-1] for h in steps if h[-1] is not None], dim=1).transpose(1, 2)[0]
    prompt, media, text = inputs_from_thinker_generate(model.config, inputs, captured["thinker"])
    return Reference(inputs, sequences, captured["thinker"], codes, wav[0, 0], prompt, media, text)


def talker_options(overrides: dict[str, Any]) -> dict[str, Any]:
    """TalkerRunner.start's arguments for the reference's generate() overrides."""
    options = {
        "speaker": tiny_model.SPEAKER,
        "max_new_tokens": overrides.get("talker_max_new_tokens", 64),
    }
    if "talker_eos_token_id" in overrides:
        options["eos_token_id"] = overrides["talker_eos_token_id"]
    return options


def talk_all_at_once(runner: TalkerRunner, ref: Reference, **options: Any) -> torch.Tensor:
    state = runner.start(ref.prompt, **ref.media, **options)
    runner.push_text(state, ref.text)
    runner.end_text(state)
    frames = []
    while True:
        out = runner.step(state)
        assert not out.needs_input
        if out.frame is not None:
            frames.append(out.frame)
        if out.finished:
            break
    assert state.cache is None  # released at the end
    return stack(frames, runner.num_code_groups)


def stack(frames: list[torch.Tensor], groups: int) -> torch.Tensor:
    return torch.stack(frames, dim=1) if frames else torch.zeros((groups, 0), dtype=torch.long)


@pytest.fixture(scope="module")
def runner(reference):
    return TalkerRunner.from_model(reference)


@pytest.fixture(scope="module")
def references(reference, processor):
    """Reference runs, cached per (kind, overrides) for the module."""
    cache: dict[tuple, Reference] = {}

    def get(kind: str, **overrides: Any) -> Reference:
        key = (kind, tuple(sorted(overrides.items())))
        if key not in cache:
            cache[key] = run_reference(reference, processor, kind, **overrides)
        return cache[key]

    return get


# ---- the talker against generate() -------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_codes_and_audio_equal_reference(kind, runner, streamer, references):
    ref = references(kind)
    codes = talk_all_at_once(runner, ref, **talker_options({}))
    assert codes.shape == ref.codes.shape == (tiny_model.NUM_CODE_GROUPS, 63)
    assert torch.equal(codes, ref.codes)
    assert_audio_close(stream_audio(streamer, codes), ref.wav)


def test_inputs_from_thinker_generate(references, reference):
    """The thinker-to-talker contract on the reference: the prompt's rows, and one embedding
    per generated token but the last."""
    ref = references("image")
    seq = ref.inputs["input_ids"].shape[1]
    generated = ref.sequences.shape[1] - seq
    width = reference.config.thinker_config.text_config.hidden_size
    assert ref.prompt.embeds.shape == (1, seq, width)
    assert ref.prompt.accept_hidden.shape == ref.prompt.embeds.shape
    assert int(ref.prompt.multimodal_mask.sum()) == 6  # the image's tokens
    assert torch.equal(ref.media["image_grid_thw"], ref.inputs["image_grid_thw"])
    assert ref.text.shape == (generated - 1, width)
    embed = reference.thinker.get_input_embeddings()
    with torch.no_grad():  # text positions: the token embeddings themselves
        assert torch.equal(ref.text, embed(ref.sequences[0, seq:-1]))


@pytest.mark.parametrize("kind", ["text", "image+audio"])
def test_streaming_behind_the_thinker_runner(kind, tiny_dir, processor, runner, references):
    """The thinker's own step machine (`thinker.ThinkerRunner` and the encoders) feeding the
    talker as a pipeline would: the talker is started from the prefill's `TalkerPrompt`, gets
    each step's `fed_embed`, steps whenever it can, and makes the reference's codes."""
    from omnirail.models.qwen3_omni.encoders import AudioEncoder, ImageEncoder
    from omnirail.models.qwen3_omni.thinker import ThinkerRunner

    ref = references(kind)
    inputs = ref.inputs
    audio = image = None
    if "input_features" in inputs:
        encoder = AudioEncoder.from_pretrained(tiny_dir)
        audio = encoder.encode(inputs["input_features"], inputs["feature_attention_mask"])
    if "pixel_values" in inputs:
        image = ImageEncoder.from_pretrained(tiny_dir).encode(
            inputs["pixel_values"], inputs["image_grid_thw"]
        )
    thinker = ThinkerRunner.from_pretrained(tiny_dir)
    pre = thinker.prefill(inputs["input_ids"], max_new_tokens=16, audio=audio, image=image)
    state = runner.start(
        pre.talker,
        image_grid_thw=None if image is None else image.grid_thw,
        audio_feature_lengths=None if audio is None else audio.feature_lengths,
        **talker_options({}),
    )
    tokens, frames, out = [pre.first.token], [], pre.first
    while True:
        if not out.finished:  # the thinker's next step
            out = thinker.step(pre.state)
            tokens.append(out.token)
            runner.push_text(state, out.fed_embed)
            if out.finished:
                runner.end_text(state)
        while runner.ready(state):  # the talker catches up
            step = runner.step(state)
            if step.frame is not None:
                frames.append(step.frame)
            if step.finished:
                break
        if state.finished:
            break
    assert tokens == ref.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    assert torch.equal(stack(frames, runner.num_code_groups), ref.codes)


@pytest.mark.parametrize("kind", ["text", "audio", "system+image"])
def test_incremental_equals_all_at_once(kind, runner, streamer, references):
    """Thinker embeddings arriving one at a time, the talker stepping as soon as it can and
    parking when it cannot: the same codes, each frame made one token behind the thinker,
    and audio streaming before the text ends."""
    ref = references(kind)
    state = runner.start(ref.prompt, **ref.media, **talker_options({}))
    audio_state = streamer.start()
    frames, audio, parked = [], [], 0
    audio_before_text_end = 0
    pushed = 0
    while True:
        out = runner.step(state)
        if out.needs_input:
            parked += 1
            assert not runner.ready(state)
            if pushed < ref.text.shape[0]:
                runner.push_text(state, ref.text[pushed])
                pushed += 1
            else:
                audio_before_text_end = sum(a.numel() for a in audio)
                runner.end_text(state)
            continue
        if out.frame is not None:
            # Frame k needs generated tokens 0..k: here exactly k + 1 have arrived.
            if not state.text_done:
                assert pushed == len(frames) + 1
            frames.append(out.frame)
            audio.append(streamer.push(audio_state, out.frame))
        if out.finished:
            break
    audio.append(streamer.flush(audio_state))
    codes = stack(frames, runner.num_code_groups)
    assert parked == ref.text.shape[0] + 1  # once per token, and once for the end of text
    assert torch.equal(codes, ref.codes)
    assert torch.equal(codes, talk_all_at_once(runner, ref, **talker_options({})))
    assert audio_before_text_end > 0
    assert_audio_close(torch.cat(audio), ref.wav)


def first_new(tokens: list[int], at_least: int = 0) -> int:
    """A token of `tokens` (from index `at_least` on) that does not occur before it."""
    for i, token in enumerate(tokens):
        if i >= at_least and token not in tokens[:i]:
            return token
    raise AssertionError("no new token")


@pytest.mark.parametrize("at", [1, 4])
def test_thinker_stopping_early(at, runner, streamer, references):
    """The thinker ending at its eos as its second or fifth token: tts_eos moves up."""
    base = references("text")
    seq = base.inputs["input_ids"].shape[1]
    eos = first_new(base.sequences[0, seq:].tolist(), at)
    ref = references("text", thinker_eos_token_id=eos)
    generated = ref.sequences.shape[1] - seq
    assert ref.sequences[0, -1].item() == eos and ref.text.shape[0] == generated - 1
    codes = talk_all_at_once(runner, ref, **talker_options({}))
    assert torch.equal(codes, ref.codes)
    assert_audio_close(stream_audio(streamer, codes), ref.wav)


def test_thinker_saying_nothing(runner, reference, processor, references):
    """The thinker's first token is its eos: no text, so no audio (the reference fails on a
    size mismatch there: its assistant part has no first text token)."""
    base = references("text")
    seq = base.inputs["input_ids"].shape[1]
    eos = base.sequences[0, seq].item()
    with pytest.raises(RuntimeError, match="size"):
        run_reference(reference, processor, "text", thinker_eos_token_id=eos)
    state = runner.start(base.prompt, **base.media, **talker_options({}))
    assert runner.step(state).needs_input
    runner.end_text(state)
    assert runner.step(state).finished and state.frames == 0 and state.cache is None


def test_talker_stopping_at_eos(runner, streamer, references):
    """The talker ending at its eos (here a code the random weights do produce, as the
    reference's `talker_eos_token_id`): no frame for the eos, as in generate()."""
    base = references("image")
    eos = first_new(base.codes[0].tolist(), 5)
    overrides = {"talker_eos_token_id": eos}
    ref = references("image", **overrides)
    assert 0 < ref.codes.shape[1] < base.codes.shape[1]
    codes = talk_all_at_once(runner, ref, **talker_options(overrides))
    assert torch.equal(codes, ref.codes)
    assert_audio_close(stream_audio(streamer, codes), ref.wav)


@pytest.mark.parametrize("limit", [2, 9])  # 1: the reference fails (no frame at all)
def test_talker_max_new_tokens(limit, runner, references):
    overrides = {"talker_max_new_tokens": limit}
    ref = references("audio", **overrides)
    codes = talk_all_at_once(runner, ref, **talker_options(overrides))
    assert codes.shape[1] == limit - 1  # the last allowed token gets no frame, as in generate()
    assert torch.equal(codes, ref.codes)


# ---- many requests -----------------------------------------------------------------------

REQUESTS = [
    ("text", {"thinker_max_new_tokens": 3, "talker_max_new_tokens": 12}),
    ("image", {"thinker_max_new_tokens": 16, "talker_max_new_tokens": 40}),
    ("audio", {"thinker_max_new_tokens": 8, "talker_max_new_tokens": 24}),
    ("system+image", {"thinker_max_new_tokens": 12, "talker_max_new_tokens": 64}),
    ("text", {"thinker_max_new_tokens": 20, "talker_max_new_tokens": 30}),
    ("image+audio", {"thinker_max_new_tokens": 5, "talker_max_new_tokens": 48}),
    ("audio", {"thinker_max_new_tokens": 14, "talker_max_new_tokens": 6}),
    ("system+text", {"thinker_max_new_tokens": 10, "talker_max_new_tokens": 36}),
]


def test_interleaved_requests_equal_their_solo_runs(runner, streamer, references):
    """8 requests of different lengths stepped interleaved, as ARScheduler steps them: each
    thinker's embeddings trickle in at its own pace, a round steps every request that can
    step (in a shuffled order) and parks the rest; each gets the reference's codes and audio."""
    refs = [references(kind, **overrides) for kind, overrides in REQUESTS]
    rng = random.Random(17)
    states = [
        runner.start(r.prompt, **r.media, **talker_options(o))
        for r, (_, o) in zip(refs, REQUESTS, strict=True)
    ]
    audio_states = [streamer.start() for _ in refs]
    pushed = [0] * len(refs)
    frames: list[list[torch.Tensor]] = [[] for _ in refs]
    audio: list[list[torch.Tensor]] = [[] for _ in refs]
    done = [False] * len(refs)
    parked = 0
    while not all(done):
        for i, ref in enumerate(refs):  # each thinker makes progress at its own rate
            if not states[i].text_done and rng.random() < 0.6:
                if pushed[i] < ref.text.shape[0]:
                    runner.push_text(states[i], ref.text[pushed[i]])
                    pushed[i] += 1
                else:
                    runner.end_text(states[i])
        order = [i for i in range(len(refs)) if not done[i]]
        rng.shuffle(order)
        for i in order:
            out = runner.step(states[i])
            parked += out.needs_input
            if out.frame is not None:
                frames[i].append(out.frame)
                audio[i].append(streamer.push(audio_states[i], out.frame))
            if out.finished:
                audio[i].append(streamer.flush(audio_states[i]))
                done[i] = True
    assert parked > 0
    for i, ref in enumerate(refs):
        assert torch.equal(stack(frames[i], runner.num_code_groups), ref.codes), REQUESTS[i]
        assert_audio_close(torch.cat(audio[i]), ref.wav)


def test_no_state_leaks_between_requests(runner, reference, references):
    """Requests share only the (read-only) module: a request run after others, between
    others or again gets the same codes; the module's own rope_deltas and parameters are
    untouched; a finished or aborted request keeps no cache."""
    a, b = references("image"), references("audio")
    options = talker_options({})
    sentinel = torch.tensor([[12345]])
    reference.talker.rope_deltas = sentinel
    before = {k: v.clone() for k, v in reference.talker.state_dict().items()}
    alone = talk_all_at_once(runner, a, **options)
    # b runs between two steps of a and is aborted halfway; a second a runs interleaved.
    first = runner.start(a.prompt, **a.media, **options)
    runner.push_text(first, a.text)
    runner.end_text(first)
    other = runner.start(b.prompt, **b.media, **options)
    runner.push_text(other, b.text[:3])
    second = runner.start(a.prompt, **a.media, **options)
    runner.push_text(second, a.text)
    runner.end_text(second)
    got: dict[str, list[torch.Tensor]] = {"first": [], "second": []}
    for k in range(200):
        if k == 2:
            assert runner.step(other).frame is not None
        if k == 3:
            runner.release(other)  # aborted
            assert other.cache is None and other.finished
        for name, state in (("first", first), ("second", second)):
            out = runner.step(state)
            if out.frame is not None:
                got[name].append(out.frame)
        if first.finished and second.finished:
            break
    assert torch.equal(stack(got["first"], 4), alone)
    assert torch.equal(stack(got["second"], 4), alone)
    assert torch.equal(alone, a.codes)
    assert reference.talker.rope_deltas is sentinel
    after = reference.talker.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert first.cache is None and second.cache is None
    assert first.text == [] and second.text == []
    reference.talker.rope_deltas = None


def test_text_after_the_talker_ended_is_dropped(runner, references):
    ref = references("text")
    state = runner.start(ref.prompt, **ref.media, **talker_options({"talker_max_new_tokens": 2}))
    runner.push_text(state, ref.text[:2])
    while not runner.step(state).finished:
        pass
    runner.push_text(state, ref.text[2:])  # the thinker is still talking: ignored
    runner.end_text(state)
    assert runner.step(state).finished and state.text == []


def test_bad_requests(runner, references):
    ref = references("image")
    p, media = ref.prompt, ref.media
    with pytest.raises(ValueError, match="speaker"):
        runner.start(p, **media, speaker="nobody")
    with pytest.raises(ValueError, match="max_new_tokens"):
        runner.start(p, **media, max_new_tokens=0)
    with pytest.raises(ValueError, match="hidden states"):
        runner.start(TalkerPrompt(p.input_ids, p.embeds, None, p.multimodal_mask), **media)
    wrong_rows = TalkerPrompt(p.input_ids, p.embeds, p.accept_hidden[:, :5], p.multimodal_mask)
    with pytest.raises(ValueError, match="rows"):
        runner.start(wrong_rows, **media)
    cut = TalkerPrompt(
        p.input_ids[:, :-3], p.embeds[:, :-3], p.accept_hidden[:, :-3], p.multimodal_mask[:, :-3]
    )
    with pytest.raises(ValueError, match="assistant"):
        runner.start(cut, **media)
    state = runner.start(p, **media)
    with pytest.raises(ValueError, match="text embeddings"):
        runner.push_text(state, ref.text[0, :7])
    runner.end_text(state)
    with pytest.raises(RuntimeError, match="end_text"):
        runner.push_text(state, ref.text[0])


def test_media_hidden_rows_only(runner, references):
    """The thinker may send its hidden states for the media positions only."""
    ref = references("image")
    p = ref.prompt
    compact = TalkerPrompt(p.input_ids, p.embeds, p.multimodal_hidden(), p.multimodal_mask)
    state = runner.start(compact, **ref.media, **talker_options({}))
    full = runner.start(p, **ref.media, **talker_options({}))
    assert torch.equal(state.user_embeds, full.user_embeds)


def test_steps_leave_the_module_as_loaded(reference, references):
    """Decode steps run the MoE experts as `batched_mm` by calling it (see `rows`), never by
    switching the module's implementation: the module is only read (prefill, and generate()
    on the same model, keep `grouped_mm`), and the codes stay generate()'s."""
    runner = TalkerRunner.from_model(reference)
    loaded = reference.talker.get_experts_implementation()
    assert loaded[""] == "grouped_mm"
    ref = references("text")
    assert torch.equal(talk_all_at_once(runner, ref, **talker_options({})), ref.codes)
    assert reference.talker.get_experts_implementation() == loaded


def test_sampling_is_seeded(runner, references):
    """With do_sample (generate()'s default for the talker) a request's codes follow its own
    seed, whatever runs beside it (not compared with the reference: its RNG is global)."""
    ref = references("text")

    def sample(seed):
        return talk_all_at_once(runner, ref, do_sample=True, seed=seed, max_new_tokens=24)

    one = sample(1)
    assert torch.equal(one, sample(1))
    assert not torch.equal(one, sample(2))
    assert int(one.max()) < tiny_model.CODEBOOK_SIZE


def test_tts_embeds_read_from_the_checkpoint(tiny_dir, reference):
    cfg = reference.config
    ids = [cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id]
    rows = read_tts_embeds(tiny_dir, ids)
    assert torch.equal(rows, reference.thinker.get_input_embeddings().weight[ids].detach())


def test_from_pretrained_loads_the_talker_alone(tiny_dir, references):
    pytest.importorskip("omnirail.models.qwen3_omni.weights")
    alone = TalkerRunner.from_pretrained(tiny_dir)
    ref = references("image")
    assert torch.equal(talk_all_at_once(alone, ref, **talker_options({})), ref.codes)
    assert not hasattr(alone.talker, "thinker")


@pytest.mark.slow
def test_bfloat16(tiny_dir, processor):
    """In bfloat16 (the real checkpoint's dtype) the codes still equal the reference's; the
    streamed audio is within a few bfloat16 steps of the reference waveform's peak (measured
    here: 2.1e-4 at peaks 1.9e-2, one to two steps; float32 gives ~1e-8)."""
    model = tiny_model.load_reference(tiny_dir).to(torch.bfloat16)
    runner = TalkerRunner.from_model(model)
    streamer = Code2WavStreamer(model.code2wav)
    for kind in ("text", "image+audio"):
        ref = run_reference(model, processor, kind)
        codes = talk_all_at_once(runner, ref, **talker_options({}))
        assert torch.equal(codes, ref.codes)
        wav = stream_audio(streamer, codes)
        assert wav.shape == ref.wav.shape
        peak = ref.wav.float().abs().max().item()
        assert (wav - ref.wav.float()).abs().max().item() <= 2**-5 * peak
