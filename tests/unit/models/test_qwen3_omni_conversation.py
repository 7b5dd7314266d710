"""The thinker's conversation state (`ThinkerRunner.keep` / `prefill(kept=...)`): a turn that
reuses the previous turn's KV cache computes only what its prompt adds, and answers what the
same prompt answers from scratch; a history that differs from what was kept reuses only the
prefix that agrees."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded

import pytest
import torch

pytest.importorskip("transformers")

from omnirail.models.qwen3_omni.encoders import AudioEncoder
from omnirail.models.qwen3_omni.stages import AnswerRenderer
from omnirail.models.qwen3_omni.thinker import ThinkerRunner
from omnirail.stage import ConversationStore
from omnirail.testing.tiny import qwen3_omni as tiny_model

MAX_NEW = 12


@pytest.fixture(scope="module")
def runner(tiny_dir):
    return ThinkerRunner.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def render(tiny_dir, runner):
    return AnswerRenderer(tiny_dir, runner.default_eos)


@pytest.fixture(scope="module")
def audio_encoder(tiny_dir):
    return AudioEncoder.from_pretrained(tiny_dir)


def _turn(runner, audio_encoder, processor, conversation, kept=None, render=None):
    """One turn: (tokens, prefill result, what it keeps for the next)."""
    inputs = tiny_model.processor_inputs(processor, conversation)
    audio = None
    if "input_features" in inputs:
        audio = audio_encoder.encode(inputs["input_features"], inputs["feature_attention_mask"])
    pre = runner.prefill(
        inputs["input_ids"], max_new_tokens=MAX_NEW, audio=audio, kept=kept, keepable=True
    )
    tokens = [pre.first.token]
    while not pre.state.finished:
        tokens.append(runner.step(pre.state).token)
    return tokens, pre, runner.keep(pre.state, render(tokens) if render else None)


def _user(seed: int, text: str) -> dict:
    audio = {"type": "audio", "audio": tiny_model.sample_audio(seed, 0.6)}
    return {"role": "user", "content": [audio, {"type": "text", "text": text}]}


def _assistant(processor, tokens: list[int]) -> dict:
    text = processor.tokenizer.decode(tokens, skip_special_tokens=True)
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


def test_a_turn_computes_only_what_it_adds(runner, audio_encoder, processor, render) -> None:
    history = [_user(0, "Hello there.")]
    tokens, first, kept = _turn(runner, audio_encoder, processor, history, render=render)
    assert first.reused == 0 and kept is not None
    for turn, seed in enumerate((1, 2), start=2):
        history += [_assistant(processor, tokens), _user(seed, f"Turn {turn} here.")]
        scratch_tokens, scratch, _ = _turn(runner, audio_encoder, processor, history)
        tokens, reused, kept_next = _turn(
            runner, audio_encoder, processor, history, kept, render=render
        )
        # The same answer and talker prompt as from scratch ...
        assert tokens == scratch_tokens
        assert torch.equal(reused.talker.input_ids, scratch.talker.input_ids)
        assert torch.equal(reused.talker.embeds, scratch.talker.embeds)
        assert torch.allclose(
            reused.talker.multimodal_hidden(), scratch.talker.multimodal_hidden(), atol=1e-4
        )
        # ... taking the whole history from the kept turn (its answer re-rendered as the
        # template does at its end), computing only the new user turn.
        assert reused.reused == kept.length
        assert 0 < reused.state.prompt_length - kept.length < kept.length
        kept = kept_next


def test_without_rendering_the_answer_some_of_it_is_computed_again(
    runner, audio_encoder, processor
) -> None:
    """The tiny model's random tokens do not survive decode and re-tokenizing: the kept
    turn then covers the history up to where they part, and the answer is still right."""
    history = [_user(0, "Hello there.")]
    tokens, _, kept = _turn(runner, audio_encoder, processor, history)
    history += [_assistant(processor, tokens), _user(1, "Next.")]
    scratch_tokens, _, _ = _turn(runner, audio_encoder, processor, history)
    got, pre, _ = _turn(runner, audio_encoder, processor, history, kept)
    assert got == scratch_tokens
    assert 0 < pre.reused <= kept.length


def test_a_different_history_reuses_only_what_agrees(runner, audio_encoder, processor) -> None:
    tokens, _, kept = _turn(runner, audio_encoder, processor, [_user(0, "Hello there.")])
    # Another first audio: nothing of the kept cache fits past the template's opening.
    other = [_user(5, "Hello there."), _assistant(processor, tokens), _user(1, "Next.")]
    scratch_tokens, scratch, _ = _turn(runner, audio_encoder, processor, other)
    got, pre, _ = _turn(runner, audio_encoder, processor, other, kept)
    assert got == scratch_tokens
    audio_start = int(torch.nonzero(scratch.talker.input_ids[0] == runner.audio_token_id)[0, 0])
    assert pre.reused <= audio_start


def test_the_store_is_bounded_and_expires() -> None:
    store: ConversationStore[str] = ConversationStore(max_bytes=100, idle_s=0.05)
    store.put("a", "A", 60)
    store.put("b", "B", 60)  # over budget: "a" goes
    assert store.take("a") is None and store.take("b") == "B"
    store.put("c", "C", 500)  # larger than the whole budget: not kept
    assert store.take("c") is None
    store.put("d", "D", 10)
    assert store.close("d") and not store.close("d")
    store.put("e", "E", 10)
    import time

    time.sleep(0.1)
    figures = store.figures()
    assert figures.states == 0 and figures.bytes == 0
    assert figures.evicted == {"budget": 2, "idle": 1, "closed": 1}
