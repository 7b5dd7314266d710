"""`rows.decode_rows`: one decode step of several requests in one forward, each request's
floats independent of the others (fixed slots, per-request attention, batched_mm experts)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from omnirail.models.qwen3_omni.rows import decode_rows, pad_slots
from omnirail.models.qwen3_omni.talker import TalkerRunner
from omnirail.models.qwen3_omni.thinker import ThinkerRunner
from omnirail.testing.tiny import qwen3_omni as tiny_model

SLOTS = 4
TEXTS = ["Describe this.", "Hello, how are you today?", "Count from one to ten: one two"]


@pytest.fixture(scope="module")
def thinker(tiny_dir):
    return ThinkerRunner.from_pretrained(tiny_dir, slots=SLOTS)


def _prefilled(thinker, processor):
    states = []
    for text in TEXTS:
        conv = tiny_model.sample_conversation("text", text)
        inputs = tiny_model.processor_inputs(processor, conv)
        states.append(thinker.prefill(inputs["input_ids"], max_new_tokens=8).state)
    return states


def _step(model, rows, positions, caches):
    embeds = pad_slots(torch.cat(rows), SLOTS)
    return decode_rows(model, embeds, pad_slots(torch.cat(positions, dim=1), SLOTS, dim=1), caches)


@pytest.mark.parametrize("model_name", ["thinker", "talker"])
def test_a_row_is_bitwise_the_same_alone_and_batched_in_any_slot(
    model_name, thinker, processor, tiny_dir
):
    """Request 0's hidden state and the key/values it appends are bitwise equal whether it
    runs alone, with two others, or in another slot; and the cache lengths differ (the
    attention is per request)."""
    states = _prefilled(thinker, processor)
    if model_name == "thinker":
        model = thinker.model
    else:  # the talker's decoder on the same random inputs and caches of its own width
        model = TalkerRunner.from_pretrained(tiny_dir).talker.model
    width = model.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randn((1, 1, width), generator=gen) for _ in states]
    positions = [s.position + 1 for s in states]
    if model_name == "thinker":
        caches = [s.cache for s in states]
    else:
        caches = []
        for n in (5, 9, 2):
            cache = DynamicCache(config=model.config)
            prompt = torch.randn((1, n, width), generator=gen)
            pos = torch.arange(n).view(1, 1, n).expand(4, 1, n)
            with torch.no_grad():
                model(inputs_embeds=prompt, position_ids=pos, past_key_values=cache, use_cache=True)
            caches.append(cache)
            positions[len(caches) - 1] = torch.full((4, 1, 1), n)
    assert len({c.get_seq_length() for c in caches}) == 3

    def run(order):
        cs = [copy.deepcopy(caches[i]) for i in order]
        out = _step(model, [rows[i] for i in order], [positions[i] for i in order], cs)
        at = order.index(0)
        return out[at], cs[at].layers[-1].keys

    alone = run([0])
    for order in ([0, 1, 2], [2, 1, 0], [1, 0]):
        hidden, keys = run(order)
        assert torch.equal(hidden, alone[0]), order
        assert torch.equal(keys, alone[1]), order

    # Why the slots: without padding (1 row alone, 3 together) the same row differs.
    def unpadded(order):
        cs = [copy.deepcopy(caches[i]) for i in order]
        rs = torch.cat([rows[i] for i in order])
        ps = torch.cat([positions[i] for i in order], dim=1)
        return decode_rows(model, rs, ps, cs)[order.index(0)]

    assert not torch.equal(unpadded([0]), unpadded([0, 1, 2]))


def test_pad_slots_pads_with_zero_rows_and_refuses_too_many():
    rows = torch.ones(2, 1, 4)
    padded = pad_slots(rows, 3)
    assert padded.shape == (3, 1, 4) and torch.equal(padded[:2], rows) and not padded[2].any()
    assert pad_slots(rows, 2) is rows
    assert pad_slots(torch.ones(4, 2, 1), 5, dim=1).shape == (4, 5, 1)
    with pytest.raises(ValueError, match="3 rows for 2 slots"):
        pad_slots(torch.zeros(3, 1, 4), 2)


def test_rms_is_bitwise_the_modules_norm(tiny_dir, thinker):
    """`_rms` (F.rms_norm in float32) equals every RMSNorm module of the decoders and the
    code predictor bitwise, on the shapes the steps use."""
    from omnirail.models.qwen3_omni.rows import _rms

    talker = TalkerRunner.from_pretrained(tiny_dir).talker
    norms = [
        m
        for model in (thinker.model, talker.model, talker.code_predictor.model)
        for m in model.modules()
        if type(m).__name__.endswith("RMSNorm")
    ]
    assert len(norms) > 10
    gen = torch.Generator().manual_seed(1)
    for norm in norms:
        width = norm.weight.shape[0]
        for shape in ((SLOTS, 1, width), (SLOTS, 1, 3, width), (1, 17, width)):
            x = torch.randn(shape, generator=gen) * 3
            with torch.no_grad():
                assert torch.equal(_rms(norm, x), norm(x)), (type(norm).__name__, shape)


def test_predictor_rows_follow_the_module_and_keep_rows_apart(tiny_dir):
    """`PredictorRows` (the code predictor as plain operations, fixed key/value buffers)
    gives the module's forward logits to rounding and its greedy codes exactly, one frame:
    the 2-position prefill, then one position per code group; and a row's logits are
    bitwise the same whatever the other rows hold."""
    from omnirail.models.qwen3_omni.rows import PredictorRows

    predictor = TalkerRunner.from_pretrained(tiny_dir).talker.code_predictor
    width = predictor.config.hidden_size
    groups = predictor.config.num_code_groups
    rows = PredictorRows(predictor, SLOTS)
    gen = torch.Generator().manual_seed(2)
    prefill = torch.randn((SLOTS, 2, width), generator=gen)
    later = [torch.randn((SLOTS, 1, width), generator=gen) for _ in range(groups - 2)]

    def lean(first, rest):
        out = [rows(first, 0, 0)]
        for step, embed in enumerate(rest, start=1):
            out.append(rows(embed, step + 1, step))
        return out

    def module(first, rest):
        cache = DynamicCache(config=predictor.config)
        out, position = [], 0
        with torch.no_grad():
            for step, embed in enumerate([first, *rest]):
                length = embed.shape[1]
                positions = torch.arange(position, position + length).expand(SLOTS, -1)
                hidden = predictor.model(
                    inputs_embeds=embed,
                    position_ids=positions,
                    past_key_values=cache,
                    use_cache=True,
                ).last_hidden_state
                out.append(predictor.lm_head[step](hidden[:, -1]))
                position += length
        return out

    got, want = lean(prefill, later), module(prefill, later)
    assert len(got) == groups - 1
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        assert torch.equal(g.argmax(-1), w.argmax(-1))

    # Row 0 alone (the others zeros) and among other rows: bitwise the same.
    def only_row0(t):
        z = torch.zeros_like(t)
        z[0] = t[0]
        return z

    alone = lean(only_row0(prefill), [only_row0(t) for t in later])
    for a, g in zip(alone, got, strict=True):
        assert torch.equal(a[0], g[0])


def test_predictor_rows_refuse_wrong_rows(tiny_dir):
    from omnirail.models.qwen3_omni.rows import PredictorRows

    predictor = TalkerRunner.from_pretrained(tiny_dir).talker.code_predictor
    rows = PredictorRows(predictor, SLOTS)
    width = predictor.config.hidden_size
    with pytest.raises(ValueError, match="for 4 slots"):
        rows(torch.zeros((SLOTS + 1, 2, width)), 0, 0)
    with pytest.raises(ValueError, match="for 4 slots"):
        rows(torch.zeros((SLOTS, 1, width)), predictor.config.num_code_groups, 1)


@pytest.mark.parametrize("rows", [8, 1])
def test_experts_follow_batched_mm_and_keep_rows_apart(tiny_dir, rows):
    """`_experts`: with 8 rows (16 pairs for 4 experts) every expert runs over every row;
    with 1 row (2 pairs) transformers' batched_mm runs. Both give batched_mm's sum to
    rounding, and row 0's floats do not depend on the other rows."""
    from transformers.integrations.moe import batched_mm_experts_forward

    from omnirail.models.qwen3_omni.rows import _experts

    mlp = TalkerRunner.from_pretrained(tiny_dir).talker.model.layers[0].mlp
    gen = torch.Generator().manual_seed(3)
    flat = torch.randn((rows, mlp.experts.gate_up_proj.shape[-1]), generator=gen)
    probs = torch.softmax(torch.randn((rows, mlp.experts.num_experts), generator=gen), -1)
    weights, chosen = torch.topk(probs, mlp.gate.top_k)
    with torch.no_grad():
        got = _experts(mlp.experts, flat, chosen, weights)
        want = batched_mm_experts_forward(mlp.experts, flat, chosen, weights)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        other = flat.clone()
        other[1:] = torch.randn(other[1:].shape, generator=gen)
        again = _experts(mlp.experts, other, chosen, weights)
    assert torch.equal(again[0], got[0])
