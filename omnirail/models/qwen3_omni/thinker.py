"""Qwen3-Omni's thinker as a per-request step machine, token-for-token equal to transformers.

`ThinkerRunner` holds the thinker's text model (`thinker.model`, a
`Qwen3OmniMoeThinkerTextModel`: token embedding, MoE decoder layers, norm) and its `lm_head`,
nothing else: the encoders run elsewhere (`encoders.py`) and their outputs come in with the
request. Each request has its own `ThinkerState` (its KV cache, its 3D rope positions and
rope deltas, its tokens), so requests can join and leave between steps, as
`omnirail.stage.ar.ARScheduler` runs them: `prefill` when a request joins
(`init_fn`), `step` / `step_many` for one decode step of the running requests (`step_fn`).
No per-request value is ever stored on the shared modules (transformers' own thinker keeps
`rope_deltas` on the module, which would mix up interleaved requests).

Exactness. `prefill` calls the text model with exactly the arguments
`Qwen3OmniMoeForConditionalGeneration.generate()` gives it (transformers 5.19): the input
embeddings with audio and image features scattered in, the deepstack features and their
mask, the 4-row position ids (text positions, then the 3D mRoPE positions from transformers'
own `get_rope_index`), no attention mask (all ones is dropped by `generate()`), a
`DynamicCache`; `lm_head` over the same rows; greedy `argmax` of the float32 logits. So the
first token and the talker's prompt tensors are bitwise the reference's. Decode steps
(`step_many`) advance the positions by one as `generate()` does and keep its stop rule (an
`eos_token_id` or `max_new_tokens`), but run the running requests together in fixed slots
(`rows.decode_rows`): a request's floats then never depend on who else runs, and differ
from `generate()`'s one-row forward by rounding only, so the tokens are the reference's
(the unit tests check text, image and audio prompts and interleaved batches).

What the talker needs (`generate()` builds its inputs from the thinker's hidden states):
the prompt's input embeddings (`hidden_states[0]`), the hidden state at
`talker_config.accept_hidden_layer`, the multimodal mask and the prompt ids (`TalkerPrompt`,
from `prefill`), then the input embedding of every generated token fed back (`StepOutput.
fed_embed`, from each step; the last generated token is never fed, as in `generate()`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .encoders import AudioEncoding, ImageEncoding, InputError, audio_output_lengths
from .rows import decode_rows, pad_slots, slot_groups


class _RopeIndex:
    """transformers' `get_rope_index` (3D mRoPE positions and deltas) run on a thinker config
    alone, without the thinker module (whose encoders live in other processes)."""

    def __init__(self, thinker_config: Any) -> None:
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            Qwen3OmniMoePreTrainedModelForConditionalGeneration as Base,
        )

        self.config = thinker_config
        self.spatial_merge_size = thinker_config.vision_config.spatial_merge_size
        self._get_rope_index = Base.get_rope_index.__get__(self)
        self.get_llm_pos_ids_for_vision = Base.get_llm_pos_ids_for_vision.__get__(self)

    def __call__(self, input_ids, image_grid_thw, attention_mask, audio_seqlens):
        return self._get_rope_index(
            input_ids,
            image_grid_thw=image_grid_thw,
            video_grid_thw=None,
            attention_mask=attention_mask,
            use_audio_in_video=False,
            audio_seqlens=audio_seqlens,
            second_per_grids=None,
        )


@dataclass
class TalkerPrompt:
    """What the talker needs of a request's prompt (batch dim 1, as in `generate()`).

    `input_ids`: (1, L) long; `embeds`: (1, L, H) the thinker's input embeddings, audio and
    image features scattered in (`thinker_result.hidden_states[0][0]`); `accept_hidden`:
    (1, L, H) the hidden state after `talker_config.accept_hidden_layer` layers (index
    `accept_hidden_layer` of the text model's hidden states; before the deepstack addition;
    normed if it is the last); `multimodal_mask`: (1, L) bool, audio/image/video pad
    positions. The talker reads `accept_hidden` at the masked positions only
    (`multimodal_hidden()`), `embeds` elsewhere. All contiguous, on the runner's device.
    """

    input_ids: torch.Tensor
    embeds: torch.Tensor
    accept_hidden: torch.Tensor | None
    multimodal_mask: torch.Tensor

    def multimodal_hidden(self) -> torch.Tensor | None:
        """(multimodal positions, H): the rows of `accept_hidden` the talker projects."""
        if self.accept_hidden is None:
            return None
        return self.accept_hidden[self.multimodal_mask].contiguous()


@dataclass
class StepOutput:
    """One generated token. `fed_embed`: (1, 1, H) the input embedding of the token this step
    fed to the model (the previous token; None for the prefill's token), what `generate()`
    records as that step's `hidden_states[0]`. `finished`: no more tokens (this one is an
    `eos_token_id` or the `max_new_tokens`-th)."""

    token: int
    finished: bool
    fed_embed: torch.Tensor | None = None


@dataclass
class KeptPrompt:
    """What a conversation's thinker keeps for its next turn (`ThinkerRunner.keep`): the KV
    cache of every position it fed (the turn's prompt, then its generated tokens but the
    last, which is never fed), and for each of those positions what fed it: the token id,
    the media's content key (`encoders.media_keys`; 0 for text), the 4 position rows, and
    the talker's accept-layer hidden state (prompt positions; zeros where generated). The
    next turn reuses the longest prefix of its own prompt on which all of these agree
    (`ThinkerRunner.prefill(kept=...)`), so a changed history or other media is never
    mistaken for the kept one."""

    ids: torch.Tensor  # (Lc,) long
    keys: torch.Tensor  # (Lc,) long
    positions: torch.Tensor  # (4, 1, Lc)
    accept: torch.Tensor | None  # (1, Lc, H)
    cache: Any

    @property
    def length(self) -> int:
        return int(self.ids.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes it holds: the cache's keys and values and the per-position rows."""
        tensors = [self.ids, self.keys, self.positions]
        if self.accept is not None:
            tensors.append(self.accept)
        for layer in getattr(self.cache, "layers", ()):
            tensors.extend(t for t in (layer.keys, layer.values) if t is not None)
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class ThinkerState:
    """One request's decoding state; touch it only through the runner."""

    cache: Any
    position: torch.Tensor  # (4, 1, 1) float: the last fed position, text row first
    rope_deltas: torch.Tensor  # (1, 1): 3D positions minus text positions after the prompt
    prompt_length: int
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    finished: bool = False
    # The prompt as fed (what `keep` keeps of it): ids (1, L), media keys (L,), position
    # ids (4, 1, L), accept-layer hidden (1, L, H) or None.
    prompt: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None

    @property
    def last_token(self) -> int:
        return self.tokens[-1]


