"""`thinker`: a toy decoder-only transformer with a KV cache under `ARScheduler`.

Prefill runs a request's whole prompt (multimodal embeddings, then text) once as it joins
the batch and keeps each layer's keys and values; every decode step then runs only the
newest token of every running request through the model in one batch (continuous
batching: requests join and leave between steps). Each step streams the sampled token id
to `decode` and the token's last hidden state to `talker`.

With `tp_size: N` (N dividing its 4 heads) the decoder runs sharded over N rank processes,
Megatron style: each rank keeps its heads of every attention layer and its part of every
MLP, keeps the KV cache of its heads only, and one all-reduce after each attention output
and each MLP sums the parts. Rank 0 samples and streams; the other ranks run the same
prefill and decode calls (`tp.shared`), each on its own caches.
"""

from __future__ import annotations

import math
import time

import torch
from torch import nn
from torch.nn import functional as F

from omnirail.stage import ARRequest, ARScheduler, ARStep, TensorParallel

from .text import BOS, EOS, PAD, VOCAB

DIM = 64
_MIN_TOKENS = 4  # EOS is masked before this many tokens
_MAX_POS = 4096


class ToyDecoder(nn.Module):
    """Pre-norm transformer blocks with per-request KV caches (lists of K/V per layer)."""

    def __init__(self, vocab: int, dim: int = DIM, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads  # heads this process computes (all of them unless sharded)
        # Sums a sharded layer's partial outputs across ranks (nothing to sum unsharded).
        self.reduce = _no_reduce
        self.embed = nn.Embedding(vocab, dim)
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.mlp = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            for _ in range(layers)
        )
        self.norm1 = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.norm2 = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.final_norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab)
        pos = torch.arange(_MAX_POS)[:, None] / torch.pow(10000, torch.arange(0, dim, 2) / dim)
        table = torch.zeros(_MAX_POS, dim)
        table[:, 0::2], table[:, 1::2] = torch.sin(pos), torch.cos(pos)
        self.register_buffer("positions", table, persistent=False)

    def prefill(self, x: torch.Tensor) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """x: T x dim prompt embeddings → (last hidden state, the prompt's cache)."""
        h = (x + self.positions[: x.shape[0]])[None]  # 1 x T x dim
        cache: list[list[torch.Tensor]] = []
        for i in range(len(self.qkv)):
            q, k, v = self._heads(self.qkv[i](self.norm1[i](h)))
            cache.append([k[0], v[0]])
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = self._block_out(i, h, att)
        return self.final_norm(h[0, -1]), cache

    def decode(self, tokens: torch.Tensor, caches: list[list[list[torch.Tensor]]]) -> torch.Tensor:
        """One new token per request (B), attending to its own cache (extended in place)."""
        lengths = [c[0][0].shape[1] for c in caches]
        pos = self.positions[torch.tensor(lengths)]
        h = (self.embed(tokens) + pos)[:, None]  # B x 1 x dim
        longest = max(lengths) + 1
        # Padded batch attention: each request sees only its own length.
        mask = torch.arange(longest)[None, :] <= torch.tensor(lengths)[:, None]
        for i in range(len(self.qkv)):
            q, k, v = self._heads(self.qkv[i](self.norm1[i](h)))
            keys, values = [], []
            for b, cache in enumerate(caches):
                cache[i][0] = torch.cat([cache[i][0], k[b]], dim=1)
                cache[i][1] = torch.cat([cache[i][1], v[b]], dim=1)
                pad = longest - cache[i][0].shape[1]
                keys.append(F.pad(cache[i][0], (0, 0, 0, pad)))
                values.append(F.pad(cache[i][1], (0, 0, 0, pad)))
            att = F.scaled_dot_product_attention(
                q, torch.stack(keys), torch.stack(values), attn_mask=mask[:, None, None, :]
            )
            h = self._block_out(i, h, att)
        return self.final_norm(h[:, 0])

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = qkv.shape
        q, k, v = qkv.reshape(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        return q, k, v  # each B x heads x T x head_dim

    def _block_out(self, i: int, h: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = att.shape
        h = h + self.reduce(self.out[i](att.transpose(1, 2).reshape(b, t, -1)))
        return h + self.reduce(self.mlp[i](self.norm2[i](h)))


def _no_reduce(x: torch.Tensor) -> torch.Tensor:
    return x


@torch.no_grad()
def shard(model: ToyDecoder, tp: TensorParallel) -> ToyDecoder:
    """Keeps this rank's part of every layer: its heads' rows of each qkv projection and
    the matching columns of the attention output, its rows of the MLP's first layer and
    columns of its second. The output layers' biases stay on rank 0 only (the all-reduce
    adds them once). Embedding, norms and the LM head stay whole on every rank."""
    if model.heads % tp.size:
        raise ValueError(f"{model.heads} heads do not split over tp_size {tp.size}")
    dim = model.embed.embedding_dim
    head_dim = dim // model.heads
    per_rank = model.heads // tp.size
    mine = slice(tp.rank * per_rank * head_dim, (tp.rank + 1) * per_rank * head_dim)
    rows = torch.cat([torch.arange(dim)[mine] + part * dim for part in range(3)])
    for qkv, out, mlp in zip(model.qkv, model.out, model.mlp, strict=True):
        _keep(qkv, rows=rows)
        _keep(out, cols=torch.arange(dim)[mine], bias=tp.rank == 0)
        hidden = mlp[0].out_features // tp.size
        part = torch.arange(tp.rank * hidden, (tp.rank + 1) * hidden)
        _keep(mlp[0], rows=part)
        _keep(mlp[2], cols=part, bias=tp.rank == 0)
    model.heads = per_rank
    group = tp.group

    def reduce(x: torch.Tensor) -> torch.Tensor:
        torch.distributed.all_reduce(x, group=group)
        return x

    model.reduce = reduce
    return model


def _keep(
    layer: nn.Linear,
    rows: torch.Tensor | None = None,
    cols: torch.Tensor | None = None,
    bias: bool = True,
) -> None:
    weight = layer.weight
    if rows is not None:
        weight = weight[rows]
        layer.bias = nn.Parameter(layer.bias[rows].clone())
    if cols is not None:
        weight = weight[:, cols]
        if not bias:
            layer.bias = nn.Parameter(torch.zeros_like(layer.bias))
    layer.weight = nn.Parameter(weight.contiguous())
    layer.in_features, layer.out_features = weight.shape[1], weight.shape[0]


def build_decoder(seed: int = 7) -> ToyDecoder:
    model = ToyDecoder(len(VOCAB))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    return model.eval()


def sample(
    logits: torch.Tensor, temperature: float, gen: torch.Generator, forbid: list[int]
) -> int:
    """Top-k sampling with the request's own generator (the same seed, the same words);
    `forbid` are token ids that may not come next; temperature 0 is greedy."""
    logits = logits.clone()
    logits[forbid] = -math.inf
    if temperature == 0.0:
        return int(logits.argmax())
    top = torch.topk(logits, min(20, logits.numel()))
    scaled = top.values / temperature
    if not math.isfinite(float(scaled[0])):
        # A temperature so small that the top logit overflows (softmax would see inf - inf):
        # the distribution's limit, greedy.
        return int(top.indices[0])
    choice = torch.multinomial(torch.softmax(scaled, -1), 1, generator=gen)
    return int(top.indices[choice])


def _forbidden(steps: int) -> list[int]:
    # Never <pad> or <bos>; no <eos> before _MIN_TOKENS, so every answer says something.
    return [PAD, BOS] if steps >= _MIN_TOKENS else [PAD, BOS, EOS]


def create_thinker(
    step_ms: float = 0.0,
    max_batch_size: int = 16,
    seed: int = 7,
    tp: TensorParallel | None = None,
) -> ARScheduler:
    """`step_ms` pads each decode step to that long, to act like a bigger model. `tp`: the
    stage's tensor-parallel rank and group (the mesh passes it; one rank by default)."""
    tp = tp or TensorParallel("thinker")
    model = build_decoder(seed)
    if tp.size > 1:
        model = shard(model, tp)
    # Each rank's KV caches (of its own heads), by request.
    caches: dict[str, list[list[torch.Tensor]]] = {}

    def prefill(rid: str, x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            hidden, caches[rid] = model.prefill(x)
        return hidden

    def decode(rids: list[str], tokens: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return model.decode(tokens, [caches[r] for r in rids])

    def forget(rid: str) -> None:
        caches.pop(rid, None)

    # Every rank runs these on the arguments rank 0 gives (a follower only ever does). A
    # step's batch is not every live request (one may sit out while its consumer lags),
    # so caches go only when the scheduler says a request ended (end_fn).
    prefill = tp.shared("prefill", prefill)
    decode = tp.shared("decode", decode)
    forget = tp.shared("forget", forget)

    def init(req: ARRequest) -> None:
        data = req.data
        options = data["options"]
        prompt = torch.cat([data["tokens"].new_tensor([BOS]), data["tokens"]])
        with torch.inference_mode():
            x = torch.cat([data["mm_embeds"].float(), model.embed(prompt)])
        hidden = prefill(req.request_id, x)
        with torch.inference_mode():
            logits = model.lm_head(hidden)
        gen = torch.Generator().manual_seed(options["seed"])
        req.state.update(gen=gen, options=options, tokens=[])
        req.state["next"] = sample(logits, options["temperature"], gen, _forbidden(0))
        req.state["hidden"] = hidden

    def step(batch: list[ARRequest]) -> list[ARStep]:
        started = time.perf_counter()
        out = []
        # The token sampled last step is emitted now, with the hidden state it came from.
        for req in batch:
            token, st = req.state["next"], req.state
            st["tokens"].append(token)
            if token != EOS:
                req.emit(torch.tensor(token), target="decode", metadata={"modality": "token"})
                req.emit(st["hidden"].clone(), target="talker", metadata={"modality": "hidden"})
        running = [
            r
            for r in batch
            if r.state["next"] != EOS
            and len(r.state["tokens"]) < r.state["options"]["max_new_tokens"]
        ]
        if running:
            tokens = torch.tensor([r.state["next"] for r in running])
            hidden = decode([r.request_id for r in running], tokens)
            with torch.inference_mode():
                logits = model.lm_head(hidden)
            for i, req in enumerate(running):
                st = req.state
                st["hidden"] = hidden[i]
                forbid = _forbidden(req.steps + 1)
                st["next"] = sample(logits[i], st["options"]["temperature"], st["gen"], forbid)
        for req in batch:
            if req in running:
                out.append(ARStep())
                continue
            made = [t for t in req.state["tokens"] if t != EOS]
            reason = "eos" if req.state["tokens"][-1] == EOS else "length"
            out.append(ARStep(finished=True, result={"tokens": made, "finish_reason": reason}))
        if step_ms:
            time.sleep(max(0.0, step_ms / 1000.0 - (time.perf_counter() - started)))
        return out

    return ARScheduler(
        step, init_fn=init, end_fn=forget, max_batch_size=max_batch_size, name="thinker"
    )
