"""`thinker`: a toy decoder-only transformer with a KV cache under `ARScheduler`.

Prefill runs a request's whole prompt (multimodal embeddings, then text) once as it joins
the batch and keeps each layer's keys and values; every decode step then runs only the
newest token of every running request through the model in one batch (continuous
batching: requests join and leave between steps). Each step streams the sampled token id
to `decode` and the token's last hidden state to `talker`.
"""

from __future__ import annotations

import math
import time

import torch
from torch import nn
from torch.nn import functional as F

from omnirail.stage_service.ar import ARRequest, ARScheduler, ARStep

from .text import BOS, EOS, PAD, VOCAB

DIM = 64
_MIN_TOKENS = 4  # EOS is masked before this many tokens
_MAX_POS = 4096


class ToyDecoder(nn.Module):
    """Pre-norm transformer blocks with per-request KV caches (lists of K/V per layer)."""

    def __init__(self, vocab: int, dim: int = DIM, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
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
        h = h + self.out[i](att.transpose(1, 2).reshape(b, t, -1))
        return h + self.mlp[i](self.norm2[i](h))


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
    top = torch.topk(logits / temperature, min(20, logits.numel()))
    choice = torch.multinomial(torch.softmax(top.values, -1), 1, generator=gen)
    return int(top.indices[choice])


def _forbidden(steps: int) -> list[int]:
    # Never <pad> or <bos>; no <eos> before _MIN_TOKENS, so every answer says something.
    return [PAD, BOS] if steps >= _MIN_TOKENS else [PAD, BOS, EOS]


def create_thinker(step_ms: float = 0.0, max_batch_size: int = 16, seed: int = 7) -> ARScheduler:
    """`step_ms` pads each decode step to that long, to act like a bigger model."""
    model = build_decoder(seed)

    def init(req: ARRequest) -> None:
        data = req.data
        options = data["options"]
        prompt = torch.cat([data["tokens"].new_tensor([BOS]), data["tokens"]])
        with torch.inference_mode():
            x = torch.cat([data["mm_embeds"].float(), model.embed(prompt)])
            hidden, cache = model.prefill(x)
            logits = model.lm_head(hidden)
        gen = torch.Generator().manual_seed(options["seed"])
        req.state.update(cache=cache, gen=gen, options=options, tokens=[])
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
            with torch.inference_mode():
                tokens = torch.tensor([r.state["next"] for r in running])
                hidden = model.decode(tokens, [r.state["cache"] for r in running])
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

    return ARScheduler(step, init_fn=init, max_batch_size=max_batch_size, name="thinker")
