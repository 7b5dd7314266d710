"""code2wav's convolution stack run incrementally: each convolution keeps the input it will
need again, so a chunk of new frames costs only its own samples.

code2wav (`Qwen3OmniMoeCode2Wav`) turns the transformer's hidden states into audio with
causal convolutions (stride 1, left padding only), causal transposed convolutions (kernel at
most twice the stride, the first `left_pad` samples and the last `right_pad` dropped) and
pointwise parts (SnakeBeta, ConvNeXt's norm and linears, residual adds). Fed the hidden
states of a segment chunk by chunk, `ConvStream` gives the samples the module gives for the
whole segment at once, in order, with the same `d` samples (the transposed convolutions'
dropped ends) still to come at the end:

- a causal convolution keeps its last `(kernel - 1) * dilation` inputs (zeros at first, the
  module's left padding) and convolves them with the new inputs, unpadded: one output per
  new input, each the same dot product the module computes;
- a transposed convolution keeps its last input column (a zero column at first) and runs
  over it and the new columns: output positions `[stride, (n + 1) * stride)` get all their
  contributions from those columns (none from the next one, which starts at
  `(n + 1) * stride`; none from the one before, which ends before `stride` when the kernel
  is at most two strides), and on the first call its first `left_pad` are dropped, as the
  module drops them.

The float results equal the whole-segment forward to rounding (convolution kernels may sum
in another order for other lengths; the streamer's tests bound the audio at 1e-6 against
the reference, and measure ~1e-8). transformers 5.19's module structure is walked as is;
a layer this does not know raises at construction.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeCausalConvNet as CausalConv,
)
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeCausalTransConvNet as CausalTransConv,
)
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeCode2WavDecoderBlock as DecoderBlock,
)
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeCode2WavDecoderResidualUnit as ResidualUnit,
)
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeConvNeXtBlock as ConvNeXt,
)
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeSnakeBeta as SnakeBeta,
)

ConvState = dict[int, torch.Tensor]  # per request: a convolution's id -> the input it keeps


class ConvStream:
    """The convolution stack of `code2wav` (its `upsample` and `decoder` lists) with
    per-request state (`ConvState`, a dict: start each segment with an empty one)."""

    def __init__(self, code2wav: Any) -> None:
        self.layers: list[Any] = []
        for blocks in code2wav.upsample:
            self.layers.extend(blocks)
        for block in code2wav.decoder:
            self.layers.extend(block.block if isinstance(block, DecoderBlock) else [block])
        for layer in self.layers:
            self._check(layer)
        # SnakeBeta's exp(alpha) and 1 / (exp(beta) + eps), which its forward recomputes on
        # every call: computed once per module, by the same operations.
        self._snakes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        with torch.no_grad():
            for module in code2wav.modules():
                if isinstance(module, SnakeBeta):
                    alpha = torch.exp(module.alpha.unsqueeze(0).unsqueeze(-1))
                    beta = torch.exp(module.beta.unsqueeze(0).unsqueeze(-1))
                    self._snakes[id(module)] = (alpha, 1.0 / (beta + module.no_div_by_zero))

    @torch.inference_mode()
    def __call__(self, state: ConvState, hidden: torch.Tensor) -> torch.Tensor:
        """The samples (1, 1, m) the new hidden states (1, H, n) complete; `state` advances."""
        x = hidden
        for layer in self.layers:
            x = self._layer(state, layer, x)
        return x.clamp(min=-1, max=1)

    def _layer(self, state: ConvState, layer: Any, x: torch.Tensor) -> torch.Tensor:
        if isinstance(layer, CausalConv):
            return _conv(state, layer, x)
        if isinstance(layer, CausalTransConv):
            return _trans_conv(state, layer, x)
        if isinstance(layer, ConvNeXt):
            h = _conv(state, layer.dwconv, x).permute(0, 2, 1)
            h = layer.pwconv2(layer.act(layer.pwconv1(layer.norm(h))))
            return x + (layer.gamma * h).permute(0, 2, 1)
        if isinstance(layer, ResidualUnit):
            h = _conv(state, layer.conv1, self._snake(layer.act1, x))
            return _conv(state, layer.conv2, self._snake(layer.act2, h)) + x
        return self._snake(layer, x)

    def _snake(self, layer: SnakeBeta, x: torch.Tensor) -> torch.Tensor:
        """SnakeBeta's `x + 1 / (beta + eps) * sin(x * alpha) ** 2` with its parameters
        precomputed, in place on one temporary (bitwise the module's: the products and the
        sum are the same, taken in the other operand order)."""
        alpha, inverse = self._snakes[id(layer)]
        out = torch.mul(x, alpha)
        out.sin_()
        out.pow_(2)
        out.mul_(inverse)
        return out.add_(x)

    def _check(self, layer: Any) -> None:
        convs = _causal_convs(layer)
        if convs is not None:
            for conv in convs:
                if conv.conv.stride[0] != 1:
                    raise ValueError(f"code2wav: a causal convolution of stride {conv.stride}")
        elif isinstance(layer, CausalTransConv):
            kernel, stride = layer.conv.kernel_size[0], layer.conv.stride[0]
            if kernel > 2 * stride or layer.left_pad > stride:
                raise ValueError(f"code2wav: a transposed convolution {kernel}/{stride}")
        elif not isinstance(layer, SnakeBeta):
            raise ValueError(f"code2wav: no streaming form for {type(layer).__name__}")


def _causal_convs(layer: Any) -> list[CausalConv] | None:
    """The causal convolutions inside `layer` (None: a layer with none of its own kind)."""
    if isinstance(layer, CausalConv):
        return [layer]
    if isinstance(layer, ConvNeXt):
        return [layer.dwconv]
    if isinstance(layer, ResidualUnit):
        return [layer.conv1, layer.conv2]
    return None


def _conv(state: ConvState, layer: CausalConv, x: torch.Tensor) -> torch.Tensor:
    keep = layer.padding  # (kernel - 1) * dilation: the module's left padding
    if not keep:
        return layer.conv(x).contiguous()
    prev = state.get(id(layer))
    if prev is None:
        prev = x.new_zeros((*x.shape[:-1], keep))
    full = torch.cat((prev, x), dim=-1)
    state[id(layer)] = full[..., -keep:]
    return layer.conv(full).contiguous()


def _trans_conv(state: ConvState, layer: CausalTransConv, x: torch.Tensor) -> torch.Tensor:
    stride = layer.conv.stride[0]
    prev = state.get(id(layer))
    first = prev is None
    if first:
        prev = x.new_zeros((*x.shape[:-1], 1))
    state[id(layer)] = x[..., -1:]
    out = layer.conv(torch.cat((prev, x), dim=-1))[..., stride : (x.shape[-1] + 1) * stride]
    return (out[..., layer.left_pad :] if first else out).contiguous()
