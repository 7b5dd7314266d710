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
- **MoE experts with a fixed row count per matmul**, never `grouped_mm`, whose per-expert
  row counts depend on the batch: every expert over all the slots (one batched matmul per
  projection) when the slots pick at least as many (row, expert) pairs as there are
  experts, else transformers' `batched_mm` (one small matmul per pair, the number of pairs
  fixed by the slots). Called directly (`_experts`), not by switching the module's experts
  implementation, so the module is only read: prefill (and anyone else sharing it) runs
  the implementation it was loaded with.

Against transformers' `generate()` (one request, one-row matmuls) the floats differ by
rounding (~1e-6 relative on the tiny model); tokens and codec codes are equal there (the
integration and unit tests check it; the tiny checkpoint keeps its top logits ~7e-3
apart). A real checkpoint in bfloat16 may resolve near-ties differently from `generate()`,
as every batching server does, but never differently between a request alone and batched.

**Plain tensor operations.** At these sizes a step's cost is the number of operations it
runs, not their arithmetic (~1.5 us each on this CPU), and a module call adds its own
Python (transformers' wrappers: kwargs plumbing, output capture, mask building, rope
updates) to each. So the layers here run as the modules' operations, in their order, on
their weights, without calling the modules: RMSNorm as `F.rms_norm` in float32 (one fused
operation, bitwise the modules' float32 mean of squares, rsqrt and weight; the test checks
it), attention (`Qwen3OmniMoeThinkerTextAttention`: q/k/v projections, q/k RMSNorm over
the head dim, rope, attention, o projection, with the cache update and attention done per
request), the sparse MoE blocks (router softmax, top-k and renormalisation, experts, the
talker's sigmoid-gated shared expert) and the code predictor's dense layers. They repeat
transformers 5.19's forwards, the version pinned; the module is only read.

`PredictorRows` runs the talker's code predictor the same way: its rows move in lockstep
(one frame per request, every row at the same position), so its keys and values live in
fixed buffers and no mask is needed. Together these took the talker's step for 8 requests
from ~6 ms to ~4 ms here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from transformers.activations import SiLUActivation
from transformers.integrations.moe import batched_mm_experts_forward
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import apply_rotary_pos_emb


def slot_groups(items: Sequence[Any], slots: int) -> list[Sequence[Any]]:
    """`items` in runs of at most `slots`, in order (one slotted forward each)."""
    return [items[i : i + slots] for i in range(0, len(items), slots)]


def pad_slots(rows: torch.Tensor, slots: int, dim: int = 0) -> torch.Tensor:
    """`rows` with zero rows after them along `dim`, `slots` rows in all: the embeddings
    (n, 1, H) along 0, the position ids (4, n, 1) along 1."""
    missing = slots - rows.shape[dim]
    if missing < 0:
        raise ValueError(f"{rows.shape[dim]} rows for {slots} slots")
    if not missing:
        return rows
    shape = list(rows.shape)
    shape[dim] = missing
    return torch.cat((rows, rows.new_zeros(shape)), dim=dim)


@torch.inference_mode()
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
    `caches`: each request's `DynamicCache` (full attention layers), appended to.
    Returns the normed last hidden states (slots, 1, H); padding rows are meaningless.
    """
    n = len(caches)
    if n > embeds.shape[0]:
        raise ValueError(f"{n} caches for {embeds.shape[0]} rows")
    _full_attention_only(model.config, "decoder")
    hidden = embeds
    cos, sin = model.rotary_emb(hidden, positions[1:])
    for layer in model.layers:
        residual = hidden
        normed = _rms(layer.input_layernorm, hidden)
        hidden = residual + _attend(layer.self_attn, normed, cos, sin, caches)
        residual = hidden
        hidden = residual + _mlp(layer.mlp, _rms(layer.post_attention_layernorm, hidden))
    return _rms(model.norm, hidden)


class PredictorRows:
    """The talker's code predictor over rows in lockstep (every row the same length: one
    frame per request), as its forward computes it, with its own key/value buffers.

    A frame's predictor run is a 2-position prefill (the talker's hidden state and the
    group-0 code's embedding) and then one position per further code group, every row at
    the same position: no mask is needed (the prefill is causal through sdpa's
    `is_causal`), and the keys and values go into fixed buffers (slots, kv heads,
    positions, head dim) instead of a cache object. The rope tables for those few
    positions are the module's, computed once. Its decoder layers run as plain tensor
    operations on the module's weights, in the module's order (norms, projections, rope,
    sdpa, MLP): the module's forward and its wrappers (mask building, output capture, kwargs
    plumbing) were most of a small predictor's time. The module is only read.
    """

    def __init__(self, predictor: torch.nn.Module, slots: int) -> None:
        model = predictor.model
        config = model.config
        _full_attention_only(config, "code predictor")
        self.layers = list(model.layers[: config.num_hidden_layers])
        self.norm = model.norm
        self.heads = list(predictor.lm_head)
        self.slots = slots
        # Positions 0 .. num_code_groups - 1: the prefill's two, then one per further group.
        self.length = config.num_code_groups
        weight = self.norm.weight
        attn = self.layers[0].self_attn
        with torch.no_grad():
            probe = weight.new_zeros((1, self.length, config.hidden_size))
            positions = torch.arange(self.length, device=weight.device)[None]
            self.cos, self.sin = model.rotary_emb(probe, positions)
        shape = (slots, config.num_key_value_heads, self.length, attn.head_dim)
        self.keys = [weight.new_zeros(shape) for _ in self.layers]
        self.values = [weight.new_zeros(shape) for _ in self.layers]

    @torch.inference_mode()
    def __call__(self, embeds: torch.Tensor, start: int, step: int) -> torch.Tensor:
        """`embeds` (slots, L, H) at positions `start .. start + L` (the prefill: start 0,
        L 2; then L 1) through the layers; the last position's logits of head `step`
        (slots, V)."""
        length = embeds.shape[1]
        end = start + length
        if embeds.shape[0] != self.slots or end > self.length:
            raise ValueError(f"rows {tuple(embeds.shape)} at {start} for {self.slots} slots")
        cos, sin = self.cos[:, start:end], self.sin[:, start:end]
        hidden = embeds
        for layer, keys, values in zip(self.layers, self.keys, self.values, strict=True):
            attn = layer.self_attn
            residual = hidden
            x = _rms(layer.input_layernorm, hidden)
            query, key, value = _project(attn, x, cos, sin)
            keys[:, :, start:end] = key
            values[:, :, start:end] = value
            out = F.scaled_dot_product_attention(
                query,
                keys[:, :, :end],
                values[:, :, :end],
                is_causal=length > 1,
                scale=attn.scaling,
                enable_gqa=query.shape[1] != key.shape[1],
            )
            out = out.transpose(1, 2).reshape(self.slots, length, -1)
            hidden = residual + F.linear(out, attn.o_proj.weight, attn.o_proj.bias)
            residual = hidden
            hidden = residual + _dense_mlp(layer.mlp, _rms(layer.post_attention_layernorm, hidden))
        head = self.heads[step]
        return F.linear(_rms(self.norm, hidden[:, -1]), head.weight, head.bias)


def _full_attention_only(config: Any, what: str) -> None:
    types = getattr(config, "layer_types", None) or ["full_attention"]
    if set(types) != {"full_attention"}:
        raise ValueError(f"{what} layer types {types}: only full attention is supported")


def _rms(norm: Any, hidden: torch.Tensor) -> torch.Tensor:
    """`norm`'s forward (Qwen3-Omni's RMSNorm modules) without the module call: in float32
    `F.rms_norm`, one fused operation bitwise equal to the module's (float32 mean of
    squares, rsqrt, weight; measured on the shapes used here); otherwise the module's
    operations, which compute in float32 and cast back before the weight."""
    if hidden.dtype == torch.float32 and norm.weight.dtype == torch.float32:
        return F.rms_norm(hidden, norm.weight.shape, norm.weight, norm.variance_epsilon)
    x = hidden.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x.to(hidden.dtype)


def _act(mlp: Any) -> Any:
    """The MLP's activation: F.silu for transformers' SiLU modules (what their forwards
    call), else the module itself."""
    return F.silu if isinstance(mlp.act_fn, (torch.nn.SiLU, SiLUActivation)) else mlp.act_fn


def _dense_mlp(mlp: Any, x: torch.Tensor) -> torch.Tensor:
    """A gated MLP's forward: down(act(gate(x)) * up(x))."""
    gate = F.linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias)
    up = F.linear(x, mlp.up_proj.weight, mlp.up_proj.bias)
    return F.linear(_act(mlp)(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)


def _project(
    attn: Any, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention's query, key and value for `hidden` (rows, L, H), each (rows, heads,
    L, head dim): the q/k/v projections, q/k RMSNorm over the head dim, rope on q and k."""
    shape = (*hidden.shape[:2], -1, attn.head_dim)
    query = _rms(attn.q_norm, F.linear(hidden, attn.q_proj.weight, attn.q_proj.bias).view(shape))
    key = _rms(attn.k_norm, F.linear(hidden, attn.k_proj.weight, attn.k_proj.bias).view(shape))
    value = F.linear(hidden, attn.v_proj.weight, attn.v_proj.bias).view(shape).transpose(1, 2)
    query, key = apply_rotary_pos_emb(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
    return query, key, value


def _attend(
    attn: Any, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches: Sequence[Any]
) -> torch.Tensor:
    slots = hidden.shape[0]
    query, key, value = _project(attn, hidden, cos, sin)
    heads, kv_heads = query.shape[1], key.shape[1]
    outs = []
    for i, cache in enumerate(caches):
        # What DynamicLayer.update does for a full-attention layer, without its call.
        layer = cache.layers[attn.layer_idx]
        layer.keys = keys = torch.cat((layer.keys, key[i : i + 1]), dim=-2)
        layer.values = values = torch.cat((layer.values, value[i : i + 1]), dim=-2)
        # What transformers' sdpa_attention_forward runs for one query position and no mask
        # (not causal, scale = head_dim ** -0.5), without its per-call checks.
        outs.append(
            F.scaled_dot_product_attention(
                query[i : i + 1], keys, values, scale=attn.scaling, enable_gqa=heads != kv_heads
            )
        )
    if len(caches) < slots:
        outs.append(query.new_zeros((slots - len(caches), heads, 1, attn.head_dim)))
    out = torch.cat(outs).transpose(1, 2)
    return F.linear(out.reshape(slots, 1, -1), attn.o_proj.weight, attn.o_proj.bias)


def _mlp(mlp: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The layer's MLP: a dense one as is; a sparse MoE block with its experts as
    `batched_mm` (and the talker's gated shared expert), as its forward computes it: the
    router's softmax, top-k and renormalisation, the experts, the shared expert's sigmoid
    gate."""
    if not hasattr(mlp, "experts"):
        return _dense_mlp(mlp, hidden)
    flat = hidden.view(-1, hidden.shape[-1])
    shared = _dense_mlp(mlp.shared_expert, flat) if hasattr(mlp, "shared_expert") else None
    gate = mlp.gate
    logits = F.linear(flat, gate.weight)
    weights, experts = torch.topk(torch.softmax(logits, dtype=torch.float, dim=-1), gate.top_k)
    if gate.norm_topk_prob:
        weights /= weights.sum(dim=-1, keepdim=True)
    out = _experts(mlp.experts, flat, experts, weights.to(logits.dtype))
    if shared is not None:
        gate_out = F.linear(flat, mlp.shared_expert_gate.weight, mlp.shared_expert_gate.bias)
        out = out + torch.sigmoid(gate_out) * shared
    return out.view_as(hidden)


def _experts(
    experts: Any, flat: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """The routed experts' weighted sum for each row of `flat` (T, H), `chosen` and `weights`
    (T, top_k) from the router, each row's floats independent of the other rows (every
    matmul has a fixed row count: the slots, or one):

    - when the rows pick at least as many (row, expert) pairs as there are experts (few
      experts, full slots), every expert runs over every row: one batched matmul per
      projection, each expert's weights read once, where `batched_mm` would gather a copy
      of an expert's weights for every pair (measured here, 8 rows, 4 experts, top-2:
      114 us against 184 us a layer);
    - otherwise transformers' `batched_mm` (one matmul per pair, on gathered weights).

    Both take the chosen outputs in top-k order, times their weights, summed over top-k,
    as the reference combines them."""
    rows, top_k = chosen.shape
    plain = (
        experts.has_gate
        and not experts.has_bias
        and not experts.is_transposed
        and not getattr(experts, "has_post_expert_norm", False)
        and not experts._is_expert_parallel
    )
    if not plain or experts.num_experts > rows * top_k:
        return batched_mm_experts_forward(experts, flat, chosen, weights)
    gate_up = torch.matmul(flat, experts.gate_up_proj.transpose(1, 2))  # (E, T, 2I)
    out = torch.bmm(experts._apply_gate(gate_up), experts.down_proj.transpose(1, 2))  # (E, T, H)
    picked = out[chosen, torch.arange(rows, device=flat.device).unsqueeze(1)]  # (T, top_k, H)
    return (picked * weights.unsqueeze(-1)).sum(dim=1).to(flat.dtype)
