"""The omni demo's toy models in-process: batching equals solo runs, validation, audio."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from omnirail import InputError
from omnirail.models import fanin
from omnirail.models.omni_demo import encoders, preprocessing, speech, thinker
from omnirail.models.omni_demo.text import EOS, VOCAB, detokenize_piece, tokenize
from omnirail.stage.ar import ARRequest
from omnirail.stage.streaming import StreamState


def _prompt(text: str, seed: int, mm: int = 0, max_new_tokens: int = 12) -> dict:
    return {
        "text": text,
        "tokens": torch.tensor(tokenize(text)),
        "mm_embeds": torch.randn(mm, thinker.DIM, generator=torch.Generator().manual_seed(9)),
        "options": {"max_new_tokens": max_new_tokens, "seed": seed, "temperature": 0.8},
    }


def _generate(sched, reqs: list[ARRequest]) -> dict[str, tuple[list[int], list[torch.Tensor]]]:
    """Steps every request to the end in one batch; returns each one's tokens and hiddens."""
    for r in reqs:
        sched._init_fn(r)
    running, done = list(reqs), {}
    streams = {r.request_id: ([], []) for r in reqs}
    while running:
        steps = sched._step_fn(running)
        for r, st in zip(running, steps, strict=True):
            for msg in r.emitted:
                streams[r.request_id][0 if msg.target == "decode" else 1].append(msg.data)
            r.emitted.clear()
            r.steps += 1
            if st.finished:
                done[r.request_id] = st.result
        running = [r for r in running if r.request_id not in done]
    for rid, result in done.items():
        assert [int(t) for t in streams[rid][0]] == result["tokens"]
    return {rid: ([int(t) for t in toks], hid) for rid, (toks, hid) in streams.items()}


def test_batched_decode_matches_each_request_alone() -> None:
    prompts = [
        ("a short one", 1, 0, 6),
        ("a much longer prompt about rivers", 2, 5, 12),
        ("third", 3, 16, 9),
    ]
    solo = {}
    for i, (text, seed, mm, n) in enumerate(prompts):
        sched = thinker.create_thinker()
        solo.update(_generate(sched, [ARRequest(f"r{i}", _prompt(text, seed, mm, n))]))
    sched = thinker.create_thinker()
    batch = _generate(
        sched, [ARRequest(f"r{i}", _prompt(t, s, m, n)) for i, (t, s, m, n) in enumerate(prompts)]
    )
    for rid in solo:
        assert batch[rid][0] == solo[rid][0]
        for a, b in zip(batch[rid][1], solo[rid][1], strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert [len(batch[f"r{i}"][0]) for i in range(3)] == [6, 12, 9]  # lengths differ: joins/leaves


def test_seed_decides_the_words() -> None:
    a = _generate(thinker.create_thinker(), [ARRequest("a", _prompt("hello", 5))])["a"][0]
    b = _generate(thinker.create_thinker(), [ARRequest("b", _prompt("hello", 5))])["b"][0]
    c = _generate(thinker.create_thinker(), [ARRequest("c", _prompt("hello", 6))])["c"][0]
    assert a == b and a != c and EOS not in a


def test_tokenizer_round_trip_and_unknown_words() -> None:
    ids = tokenize("The river, the MOUNTAIN and zyzzyva!")
    assert [VOCAB[i] for i in ids[:4]] == ["the", "river", "the", "mountain"]
    assert len(VOCAB) > ids[-1] >= 5  # hashed into ordinary words, never a special token
    assert tokenize("zyzzyva") == tokenize("Zyzzyva")
    assert detokenize_piece(ids[1], first=True) == "River"
    assert detokenize_piece(ids[1], first=False) == " river"
    assert detokenize_piece(EOS, first=False) == "" and detokenize_piece(10**6, True) == ""


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({}, "inputs.text: required"),
        ({"text": "  "}, "inputs.text: required"),
        ({"text": "x" * 5000}, "inputs.text: at most 4000"),
        ({"text": "hi", "colour": 1}, "inputs: unknown fields ['colour']"),
        ({"text": "hi", "max_new_tokens": 0}, "inputs.max_new_tokens"),
        ({"text": "hi", "max_new_tokens": True}, "inputs.max_new_tokens"),
        ({"text": "hi", "speak": "yes"}, "inputs.speak"),
        ({"text": "hi", "seed": -1}, "inputs.seed"),
        ({"text": "hi", "temperature": 9}, "inputs.temperature"),
        ({"text": "hi", "image": "cat.png"}, 'inputs.image: an array, or the string "synthetic"'),
        ({"text": "hi", "image": np.zeros((4, 4))}, "inputs.image: expected HxWx3 or 3xHxW"),
        ({"text": "hi", "image": np.array([["a"] * 3] * 3)}, "inputs.image: expected numbers"),
        ({"text": "hi", "image": np.full((8, 8, 3), np.nan)}, "inputs.image: holds NaN"),
        ({"text": "hi", "audio": np.zeros((2, 10))}, "inputs.audio: expected mono"),
        ({"text": "hi", "audio": np.zeros(0)}, "inputs.audio: 1 sample to 60 s"),
        ("just text", "inputs: expected an object"),
    ],
)
def test_preprocessing_names_the_bad_field(inputs: object, message: str) -> None:
    with pytest.raises(InputError) as info:  # INVALID_ARGUMENT for the caller
        preprocessing.create_preprocessing()(inputs)
    assert info.value.message.startswith(message), info.value.message


