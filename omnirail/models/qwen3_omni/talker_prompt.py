"""What the talker reads of a request's prompt, as transformers' `generate()` builds it:
the user turns (`user_part`: text positions through the talker's `text_projection` of the
thinker's embeddings, media positions through `hidden_projection` of its accept-layer
hidden states), the assistant line and any prompt text after it (`assistant_rows`), and
the thinker's tts_bos/eos/pad embedding rows (`read_tts_embeds`), read from the checkpoint
without loading the thinker's table."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .thinker import TalkerPrompt


def user_part(talker: Any, config: Any, prompt: TalkerPrompt) -> tuple[torch.Tensor, torch.Tensor]:
    """`_get_talker_user_parts` over the whole prompt, then only the user turns' positions,
    as generate() gathers them (one request: no padding)."""
    device, dtype = talker.device, talker.dtype
    hidden_size = config.talker_config.text_config.hidden_size
    thinker = config.thinker_config
    mm_token_ids = (thinker.audio_token_id, thinker.image_token_id, thinker.video_token_id)
    input_ids = prompt.input_ids.to(device).reshape(1, -1)
    seq = input_ids.shape[1]
    embeds = prompt.embeds.to(device, dtype).reshape(1, seq, -1)
    mm_mask = torch.zeros_like(input_ids, dtype=torch.bool)
    for token_id in mm_token_ids:
        mm_mask |= input_ids == token_id
    positions = torch.arange(seq, device=device).unsqueeze(0)
    im_start = torch.where(
        input_ids == config.im_start_token_id, positions, positions.new_full((), -1)
    )
    previous_im_start = torch.cummax(im_start, dim=-1).values.clamp_min(0)
    roles = input_ids.gather(1, (previous_im_start + 1).clamp_max(seq - 1))
    user_mask = roles == config.user_token_id
    if not user_mask.any():
        raise ValueError("the prompt has no user turn")
    user_length = int(user_mask.sum())
    user_indices = torch.where(user_mask, seq + positions, positions).argsort(dim=-1)[
        :, -user_length:
    ]
    with torch.inference_mode():
        full = torch.empty((1, seq, hidden_size), device=device, dtype=dtype)
        if mm_mask.any():
            if prompt.accept_hidden is None:
                raise ValueError("the prompt has media positions but no thinker hidden states")
            hidden = prompt.accept_hidden.to(device, dtype)
            hidden = hidden.reshape(-1, hidden.shape[-1])
            n_mm = int(mm_mask.sum())
            if hidden.shape[0] == seq:
                mm_hidden = hidden.reshape(1, seq, -1)[mm_mask]
            elif hidden.shape[0] == n_mm:
                mm_hidden = hidden.reshape(n_mm, -1)
            else:
                raise ValueError(
                    f"thinker hidden states have {hidden.shape[0]} rows: need the prompt's "
                    f"{seq} or its {n_mm} media positions"
                )
            full[mm_mask] = talker.hidden_projection(mm_hidden)
        full[~mm_mask] = talker.text_projection(embeds[~mm_mask])
        user_embeds = full.gather(1, user_indices.unsqueeze(-1).expand(-1, -1, full.shape[-1]))
    return user_embeds, input_ids.gather(1, user_indices)


def assistant_rows(
    config: Any, prompt: TalkerPrompt, device: Any, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The thinker embeddings from the last `<|im_start|>assistant` on: its three tokens
    (`<|im_start|>assistant\\n`), and any prompt text after them, which the talker reads
    before the generated tokens (none with the usual generation prompt)."""
    ids = prompt.input_ids.reshape(-1)
    starts = torch.nonzero(
        (ids[:-1] == config.im_start_token_id) & (ids[1:] == config.assistant_token_id)
    ).flatten()
    if starts.numel() == 0:
        raise ValueError("the prompt has no <|im_start|>assistant (no generation prompt)")
    start = int(starts[-1])
    if ids.shape[0] - start < 3:
        raise ValueError("the prompt ends inside its <|im_start|>assistant line")
    embeds = prompt.embeds.reshape(ids.shape[0], -1).to(device, dtype)
    return embeds[start : start + 3], embeds[start + 3 :]


def read_tts_embeds(model_path: str | Path, ids: Sequence[int]) -> torch.Tensor:
    """Rows `ids` of the thinker's input embedding table (`thinker.model.embed_tokens.weight`)
    read from the checkpoint without loading the table: `(len(ids), D)`."""
    from safetensors import safe_open

    from .weights import ModelDirError, weight_map

    name = "thinker.model.embed_tokens.weight"
    files = weight_map(model_path)
    if name not in files:
        raise ModelDirError(f"{model_path}: no tensor {name!r}")
    with safe_open(str(Path(model_path) / files[name]), framework="pt") as f:
        table = f.get_slice(name)
        return torch.stack([table[i : i + 1][0] for i in ids])
