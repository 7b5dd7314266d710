"""One decode step of several requests in one forward, each request's output independent of
the others: fixed slots and per-request attention.

The thinker's text model and the talker's model are the same decoder (Qwen3-Omni MoE
layers: RMSNorm, attention with q/k norms and mRoPE, a sparse MoE block). Stepping each
request alone makes every linear layer a one-row matmul, and a step of `n` requests costs
`n` times the fixed cost of a forward, which is most of a decode step for small models and
all of it for Python. `decode_rows` runs `n` requests' next token through the layers
together instead:

- **Fixed slots.** The rows are padded to `slots` (zeros), whatever `n` is. A matmul's
  result for one row depends on how many rows the call has (BLAS picks another kernel and
  summation order for 1, 2-3 and 4+ rows on this project's CPU; cuBLAS does the same), never
  on the other rows' values or on the row's position (measured: bitwise equal). With the
  row count fixed, a request's floats are the same whoever else runs, so batching cannot
  change a greedy choice: a request gets bitwise what it gets alone.
- **Per-request attention.** Each request keeps its own `DynamicCache` (its own length);
  the projections, norms and rope run on all slots at once, then each request's query
  attends to its own cache (one `scaled_dot_product_attention` call each: padding keys
  under a mask changes the sums, ~1e-7, so one batched call would not be invariant).
- **MoE experts as `batched_mm`** (one small matmul per (row, expert) pair, the number of
  pairs fixed by the slots), not `grouped_mm`, whose per-expert row counts depend on the
  batch. It is called directly (`_mlp`), not by switching the module's experts
  implementation, so the module is only read: prefill (and anyone else sharing it) runs
  the implementation it was loaded with.

Against transformers' `generate()` (one request, one-row matmuls) the floats differ by
rounding (~1e-6 relative on the tiny model); tokens and codec codes are equal there (the
integration and unit tests check it; the tiny checkpoint keeps its top logits ~7e-3
apart). A real checkpoint in bfloat16 may resolve near-ties differently from `generate()`,
as every batching server does, but never differently between a request alone and batched.

The attention and the sparse MoE block below repeat the modules' forwards
(`Qwen3OmniMoeThinkerTextAttention`: q/k/v projections, q/k RMSNorm over the head dim, rope,
attention, o projection, with the cache update and attention done per request; the thinker's
and the talker's sparse MoE blocks, the talker's with its gated shared expert):
transformers 5.24's code, the version pinned.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from transformers.integrations.moe import batched_mm_experts_forward
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import apply_rotary_pos_emb


def slot_groups(items: Sequence[Any], slots: int) -> list[Sequence[Any]]:
    """`items` in runs of at most `slots`, in order (one slotted forward each)."""
    return [items[i : i + slots] for i in range(0, len(items), slots)]


def pad_rows(rows: Sequence[torch.Tensor], slots: int) -> torch.Tensor:
    """`rows` (each (1, 1, H) or (1, H)) stacked into (slots, 1, H), zeros after them."""
    if len(rows) > slots:
        raise ValueError(f"{len(rows)} rows for {slots} slots")
    first = rows[0]
    out = first.new_zeros((slots, 1, first.shape[-1]))
    for i, row in enumerate(rows):
        out[i, 0] = row.reshape(-1)
    return out


def pad_positions(positions: Sequence[torch.Tensor], slots: int) -> torch.Tensor:
    """Each request's (4, 1, 1) position ids into (4, slots, 1) (zeros after them)."""
    out = positions[0].new_zeros((4, slots, 1))
    for i, position in enumerate(positions):
        out[:, i] = position.reshape(4, 1)
    return out


