"""Qwen3-Omni's audio and image encoders, one request at a time, exact against transformers.

`AudioEncoder(module).encode(input_features, feature_attention_mask)` and
`ImageEncoder(module).encode(pixel_values, image_grid_thw)` compute what the thinker's
`get_audio_features` / `get_image_features` compute inside
`Qwen3OmniMoeForConditionalGeneration.generate()` (transformers 5.19), with the same tensor
operations in the same order, so the results are bitwise equal to the reference's. The module
is the thinker's `audio_tower` (`Qwen3OmniMoeAudioEncoder`) or `visual`
(`Qwen3OmniMoeVisionEncoder`) alone: a stage process loads just that submodule.

One call encodes one request's items (all its audios, or all its images), as the reference
does: the encoders pack a request's items into one forward (windowed attention over
`cu_seqlens`), and packing several requests' items together changes the matmul shapes and
with them the float results, so requests are not packed together here.

Bad input raises `InputError` (a `ValueError`) whose message starts with the field's name.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch


class InputError(ValueError):
    """Bad request input; `field` names the input at fault and the message starts with it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def audio_output_lengths(feature_lengths: torch.Tensor, n_window: int) -> torch.Tensor:
    """Tokens the audio encoder makes from each audio's mel-frame count (transformers'
    `_get_feat_extract_output_lengths`), i.e. how many `<|audio_pad|>` tokens each audio has."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        _get_feat_extract_output_lengths,
    )

    return _get_feat_extract_output_lengths(feature_lengths, n_window)


def media_keys(items: Sequence[torch.Tensor]) -> torch.Tensor:
    """(len(items),) long: a 64-bit hash of each item's values (an audio's features, an
    image's patches). A conversation's thinker reuses a kept turn's media positions only
    where these agree, as vLLM keys its multimodal cache by the media's content: the
    encoder's output for the same media may differ in rounding with what it was batched
    with, its input does not."""
    keys = []
    for item in items:
        data = item.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
        digest = hashlib.blake2b(data, digest_size=8).digest()
        keys.append(int.from_bytes(digest, "little", signed=True))
    return torch.tensor(keys, dtype=torch.long)


@dataclass
class AudioEncoding:
    """One request's audio, encoded.

    `embeds`: (total tokens, thinker hidden) -- every audio's tokens, in order, as
    `get_audio_features(...).last_hidden_state`; `feature_lengths`: (num audios,) long, mel
    frames per audio (`feature_attention_mask.sum(1)`), which the thinker's 3D rope reads;
    `token_lengths`: (num audios,) long, tokens per audio (rows of `embeds`); `keys`: (num
    audios,) long, a hash of each audio's features (`media_keys`): what tells a kept turn's
    audio from another (None: not known, never taken as the same).
    """

    embeds: torch.Tensor
    feature_lengths: torch.Tensor
    token_lengths: torch.Tensor
    keys: torch.Tensor | None = None

    def split(self) -> tuple[torch.Tensor, ...]:
        """Per-audio embeddings, (tokens_i, hidden) each."""
        return torch.split(self.embeds, self.token_lengths.tolist())


@dataclass
class ImageEncoding:
    """One request's images, encoded.

    `embeds`: (total tokens, thinker hidden) -- every image's merged tokens in order (the
    concatenated `pooler_output` of `get_image_features`); `deepstack`: one tensor like
    `embeds` per deepstack level (the concatenated `deepstack_features`), added to the
    thinker's hidden states after its first `len(deepstack)` layers; `grid_thw`: (num images, 3)
    long, as the processor gave it (the thinker's 3D rope reads it); `token_lengths`:
    (num images,) long, tokens per image; `keys`: (num images,) long, a hash of each image's
    patches (`media_keys`; None: not known).
    """

    embeds: torch.Tensor
    deepstack: list[torch.Tensor]
    grid_thw: torch.Tensor
    token_lengths: torch.Tensor
    keys: torch.Tensor | None = None

    def split(self) -> tuple[tuple[torch.Tensor, ...], list[tuple[torch.Tensor, ...]]]:
        """Per-image embeddings and per-level per-image deepstack features, as
        `get_image_features` returns them (`pooler_output`, `deepstack_features`)."""
        sizes = self.token_lengths.tolist()
        return torch.split(self.embeds, sizes), [torch.split(f, sizes) for f in self.deepstack]


def _device_of(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


class AudioEncoder:
    """The thinker's audio tower (`Qwen3OmniMoeAudioEncoder`) for one request at a time."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module.eval()
        self.config = module.config
        self.device = _device_of(module)

    @classmethod
    def from_pretrained(
        cls, model_path: str, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
    ) -> AudioEncoder:
        """Loads only the checkpoint's `thinker.audio_tower` tensors (`weights.load_submodule`)."""
        from .weights import load_submodule

        return cls(load_submodule(model_path, "thinker.audio_tower", device, dtype))

    @torch.inference_mode()
    def encode(
        self, input_features: torch.Tensor, feature_attention_mask: torch.Tensor
    ) -> AudioEncoding:
        """`input_features`: (num audios, num_mel_bins, frames) float, the Whisper features the
        processor made; `feature_attention_mask`: (num audios, frames), 1 on each audio's
        frames (a prefix), 0 on padding. Returns the request's `AudioEncoding`, on this
        encoder's device."""
        input_features, mask = self._check(input_features, feature_attention_mask)
        # As Qwen3OmniMoeThinkerModel.get_audio_features: the valid frames of every audio,
        # concatenated along time, (mel bins, total frames).
        feature_lengths = torch.sum(mask, dim=1)
        flat = input_features.permute(0, 2, 1)[mask.bool()].permute(1, 0)
        out = self.module(flat, feature_lens=feature_lengths, return_dict=True)
        embeds = out.last_hidden_state
        token_lengths = audio_output_lengths(feature_lengths, self.config.n_window).long()
        if int(token_lengths.sum()) != embeds.shape[0]:  # not for valid input
            raise RuntimeError(
                f"audio encoder made {embeds.shape[0]} tokens, expected {token_lengths.tolist()}"
            )
        return AudioEncoding(
            embeds=embeds.contiguous(),
            feature_lengths=feature_lengths.long(),
            token_lengths=token_lengths,
            keys=media_keys(torch.split(flat, feature_lengths.tolist(), dim=1)),
        )

    def _check(
        self, input_features: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        bins = self.config.num_mel_bins
        if not isinstance(input_features, torch.Tensor) or not input_features.is_floating_point():
            raise InputError("input_features", "expected a float tensor")
        if input_features.ndim != 3 or input_features.shape[0] < 1:
            raise InputError(
                "input_features",
                f"expected shape (audios, {bins} mel bins, frames), "
                f"got {tuple(input_features.shape)}",
            )
        if input_features.shape[1] != bins:
            raise InputError(
                "input_features",
                f"expected {bins} mel bins (dim 1), got {input_features.shape[1]} "
                f"(shape {tuple(input_features.shape)})",
            )
        if not isinstance(mask, torch.Tensor) or mask.dtype.is_floating_point:
            raise InputError("feature_attention_mask", "expected an integer or bool tensor")
        n, _, frames = input_features.shape
        if tuple(mask.shape) != (n, frames):
            raise InputError(
                "feature_attention_mask",
                f"expected shape {(n, frames)} (audios, frames of input_features), "
                f"got {tuple(mask.shape)}",
            )
        mask_i = mask.long()
        if ((mask_i != 0) & (mask_i != 1)).any():
            raise InputError("feature_attention_mask", "values must be 0 or 1")
        lengths = mask_i.sum(1)
        if (lengths < 1).any():
            raise InputError("feature_attention_mask", "every audio needs at least one frame")
        prefix = torch.arange(frames, device=mask.device).unsqueeze(0) < lengths.unsqueeze(1)
        if not torch.equal(prefix, mask_i.bool()):
            raise InputError("feature_attention_mask", "each row must be ones then zeros")
        return input_features.to(self.device), mask.to(self.device)


class ImageEncoder:
    """The thinker's vision encoder (`Qwen3OmniMoeVisionEncoder`) for one request at a
    time: images only (video needs the processor's video path, not supported here)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module.eval()
        self.config = module.config
        self.device = _device_of(module)
        c = self.config
        self.patch_dim = c.in_channels * c.temporal_patch_size * c.patch_size * c.patch_size
        self.merge = c.spatial_merge_size

    @classmethod
    def from_pretrained(
        cls, model_path: str, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
    ) -> ImageEncoder:
        """Loads only the checkpoint's `thinker.visual` tensors (`weights.load_submodule`)."""
        from .weights import load_submodule

        return cls(load_submodule(model_path, "thinker.visual", device, dtype))

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> ImageEncoding:
        """`pixel_values`: (total patches, channels x temporal patch x patch x patch) float,
        the processor's flattened patches of every image; `image_grid_thw`: (num images, 3)
        long, each image's (t, h, w) patch grid. Returns the request's `ImageEncoding`, on
        this encoder's device."""
        pixel_values, grid = self._check(pixel_values, image_grid_thw)
        # As Qwen3OmniMoeThinkerModel.get_image_features (concatenated rather than split).
        out = self.module(pixel_values.type(self.module.dtype), grid_thw=grid, return_dict=True)
        token_lengths = (grid.prod(-1) // self.merge**2).long()
        return ImageEncoding(
            embeds=out.pooler_output.contiguous(),
            deepstack=[f.contiguous() for f in out.deepstack_features],
            grid_thw=grid,
            token_lengths=token_lengths,
            keys=media_keys(torch.split(pixel_values, grid.prod(-1).tolist())),
        )

    def _check(
        self, pixel_values: torch.Tensor, grid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(pixel_values, torch.Tensor) or not pixel_values.is_floating_point():
            raise InputError("pixel_values", "expected a float tensor")
        if pixel_values.ndim != 2 or pixel_values.shape[1] != self.patch_dim:
            raise InputError(
                "pixel_values",
                f"expected rank 2, (patches, {self.patch_dim}), got shape "
                f"{tuple(pixel_values.shape)}",
            )
        if (
            not isinstance(grid, torch.Tensor)
            or grid.dtype.is_floating_point
            or grid.ndim != 2
            or grid.shape[1] != 3
            or grid.shape[0] < 1
        ):
            shape = tuple(grid.shape) if isinstance(grid, torch.Tensor) else type(grid).__name__
            raise InputError(
                "image_grid_thw", f"expected an integer tensor (images, 3), got {shape}"
            )
        grid = grid.long()
        if (grid < 1).any():
            raise InputError("image_grid_thw", f"grid sizes must be positive, got {grid.tolist()}")
        if ((grid[:, 1:] % self.merge) != 0).any():
            raise InputError(
                "image_grid_thw",
                f"h and w must be multiples of spatial_merge_size {self.merge}, "
                f"got {grid.tolist()}",
            )
        patches = int(grid.prod(-1).sum())
        if patches != pixel_values.shape[0]:
            raise InputError(
                "pixel_values",
                f"image_grid_thw {grid.tolist()} describes {patches} patches, "
                f"but pixel_values has {pixel_values.shape[0]}",
            )
        return pixel_values.to(self.device), grid.to(self.device)