def test_preprocessing_routes_only_to_the_encoders_a_request_needs() -> None:
    pre = preprocessing.create_preprocessing(image_size=32)
    text_only = pre({"text": "hello"})
    assert preprocessing.route("r", text_only) == ["mm_aggregate"]
    assert fanin.wait_for("r", "preprocessing", text_only) == ["preprocessing"]
    img = (np.arange(40 * 30 * 3) % 255).astype(np.uint8).reshape(40, 30, 3)
    both = pre({"text": "hello", "image": img, "audio": np.zeros(8000, dtype=np.int16)})
    assert preprocessing.route("r", both) == ["mm_aggregate", "image_encoder", "audio_encoder"]
    assert fanin.wait_for("r", "image_encoder", {}) is None  # not decided by an encoder
    assert both["patches"].shape == (16, 192)  # 32x32 resized image, 8x8 patches
    assert both["frames"].shape[1] == 64 and both["frames"].shape[0] == 51  # 0.5 s, 10 ms hop
    merged = fanin.merge_for_thinker(
        {
            "preprocessing": preprocessing.to_mm_aggregate(both),
            "image_encoder": encoders.create_image_encoder()(both),
            "audio_encoder": encoders.create_audio_encoder()(both),
        }
    )
    out = encoders.create_mm_aggregate()(merged)
    assert out["mm_layout"] == {"image": 16, "audio": 13}
    assert out["mm_embeds"].shape == (29, thinker.DIM)
    assert preprocessing.terminal_stages("r", {"text": "x", "speak": False}) == ["decode"]
    assert preprocessing.terminal_stages("r", {"text": "x"}) == ["decode", "code2wav"]


def test_talker_codes_follow_each_hidden_state() -> None:
    talker = speech.create_talker(frames_per_token=3)
    req = ARRequest("t", None)
    talker._init_fn(req)
    assert talker._step_fn([req])[0].needs_input
    req.inputs = [torch.randn(48), torch.randn(48)]
    first = talker._step_fn([req])[0]
    assert first.chunk.shape == (3, 4) and first.chunk.dtype == torch.int64
    assert int(first.chunk.max()) < 64 and len(req.inputs) == 1
    talker._step_fn([req])
    req.inputs_done = True
    assert talker._step_fn([req])[0].result == {"frames": 6}