@torch.no_grad()
def decode_rows(
    model: torch.nn.Module,
    embeds: torch.Tensor,
    positions: torch.Tensor,
    caches: Sequence[Any],
) -> torch.Tensor:
    """One token per request through `model`'s decoder layers and final norm.

    `model`: a `Qwen3OmniMoeThinkerTextModel` or `Qwen3OmniMoeTalkerModel`;
    `embeds`: (slots, 1, H), request i in row i for i < len(caches), the rest padding;
    `positions`: (4, slots, 1), text row first, then the three mRoPE rows;
    `caches`: each request's `DynamicCache`, appended to.
    Returns the normed last hidden states (slots, 1, H); padding rows are meaningless.
    """
    n = len(caches)
    if n > embeds.shape[0]:
        raise ValueError(f"{n} caches for {embeds.shape[0]} rows")
    hidden = embeds
    cos, sin = model.rotary_emb(hidden, positions[1:])
    for layer in model.layers:
        residual = hidden
        hidden = layer.input_layernorm(hidden)
        hidden = residual + _attend(layer.self_attn, hidden, cos, sin, caches)
        residual = hidden
        hidden = residual + _mlp(layer.mlp, layer.post_attention_layernorm(hidden))
    return model.norm(hidden)


@torch.no_grad()
def predict_rows(
    predictor: torch.nn.Module,
    embeds: torch.Tensor,
    positions: torch.Tensor,
    cache: Any,
    step: int,
) -> torch.Tensor:
    """One forward of the talker's code predictor over rows in lockstep (every row the same
    length: one frame per request), returning the last position's logits of head `step`
    (slots, V). Its decoder layers are called as its model's forward calls them, without the
    forward's wrappers (mask building, output capture; most of a small predictor's time):
    no mask is needed, every row being as long as the others, and the 2-position prefill is
    causal through sdpa's `is_causal`. `embeds`: (slots, L, H); `positions`: (slots, L);
    `cache`: one `DynamicCache` for all rows, appended to.
    """
    model = predictor.model
    if set(model.config.layer_types) != {"full_attention"}:
        raise ValueError(f"code predictor layer types {model.config.layer_types}: only full")
    hidden = embeds
    position_embeddings = model.rotary_emb(hidden, positions)
    for layer in model.layers[: model.config.num_hidden_layers]:
        hidden = layer(
            hidden,
            attention_mask=None,
            position_ids=positions,
            cache=cache,
            use_cache=True,
            position_embeddings=position_embeddings,
        )
    return predictor.lm_head[step](model.norm(hidden[:, -1:]))[:, -1]


def _attend(
    attn: Any, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches: Sequence[Any]
) -> torch.Tensor:
    slots = hidden.shape[0]
    shape = (slots, 1, -1, attn.head_dim)
    query = attn.q_norm(attn.q_proj(hidden).view(shape)).transpose(1, 2)
    key = attn.k_norm(attn.k_proj(hidden).view(shape)).transpose(1, 2)
    value = attn.v_proj(hidden).view(shape).transpose(1, 2)
    query, key = apply_rotary_pos_emb(query, key, cos, sin)
    heads, kv_heads = query.shape[1], key.shape[1]
    out = query.new_zeros((slots, heads, 1, attn.head_dim))
    for i, cache in enumerate(caches):
        keys, values = cache.update(key[i : i + 1], value[i : i + 1], attn.layer_idx)
        # What transformers' sdpa_attention_forward runs for one query position and no mask
        # (not causal, scale = head_dim ** -0.5), without its per-call checks.
        out[i] = F.scaled_dot_product_attention(
            query[i : i + 1], keys, values, scale=attn.scaling, enable_gqa=heads != kv_heads
        )[0]
    out = out.transpose(1, 2)
    return attn.o_proj(out.reshape(slots, 1, -1))


def _mlp(mlp: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The layer's MLP: a dense one as is; a sparse MoE block with its experts as
    `batched_mm` (and the talker's gated shared expert), as its forward computes it."""
    if not hasattr(mlp, "experts"):
        return mlp(hidden)
    flat = hidden.view(-1, hidden.shape[-1])
    shared = mlp.shared_expert(flat) if hasattr(mlp, "shared_expert") else None
    _, weights, experts = mlp.gate(flat)
    out = batched_mm_experts_forward(mlp.experts, flat, experts, weights)
    if shared is not None:
        out = out + torch.sigmoid(mlp.shared_expert_gate(flat)) * shared
    return out.view_as(hidden)