@dataclass
class Prefill:
    """`prefill`'s result: the request's state, its first token and its talker prompt;
    `reused`: the prompt's leading tokens taken from a kept turn (not computed)."""

    state: ThinkerState
    first: StepOutput
    talker: TalkerPrompt
    reused: int = 0


@dataclass
class PromptInputs:
    """A prompt as the text model takes it. `embeds`: (1, L, H) the input embeddings with the
    encoders' rows scattered in; `position_ids`: (4, 1, L) text positions then the three 3D
    rope rows; `rope_deltas`: (1, 1) 3D minus text positions after the prompt;
    `visual_pos_masks`: (1, L) image positions and `deepstack`: the image encoder's deepstack
    features (added after the first layers), both None without an image; `multimodal_mask`:
    (1, L) audio, image and video positions."""

    embeds: torch.Tensor
    position_ids: torch.Tensor
    rope_deltas: torch.Tensor
    visual_pos_masks: torch.Tensor | None
    deepstack: list[torch.Tensor] | None
    multimodal_mask: torch.Tensor


_DEFAULT = object()


class _EmbeddingOnly(torch.nn.Module):
    """A text model's `embed_tokens` and `config` without its layers (`prompts_only`)."""

    def __init__(self, table: torch.Tensor, config: Any) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding.from_pretrained(table, freeze=True)
        self.config = config