def test_code2wav_streams_each_frame_once_without_clicks() -> None:
    voc = speech.create_code2wav(window=4, hop=2)
    state = StreamState("v", None)
    voc.new_request(state)
    gen = torch.Generator().manual_seed(0)
    chunks = [torch.randint(0, 64, (4, 4), generator=gen) for _ in range(6)]
    audio, pending = [], []
    for c in chunks:  # what StreamingScheduler does with window 4, hop 2
        state.chunks_in += 1
        pending.append(c)
        if len(pending) == 4:
            out = voc.process_window(state, pending, False)
            audio.append(out["pcm"])
            pending = pending[2:]
    out = voc.process_window(state, pending, True)
    if out is not None:
        audio.append(out["pcm"])
    pcm = torch.cat(audio)
    assert pcm.numel() == 6 * 4 * 320 == voc.finish(state)["samples"]
    assert float(pcm.abs().max()) <= 0.2 + 1e-6


def test_code2wav_audio_is_continuous_across_chunks() -> None:
    """Synthesizing frames in pieces (as windows stream) equals doing them at once."""
    voc = speech.create_code2wav()
    params = torch.randn(7, 5, generator=torch.Generator().manual_seed(3))
    whole, pieces = StreamState("a", None), StreamState("b", None)
    voc.new_request(whole)
    voc.new_request(pieces)
    at_once = voc._synthesize(whole, params)
    split = torch.cat([voc._synthesize(pieces, params[:2]), voc._synthesize(pieces, params[2:])])
    torch.testing.assert_close(split, at_once, atol=2e-4, rtol=0)
    assert abs(float(at_once[0])) < 1e-3  # fades in from silence, no click at the start


def test_a_request_sitting_out_steps_keeps_its_cache() -> None:
    """The thinker's KV caches live outside the batch (so tensor-parallel ranks can keep
    theirs): a request held back while its consumer lags must find its cache when it
    rejoins, and say what it says alone."""
    from omnirail.stage.scheduler import IncomingMessage
    from tests.unit.stage.scheduler_support import Collector

    alone = _generate(thinker.create_thinker(), [ARRequest("slow", _prompt("wait for me", 4))])
    sched = thinker.create_thinker()
    lagging = threading.Event()
    lagging.set()

    def unsent(rid: str | None = None) -> int:
        # "slow"'s consumer lags until told otherwise; every other keeps up (no stage
        # here marks chunks sent).
        return 10**6 if rid == "slow" and lagging.is_set() else 0

    sched.outbox.unsent = unsent  # type: ignore[method-assign]
    out = Collector(sched.outbox)
    sched.inbox.put(IncomingMessage("slow", "new_request", _prompt("wait for me", 4)))
    sched.inbox.put(IncomingMessage("fast", "new_request", _prompt("go", 5)))
    sched.start()
    try:
        assert out.final_for("fast").type == "result"
        lagging.clear()
        final = out.final_for("slow")
    finally:
        sched.stop()
    assert final.type == "result", final.data
    assert final.data["tokens"] == alone["slow"][0]


def test_the_example_pipeline_is_the_installed_one() -> None:
    """examples/omni_demo/pipeline.yaml (the file users edit and deploy, and the committed
    compose and k8s files' source) says what the installed pipeline says; both name the
    installed modules and the shared fan-in hooks."""
    from pathlib import Path

    import yaml

    from omnirail.models.omni_demo import pipeline_file

    example = Path(__file__).resolve().parents[3] / "examples" / "omni_demo" / "pipeline.yaml"
    installed = yaml.safe_load(pipeline_file().read_text())
    assert yaml.safe_load(example.read_text()) == installed
    (fan_in,) = [s for s in installed["stages"] if s["name"] == "mm_aggregate"]
    assert fan_in["wait_for_fn"] == "omnirail.models.fanin:wait_for"
    assert fan_in["merge_fn"] == "omnirail.models.fanin:merge_for_thinker"


def test_a_vanishing_temperature_samples_the_top_token_not_nan():
    """A temperature so small that logits / temperature overflow (found by the gateway's
    fuzzing: 7e-172) still gives a token: the top one."""
    logits = torch.tensor([0.5, 2.0, -1.0, 1.0])
    gen = torch.Generator().manual_seed(0)
    assert thinker.sample(logits, 7.36e-172, gen, forbid=[]) == 1
    assert thinker.sample(logits, 7.36e-172, gen, forbid=[1]) == 3