class ThinkerRunner:
    """Greedy decoding of the thinker's text model, one `ThinkerState` per request.

    `text_model`: `thinker.model` (a `Qwen3OmniMoeThinkerTextModel`); `lm_head`:
    `thinker.lm_head`; `config`: the checkpoint's `Qwen3OmniMoeConfig` (thinker token ids
    and rope settings, the talker's `accept_hidden_layer`, the default end-of-turn id).
    `accept_hidden_layer=None` (or a config without audio output) skips that hidden state.
    """

    def __init__(
        self,
        text_model: torch.nn.Module,
        lm_head: torch.nn.Module | None,
        config: Any,
        *,
        accept_hidden_layer: int | object | None = _DEFAULT,
        slots: int = 8,
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = slots
        self.model = text_model.eval()
        self.lm_head = lm_head.eval() if lm_head is not None else None
        self.config = config
        self.thinker_config = config.thinker_config
        self.text_config = text_model.config
        self.device = next(text_model.parameters()).device
        self.hidden_size = self.text_config.hidden_size
        tc = self.thinker_config
        self.audio_token_id = tc.audio_token_id
        self.image_token_id = tc.image_token_id
        self.video_token_id = tc.video_token_id
        self.n_window = tc.audio_config.n_window
        self.spatial_merge_size = tc.vision_config.spatial_merge_size
        if accept_hidden_layer is _DEFAULT:
            talker = getattr(config, "talker_config", None)
            enabled = getattr(config, "enable_audio_output", True)
            accept_hidden_layer = talker.accept_hidden_layer if talker and enabled else None
        layers = self.text_config.num_hidden_layers
        if accept_hidden_layer is not None and not 0 <= accept_hidden_layer <= layers:
            raise ValueError(f"accept_hidden_layer must be within 0..{layers}")
        self.accept_hidden_layer = accept_hidden_layer
        self.default_eos = getattr(config, "im_end_token_id", None)
        self.max_positions = self.text_config.max_position_embeddings
        self._rope_index = _RopeIndex(tc)

    @classmethod
    def from_pretrained(
        cls,
        model_path: str,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        **kwargs: Any,
    ) -> ThinkerRunner:
        """Loads only the checkpoint's `thinker.model` and `thinker.lm_head` tensors
        (`weights.load_submodule(..., "thinker.text")`) and its config."""
        from .weights import load_submodule, read_config

        text = load_submodule(model_path, "thinker.text", device, dtype)
        return cls(text.model, text.lm_head, read_config(model_path), **kwargs)

    @classmethod
    def prompts_only(cls, model_path: str, device: torch.device | str = "cpu") -> ThinkerRunner:
        """A runner for `check_request` and `prompt_inputs` alone, holding the checkpoint's
        input embedding table and no layers (it cannot prefill or step): a thinker that runs
        its model elsewhere (`vllm_thinker.py`) builds the same inputs with it."""
        from .weights import read_config, read_embed_table

        config = read_config(model_path)
        table = read_embed_table(model_path).to(device)
        return cls(_EmbeddingOnly(table, config.thinker_config.text_config), None, config)

    # ---- public API ---------------------------------------------------------------------

    def embed(self, token_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """The thinker's input embeddings of `token_ids`, (..., H) (e.g. the talker's
        tts_bos/eos/pad embeddings, which `generate()` takes from the thinker)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device)
        with torch.no_grad():
            return self.model.embed_tokens(ids).contiguous()

    @torch.inference_mode()
    def prefill(
        self,
        input_ids: torch.Tensor,
        *,
        max_new_tokens: int,
        attention_mask: torch.Tensor | None = None,
        audio: AudioEncoding | None = None,
        image: ImageEncoding | None = None,
        eos_token_id: int | Iterable[int] | object | None = _DEFAULT,
        kept: KeptPrompt | None = None,
        keepable: bool = False,
    ) -> Prefill:
        """Runs the prompt through the model into a new cache; returns the request's state,
        its first greedy token and its `TalkerPrompt`.

        `kept`: a previous turn of the same conversation (`keep`); the longest prefix of
        this prompt it covers (same ids, media keys and positions; never the whole prompt:
        the last token is always computed) is taken from its cache, and only the rest runs
        (`Prefill.reused` says how much was taken). `kept` is consumed either way.
        `keepable`: the request's state may be kept for a next turn (`keep`); only then does
        it hold on to its prompt's rows while it decodes.

        `input_ids`: (1, L) or (L,) long, the processor's ids with every audio/image pad
        token expanded; `attention_mask`: None or all ones (1, L) (one request, no padding);
        `audio` / `image`: the encoders' outputs for this request's audios / images, in
        prompt order (their `feature_lengths` / `grid_thw` give the 3D rope);
        `max_new_tokens`: 1.. (max_position_embeddings - L); `eos_token_id`: an id or ids
        that end generation (default: the config's `im_end_token_id`; None: none).
        """
        ids, max_new_tokens, eos = self.check_request(
            input_ids, max_new_tokens, attention_mask, audio, image, eos_token_id
        )
        length = ids.shape[1]
        inputs = self.prompt_inputs(ids, audio, image)
        embeds, position_ids, rope_deltas = inputs.embeds, inputs.position_ids, inputs.rope_deltas
        visual_pos_masks, deepstack = inputs.visual_pos_masks, inputs.deepstack

        # 3. The prompt through the model, into this request's own cache (what a kept turn
        # covers of it is taken from that turn's cache instead).
        from transformers import DynamicCache

        keys = self.media_keys(ids, audio, image) if kept is not None or keepable else None
        reused = (
            self._reusable(kept, ids, keys, inputs) if kept is not None and keys is not None else 0
        )
        if reused:
            assert kept is not None
            cache = kept.cache
            if kept.length > reused:
                cache.crop(reused - kept.length)  # negative: drop that many from the end
            if visual_pos_masks is not None:
                fresh = int(visual_pos_masks[:, reused:].sum())
                visual_pos_masks = visual_pos_masks[:, reused:]
                deepstack = [f[f.shape[0] - fresh :] for f in deepstack] if deepstack else None
                if not fresh:
                    visual_pos_masks = deepstack = None
        else:
            cache = DynamicCache(config=self.text_config)
        kwargs: dict[str, Any] = {}
        if self.accept_hidden_layer is not None:
            kwargs["output_hidden_states"] = True
        out = self.model(
            inputs_embeds=embeds[:, reused:],
            attention_mask=None,
            position_ids=position_ids[..., reused:],
            past_key_values=cache,
            use_cache=True,
            visual_pos_masks=visual_pos_masks,
            deepstack_visual_embeds=deepstack,
            **kwargs,
        )
        token = self._greedy(out.last_hidden_state)

        accept_hidden = None
        if self.accept_hidden_layer is not None:
            accept_hidden = out.hidden_states[self.accept_hidden_layer]
            if reused:
                assert kept is not None and kept.accept is not None
                accept_hidden = torch.cat([kept.accept[:, :reused], accept_hidden], dim=1)
            accept_hidden = accept_hidden.contiguous()
        state = ThinkerState(
            cache=cache,
            position=position_ids[..., -1:].clone(),
            rope_deltas=rope_deltas,
            prompt_length=length,
            max_new_tokens=max_new_tokens,
            eos_token_ids=eos,
            prompt=(ids, keys, position_ids, accept_hidden)
            if keys is not None and keepable
            else None,
        )
        first = self._record(state, token, None)
        talker = TalkerPrompt(
            input_ids=ids.contiguous(),
            embeds=embeds.contiguous(),
            accept_hidden=accept_hidden,
            multimodal_mask=inputs.multimodal_mask.contiguous(),
        )
        return Prefill(state=state, first=first, talker=talker, reused=reused)

    @torch.inference_mode()
    def keep(
        self, state: ThinkerState, continuation: Sequence[int] | None = None
    ) -> KeptPrompt | None:
        """What the finished request `state` leaves for its conversation's next turn (its
        cache moves into it; None when it holds none). Call instead of `release`.

        `continuation`: the tokens the next turn's prompt will have after this one's (the
        answer as the chat template renders it back: its text re-tokenized, then the
        end-of-turn tokens). Where they part from the generated tokens, the cache is cut
        and the rest of them computed now, at the end of this turn, so the next turn finds
        its history kept whole and computes only what it adds."""
        if state.cache is None or state.prompt is None:
            return None
        ids, keys, positions, accept = state.prompt
        fed = state.tokens[:-1]  # the last token was never fed
        cache, state.cache, state.prompt = state.cache, None, None
        state.finished = True
        ids = ids[0]
        if continuation is not None:
            agree = 0
            for mine, theirs in zip(fed, continuation, strict=False):
                if mine != theirs:
                    break
                agree += 1
            if agree < len(fed):
                cache.crop(agree - len(fed))
            rest = list(continuation[agree:])
            if rest:
                start = positions[..., -1:] + agree + 1
                steps = torch.arange(len(rest), device=positions.device, dtype=positions.dtype)
                rest_ids = torch.tensor([rest], dtype=torch.long, device=self.device)
                self.model(
                    inputs_embeds=self.model.embed_tokens(rest_ids),
                    attention_mask=None,
                    position_ids=start + steps.view(1, 1, -1),
                    past_key_values=cache,
                    use_cache=True,
                )
            fed = list(continuation)
        if fed:
            fed_ids = torch.tensor(fed, dtype=torch.long, device=self.device)
            steps = torch.arange(1, len(fed) + 1, device=positions.device, dtype=positions.dtype)
            fed_positions = positions[..., -1:] + steps.view(1, 1, -1)
            ids = torch.cat([ids, fed_ids])
            keys = torch.cat([keys, keys.new_zeros(len(fed))])
            positions = torch.cat([positions, fed_positions], dim=-1)
            if accept is not None:
                accept = torch.cat([accept, accept.new_zeros(1, len(fed), accept.shape[-1])], 1)
        return KeptPrompt(ids.contiguous(), keys, positions, accept, cache)

    def media_keys(
        self, ids: torch.Tensor, audio: AudioEncoding | None, image: ImageEncoding | None
    ) -> torch.Tensor:
        """(L,) long: each prompt position's media content key (0 for text; -1 where the
        encoding carries none: such a position is never reused)."""
        keys = torch.zeros(ids.shape[1], dtype=torch.long, device=self.device)
        for token, media in ((self.audio_token_id, audio), (self.image_token_id, image)):
            if media is None:
                continue
            where = ids[0] == token
            if media.keys is None:
                keys[where] = -1
            else:
                rows = media.keys.to(self.device).repeat_interleave(
                    media.token_lengths.to(self.device)
                )
                keys[where] = rows
        return keys

    def _reusable(
        self, kept: KeptPrompt, ids: torch.Tensor, keys: torch.Tensor, inputs: PromptInputs
    ) -> int:
        """How many leading positions of the prompt `kept` covers exactly (at most all but
        the last: its logits give the first token)."""
        n = min(kept.length, ids.shape[1] - 1)
        if n <= 0 or (self.accept_hidden_layer is not None and kept.accept is None):
            return 0
        same = kept.ids[:n] == ids[0, :n]
        same &= (kept.keys[:n] == keys[:n]) & (keys[:n] != -1)
        same &= (kept.positions[:, 0, :n] == inputs.position_ids[:, 0, :n]).all(0)
        first_different = torch.nonzero(~same)
        return int(first_different[0, 0]) if first_different.numel() else n

    def check_request(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: Any,
        attention_mask: torch.Tensor | None = None,
        audio: AudioEncoding | None = None,
        image: ImageEncoding | None = None,
        eos_token_id: int | Iterable[int] | object | None = _DEFAULT,
    ) -> tuple[torch.Tensor, int, frozenset[int]]:
        """A request's ids (1, L) on the device, its `max_new_tokens` and its end ids, after
        checking them and its media against each other (`InputError` naming the field)."""
        ids = self._check_ids(input_ids, attention_mask)
        max_new_tokens = self._check_max_new_tokens(max_new_tokens, ids.shape[1])
        eos = self._eos_ids(eos_token_id)
        self._check_media(ids, audio, image)
        return ids, max_new_tokens, eos

    def prompt_inputs(
        self, ids: torch.Tensor, audio: AudioEncoding | None, image: ImageEncoding | None
    ) -> PromptInputs:
        """What the text model is given for a checked prompt (`check_request`'s ids)."""
        # 1. Input embeddings, as Qwen3OmniMoeThinkerModel.forward builds them.
        embeds = self.model.embed_tokens(ids)
        if audio is not None:
            audio_mask = (ids == self.audio_token_id).unsqueeze(-1)
            features = audio.embeds.to(embeds.device, embeds.dtype)
            embeds = embeds.masked_scatter(audio_mask, features)
        visual_pos_masks = deepstack = None
        if image is not None:
            image_mask = (ids == self.image_token_id).unsqueeze(-1)
            features = image.embeds.to(embeds.device, embeds.dtype)
            embeds = embeds.masked_scatter(image_mask, features)
            visual_pos_masks = image_mask[..., 0]
            deepstack = list(image.deepstack)

        # 2. Positions, as generate()'s `_prepare_position_ids_for_generation`.
        mask = torch.ones_like(ids)
        text_positions = mask.long().cumsum(-1) - 1
        rope_positions, rope_deltas = self._rope_index(
            ids,
            image.grid_thw.to(self.device) if image is not None else None,
            mask,
            audio.feature_lengths.to(self.device) if audio is not None else None,
        )
        position_ids = torch.cat([text_positions[None, ...], rope_positions], dim=0)
        multimodal = (
            (ids == self.audio_token_id)
            | (ids == self.image_token_id)
            | (ids == self.video_token_id)
        )
        return PromptInputs(
            embeds, position_ids, rope_deltas, visual_pos_masks, deepstack, multimodal
        )

    def step(self, state: ThinkerState) -> StepOutput:
        """Feeds the request's last token and returns the next one (with the fed token's
        input embedding). Raises once the request has finished. The same forward as
        `step_many` (the slots padded), so a request alone gets what it gets batched."""
        return self.step_many([state])[0]

    @torch.inference_mode()
    def step_many(self, states: Sequence[ThinkerState]) -> list[StepOutput]:
        """One decode step for each of `states` (the running requests), in order, `slots` at
        a time in one forward (`rows.decode_rows`: rows padded to `slots`, each request's
        attention over its own cache), so every request's floats, and so its tokens, are the
        same whoever else is stepped with it (see `rows` for why fixed slots)."""
        if any(state.finished for state in states):
            raise RuntimeError("thinker: step on a finished request")
        return [out for group in slot_groups(states, self.slots) for out in self._step_slots(group)]

    def _step_slots(self, states: Sequence[ThinkerState]) -> list[StepOutput]:
        ids = torch.tensor([[s.last_token] for s in states], dtype=torch.long, device=self.device)
        fed = self.model.embed_tokens(ids)  # (n, 1, H)
        # generate()'s `_update_model_kwargs_for_generation`: last position + 1, every row.
        new_positions = torch.cat([s.position for s in states], dim=1) + 1  # (4, n, 1)
        hidden = decode_rows(
            self.model,
            pad_slots(fed, self.slots),
            pad_slots(new_positions, self.slots, dim=1),
            [s.cache for s in states],
        )
        logits = self.lm_head(hidden)[: len(states), -1].to(dtype=torch.float32)
        tokens = torch.argmax(logits, dim=-1).tolist()
        positions = new_positions.split(1, dim=1)
        fed_rows = fed.split(1)
        out = []
        for i, state in enumerate(states):
            state.position = positions[i]
            out.append(self._record(state, int(tokens[i]), fed_rows[i]))
        return out

    def release(self, state: ThinkerState) -> None:
        """Drops the request's KV cache (a finished or aborted request)."""
        state.cache = None
        state.prompt = None
        state.finished = True

    # ---- internals ----------------------------------------------------------------------

    def _greedy(self, hidden: torch.Tensor) -> int:
        logits = self.lm_head(hidden)
        scores = logits[:, -1].to(copy=True, dtype=torch.float32)
        return int(torch.argmax(scores, dim=-1)[0])

    def _record(self, state: ThinkerState, token: int, fed: torch.Tensor | None) -> StepOutput:
        state.tokens.append(token)
        if token in state.eos_token_ids or len(state.tokens) >= state.max_new_tokens:
            state.finished = True
        return StepOutput(token=token, finished=state.finished, fed_embed=fed)

    def _eos_ids(self, eos_token_id: Any) -> frozenset[int]:
        if eos_token_id is _DEFAULT:
            eos_token_id = self.default_eos
        if eos_token_id is None:
            return frozenset()
        ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        if not all(isinstance(i, int) and 0 <= i < self.text_config.vocab_size for i in ids):
            raise InputError("eos_token_id", f"expected token ids, got {eos_token_id!r}")
        return frozenset(ids)

    def _check_max_new_tokens(self, max_new_tokens: Any, length: int) -> int:
        limit = self.max_positions - length
        if (
            isinstance(max_new_tokens, bool)
            or not isinstance(max_new_tokens, int)
            or not 1 <= max_new_tokens <= limit
        ):
            raise InputError(
                "max_new_tokens",
                f"expected an integer within 1..{limit} (max_position_embeddings "
                f"{self.max_positions} minus the {length} prompt tokens), got {max_new_tokens!r}",
            )
        return max_new_tokens

    def _check_ids(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (
            torch.int64,
            torch.int32,
        ):
            raise InputError("input_ids", "expected an int64 tensor")
        ids = input_ids.unsqueeze(0) if input_ids.ndim == 1 else input_ids
        if ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] < 1:
            raise InputError(
                "input_ids", f"expected shape (1, length) for one request, got {tuple(ids.shape)}"
            )
        vocab = self.text_config.vocab_size
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise InputError("input_ids", f"token ids must be within 0..{vocab - 1}")
        if (ids == self.video_token_id).any():
            raise InputError("input_ids", "video tokens: video input is not supported")
        if attention_mask is not None:
            mask = attention_mask.unsqueeze(0) if attention_mask.ndim == 1 else attention_mask
            if tuple(mask.shape) != tuple(ids.shape) or not bool((mask == 1).all()):
                raise InputError(
                    "attention_mask",
                    f"expected all ones of shape {tuple(ids.shape)} (one request, no padding)",
                )
        return ids.to(self.device, torch.long)

    def _check_media(
        self, ids: torch.Tensor, audio: AudioEncoding | None, image: ImageEncoding | None
    ) -> None:
        hidden = self.hidden_size
        n_audio_tokens = int((ids == self.audio_token_id).sum())
        n_audio_starts = int((ids == self.thinker_config.audio_start_token_id).sum())
        if audio is None:
            if n_audio_tokens:
                raise InputError("audio", f"input_ids has {n_audio_tokens} audio tokens, no audio")
        else:
            emb, lengths = audio.embeds, audio.feature_lengths
            if emb.ndim != 2 or emb.shape[1] != hidden:
                raise InputError(
                    "audio.embeds", f"expected (tokens, {hidden}), got {tuple(emb.shape)}"
                )
            if lengths.ndim != 1 or lengths.dtype.is_floating_point or (lengths < 1).any():
                raise InputError("audio.feature_lengths", "expected positive ints (audios,)")
            if lengths.shape[0] != n_audio_starts:
                raise InputError(
                    "audio.feature_lengths",
                    f"{lengths.shape[0]} audios, but input_ids has {n_audio_starts}",
                )
            expected = int(audio_output_lengths(lengths.cpu(), self.n_window).sum())
            if not n_audio_tokens == emb.shape[0] == expected:
                raise InputError(
                    "audio.embeds",
                    f"{emb.shape[0]} rows for {n_audio_tokens} audio tokens in input_ids "
                    f"({expected} from feature_lengths {lengths.tolist()})",
                )
        n_image_tokens = int((ids == self.image_token_id).sum())
        if image is None:
            if n_image_tokens:
                raise InputError("image", f"input_ids has {n_image_tokens} image tokens, no image")
            return
        emb, grid = image.embeds, image.grid_thw
        if emb.ndim != 2 or emb.shape[1] != hidden:
            raise InputError("image.embeds", f"expected (tokens, {hidden}), got {tuple(emb.shape)}")
        if grid.ndim != 2 or grid.shape[1] != 3 or grid.dtype.is_floating_point:
            raise InputError(
                "image.grid_thw", f"expected ints (images, 3), got {tuple(grid.shape)}"
            )
        flat = ids[0]
        starts = torch.nonzero(flat[:-1] == self.thinker_config.vision_start_token_id)[:, 0]
        n_images = int((flat[starts + 1] == self.image_token_id).sum())
        if grid.shape[0] != n_images:
            raise InputError(
                "image.grid_thw", f"{grid.shape[0]} images, but input_ids has {n_images}"
            )
        expected = int((grid.prod(-1) // self.spatial_merge_size**2).sum())
        if not n_image_tokens == emb.shape[0] == expected:
            raise InputError(
                "image.embeds",
                f"{emb.shape[0]} rows for {n_image_tokens} image tokens in input_ids "
                f"({expected} from grid_thw {grid.tolist()})",
            )
        layers = self.text_config.num_hidden_layers
        if len(image.deepstack) > layers or any(
            tuple(f.shape) != tuple(emb.shape) for f in image.deepstack
        ):
            raise InputError(
                "image.deepstack",
                f"expected at most {layers} tensors shaped like image.embeds {tuple(emb.shape)}",
            )
