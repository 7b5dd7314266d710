"""Qwen3-Omni's talker (with its code predictor) as a per-request streaming step machine.

The talker turns the thinker's text into codec frames, one frame of `num_code_groups` codes
per step: the talker's MoE decoder picks the first code (group 0) and the code predictor the
other groups. `TalkerRunner` does exactly what transformers'
`Qwen3OmniMoeForConditionalGeneration.generate()` does after the thinker, but per request and
incrementally, so that the talker can run one token behind a streaming thinker:

    runner = TalkerRunner.from_pretrained(model_path, device)  # or TalkerRunner.from_model(m)
    state = runner.start(prompt, image_grid_thw=..., audio_feature_lengths=...)
    runner.push_text(state, embed)      # each generated token's thinker input embedding
    runner.end_text(state)              # the thinker's text ended
    out = runner.step(state)            # TalkerStep: .frame (groups,), .finished, .needs_input

What crosses from thinker to talker, per request (the same tensors `generate()` derives from
`thinker_result.hidden_states`; `thinker.ThinkerRunner` produces them):

1. once, after the thinker's prefill, its `thinker.TalkerPrompt`: the prompt's token ids
   `(1, S)`, the thinker's input embeddings of the prompt `(1, S, D)` (`hidden_states[0]`:
   the text model's input, media features merged in) and its hidden states at
   `talker_config.accept_hidden_layer` (`(1, S, D)`; only its multimodal rows are read, and
   it may be None without media); with it, for the talker's 3D rope, the image grids
   `(images, 3)` and the audio feature lengths `(audios,)` (`feature_attention_mask.sum(-1)`),
   which come from the encoders (`ImageEncoding.grid_thw`, `AudioEncoding.feature_lengths`);
2. then, for every generated text token that the thinker feeds back into itself (every
   generated token but its last), that token's thinker input embedding (`StepOutput.
   fed_embed`, `(1, 1, D)`), in order;
3. finally, that the text ended (the thinker stopped at its end-of-turn token or at its
   `max_new_tokens`).

The talker's prompt is the user turns of the thinker's prompt (text positions through
`text_projection` of the thinker's embeddings, media positions through `hidden_projection` of
its hidden states) followed by the assistant part: `<|im_start|>assistant\\n`, 4 x tts_pad,
tts_bos and the first generated token, each added to the codec control embeddings (nothink,
think_bos, think_eos, speaker, codec_pad, codec_bos). The prefill therefore waits for the first
generated token's embedding. Each later step adds to the previous frame's summed codec
embeddings one "trailing text" embedding: the next generated token's, then tts_eos once the
text has ended, then tts_pad. Step `k` (k >= 1) thus needs generated token `k`: the talker runs
one token behind the thinker, and `step` answers `needs_input` while that token has not
arrived and the text has not ended.

Each request has its own KV cache and its own positions (transformers keeps `rope_deltas` on
the shared module; here they never touch it), so requests can be stepped interleaved in any
order. `step_many` steps several in one forward with fixed slots (`rows.py`), so each gets
bitwise what it gets alone. Logits processing is the reference's: greedy
(or sampled with the reference's warpers), `repetition_penalty` (1.05 in `generate()`) over the
talker's own generated codes, and the top 1024 ids of the talker's vocabulary suppressed
except `codec_eos`. A request ends at `codec_eos` or after `max_new_tokens` talker tokens; as in
`generate()`, the token that ends it (eos, or the last one allowed) gets no frame, so a request
yields at most `max_new_tokens - 1` frames.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache
from transformers.generation.logits_process import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .rows import PredictorRows, decode_rows, pad_slots, slot_groups
from .talker_prompt import assistant_rows, read_tts_embeds, user_part
from .thinker import TalkerPrompt

# The reference generate()'s defaults for the talker and (when sampling) its code predictor.
REPETITION_PENALTY = 1.05
TALKER_TEMPERATURE = 0.9
TALKER_TOP_K = 50
TALKER_TOP_P = 1.0
PREDICTOR_TOP_K = 50
PREDICTOR_TOP_P = 0.8
MAX_NEW_TOKENS = 4096


@dataclass
class TalkerStep:
    """One step's outcome: a codec frame `(num_code_groups,)` long, on the CPU (None when
    the step made none: parked for input, or the request ended); `finished` once the request
    is over; `needs_input` when it waits for the thinker's next token (nothing was run)."""

    frame: torch.Tensor | None = None
    finished: bool = False
    needs_input: bool = False


@dataclass(eq=False)
class TalkerState:
    """One request's talker state (build it with `TalkerRunner.start`)."""

    user_embeds: torch.Tensor  # (1, U, H): the talker's user part
    user_ids: torch.Tensor  # (1, U)
    assistant_head: torch.Tensor  # (3, D): thinker embeddings of <|im_start|>assistant\n
    rope: dict[str, Any]  # grids and lengths for the 3D rope
    speaker_id: int
    max_new_tokens: int
    processors: LogitsProcessorList
    do_sample: bool = False
    generator: torch.Generator | None = None
    predictor_processors: LogitsProcessorList | None = None
    # Thinker embeddings of the text after <|im_start|>assistant\n, (D,) each; None once used.
    text: list[torch.Tensor | None] = field(default_factory=list)
    text_done: bool = False
    # Generation state, set by the prefill.
    steps: int = 0  # talker tokens generated so far
    tokens: list[int] = field(default_factory=list)  # the talker's group-0 codes, in order
    frames: int = 0
    cache: Any = None
    positions: torch.Tensor | None = None  # (4, 1, 1) position ids of the last position
    past_hidden: torch.Tensor | None = None  # (1, 1, H): last layer, last position
    frame_embed: torch.Tensor | None = None  # (1, 1, H): the last frame's summed codec embeds
    eos_ids: tuple[int, ...] = ()
    repetition_penalty: float = 1.0
    seen: torch.Tensor | None = None  # (V,) bool: the codes in `tokens` (for the penalty)
    finished: bool = False

    @property
    def started(self) -> bool:
        return self.cache is not None or self.finished


class TalkerRunner:
    """The talker with its code predictor, stepping requests together (`step_many`, up to
    `slots` rows per forward).

    `talker` is a `Qwen3OmniMoeTalkerForConditionalGeneration` (with `code_predictor`,
    `text_projection`, `hidden_projection`, `codec_head`), `config` the checkpoint's
    `Qwen3OmniMoeConfig`, `tts_embeds` the thinker's input embeddings of the tts_bos, tts_eos
    and tts_pad tokens `(3, D)` (rows of the thinker's embedding table; see
    `read_tts_embeds`). The module is only read: every request's state is its own.
    """

    def __init__(
        self, talker: Any, config: Any, tts_embeds: torch.Tensor, *, slots: int = 8
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = slots
        self.talker = talker
        self.config = config
        self.talker_config = config.talker_config
        # transformers 5.19: the talker's 3D rope reads `config.audio_config.n_window`
        # (audio and an image in one request), which the talker's config lacks.
        if not hasattr(self.talker.config, "audio_config"):
            self.talker.config.audio_config = config.thinker_config.audio_config
        self.device = next(talker.parameters()).device
        self.dtype = talker.dtype
        text = self.talker_config.text_config
        self.vocab_size = text.vocab_size
        self.hidden_size = text.hidden_size
        self.num_code_groups = self.talker_config.num_code_groups
        self.codec_eos_id = self.talker_config.codec_eos_token_id
        self.suppress_mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        self.suppress_tokens = [
            i for i in range(self.vocab_size - 1024, self.vocab_size) if i != self.codec_eos_id
        ]
        self.suppress_mask[self.suppress_tokens] = True
        if tts_embeds.shape[0] != 3:
            raise ValueError(
                f"tts_embeds must be (3, D) (bos, eos, pad), got {tuple(tts_embeds.shape)}"
            )
        with torch.no_grad():
            # As generate(): the three rows projected together, (1, 1, H) each.
            projected = self.talker.text_projection(
                tts_embeds.to(self.device, self.dtype).unsqueeze(0)
            )
        self.tts_bos, self.tts_eos, self.tts_pad = projected.chunk(3, dim=1)
        self.text_width = config.thinker_config.text_config.hidden_size
        self.predictor_rows = PredictorRows(talker.code_predictor, slots)

    # ---- construction -----------------------------------------------------------------

    @classmethod
    def from_model(cls, model: Any, **kwargs: Any) -> TalkerRunner:
        """From a whole `Qwen3OmniMoeForConditionalGeneration` (tests, or when it is loaded
        anyway): its talker, config and the thinker's embedding rows."""
        cfg = model.config
        ids = torch.tensor([cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id])
        with torch.no_grad():
            embeds = model.thinker.get_input_embeddings()(ids.to(model.thinker.device))
        return cls(model.talker, cfg, embeds, **kwargs)

    @classmethod
    def from_pretrained(
        cls, model_path: str | Path, device: Any = "cpu", **kwargs: Any
    ) -> TalkerRunner:
        """Loads only the talker's tensors (and three rows of the thinker's embedding table)
        from the checkpoint directory `model_path`, onto `device`."""
        from .weights import load_submodule, read_config

        config = read_config(model_path)
        talker = load_submodule(model_path, "talker", device)
        ids = [config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id]
        return cls(talker, config, read_tts_embeds(model_path, ids), **kwargs)

    # ---- per request ------------------------------------------------------------------

    def start(
        self,
        prompt: TalkerPrompt,
        *,
        image_grid_thw: torch.Tensor | None = None,
        audio_feature_lengths: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        video_second_per_grid: torch.Tensor | None = None,
        use_audio_in_video: bool = False,
        speaker: str = "ethan",
        max_new_tokens: int = MAX_NEW_TOKENS,
        repetition_penalty: float = REPETITION_PENALTY,
        do_sample: bool = False,
        temperature: float = TALKER_TEMPERATURE,
        top_k: int = TALKER_TOP_K,
        top_p: float = TALKER_TOP_P,
        seed: int | None = None,
        eos_token_id: int | None = None,
    ) -> TalkerState:
        """A new request's state from the thinker's `TalkerPrompt` (the talker's user part is
        computed here). Nothing runs through the talker until the first text token arrives.

        `image_grid_thw`, `audio_feature_lengths` (and for video `video_grid_thw`,
        `video_second_per_grid`, `use_audio_in_video`): the request's media, for the 3D rope,
        as `generate()` passes them to the talker. The other arguments are `generate()`'s
        `talker_*` ones; `eos_token_id` overrides the config's codec_eos (for tests: the
        suppressed ids stay those of the config)."""
        talker_speakers = self.talker_config.speaker_id
        speaker_id = talker_speakers.get(speaker.lower()) if speaker else None
        if speaker_id is None:
            raise ValueError(f"speaker {speaker!r} is not one of {sorted(talker_speakers)}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if eos_token_id is not None and not 0 <= eos_token_id < self.vocab_size:
            raise ValueError(f"eos_token_id {eos_token_id} is outside the talker's vocabulary")
        user_embeds, user_ids = user_part(self.talker, self.config, prompt)
        head, tail = assistant_rows(self.config, prompt, self.device, self.dtype)
        processors = LogitsProcessorList()
        if repetition_penalty != 1.0:
            processors.append(RepetitionPenaltyLogitsProcessor(repetition_penalty))
        processors.append(SuppressTokensLogitsProcessor(self.suppress_tokens, device=self.device))
        predictor_processors = None
        generator = None
        if do_sample:
            processors.extend(_warpers(temperature, top_k, top_p))
            predictor_processors = LogitsProcessorList(
                _warpers(1.0, PREDICTOR_TOP_K, PREDICTOR_TOP_P)
            )
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed if seed is not None else torch.seed())
        state = TalkerState(
            user_embeds=user_embeds,
            user_ids=user_ids,
            assistant_head=head,
            rope={
                "image_grid_thw": self._opt(image_grid_thw),
                "video_grid_thw": self._opt(video_grid_thw),
                "audio_feature_lengths": self._opt(audio_feature_lengths),
                "video_second_per_grid": self._opt(video_second_per_grid),
                "use_audio_in_video": use_audio_in_video,
            },
            speaker_id=speaker_id,
            max_new_tokens=max_new_tokens,
            processors=processors,
            do_sample=do_sample,
            generator=generator,
            predictor_processors=predictor_processors,
            eos_ids=(self.codec_eos_id if eos_token_id is None else eos_token_id,),
            repetition_penalty=repetition_penalty,
            seen=torch.zeros(self.vocab_size, dtype=torch.bool),
        )
        if tail.shape[0]:
            self.push_text(state, tail)
        return state

    def push_text(self, state: TalkerState, embeds: torch.Tensor) -> None:
        """Adds the thinker input embeddings of the next generated text token(s), in order:
        `(..., D)`, e.g. one `StepOutput.fed_embed` `(1, 1, D)`, or `(n, D)` for several."""
        if state.finished:
            return  # the talker ended first (codec_eos): the rest of the text is not spoken
        if state.text_done:
            raise RuntimeError("text pushed after end_text")
        width = self.config.thinker_config.text_config.hidden_size
        if embeds.ndim == 0 or embeds.shape[-1] != width:
            raise ValueError(f"text embeddings must be (..., {width}), got {tuple(embeds.shape)}")
        state.text.extend(embeds.detach().reshape(-1, width).unbind(0))

    def end_text(self, state: TalkerState) -> None:
        """The thinker's text ended: after its last pushed token the talker reads tts_eos,
        then tts_pad."""
        if not state.finished:
            state.text_done = True

    def ready(self, state: TalkerState) -> bool:
        """Whether `step` can run now (False: it would answer `needs_input`)."""
        if state.finished:
            return True
        if not state.started:
            return bool(state.text) or state.text_done
        # Step k >= 1 reads trailing text entry k - 1, which is generated token k.
        return state.text_done or len(state.text) > state.steps

    def step(self, state: TalkerState) -> TalkerStep:
        """Runs one talker step for this request: generates the next group-0 code and, unless
        it ends the request, the code predictor's other groups, and returns that frame. The
        same forward as `step_many` (slots padded): alone it gets what it gets batched."""
        return self.step_many([state])[0]

    def step_many(self, states: Sequence[TalkerState]) -> list[TalkerStep]:
        """One step for each of `states`, in order. A request that starts prefills alone;
        the decoding ones run the talker together and then every request that got a code
        runs the code predictor together, `slots` rows per forward (`rows`: fixed slots,
        per-request attention), so what a request gets does not depend on the others."""
        out: list[TalkerStep] = [TalkerStep() for _ in states]
        chosen: list[tuple[int, TalkerState, torch.Tensor]] = []
        decoding: list[tuple[int, TalkerState]] = []
        with torch.inference_mode():
            for i, state in enumerate(states):
                if state.finished:
                    out[i] = TalkerStep(finished=True)
                elif not self.ready(state):
                    out[i] = TalkerStep(needs_input=True)
                elif not state.started and not state.text:
                    # The text ended before any token was fed back (the thinker's first token
                    # was its last): nothing to speak. (generate() fails here on a size
                    # mismatch.)
                    self.release(state)
                    out[i] = TalkerStep(finished=True)
                elif not state.started:
                    chosen.append((i, state, self._prefill(state)))
                else:
                    decoding.append((i, state))
            for group in slot_groups(decoding, self.slots):
                logits = self._decode_rows([state for _, state in group])
                chosen.extend((i, state, logits[j : j + 1]) for j, (i, state) in enumerate(group))
            speaking: list[tuple[int, TalkerState, int]] = []
            tokens = self._choose_codes([state for _, state, _ in chosen], [x for *_, x in chosen])
            for (i, state, _), token in zip(chosen, tokens, strict=True):
                state.tokens.append(token)
                if state.seen is not None:
                    state.seen[token] = True
                state.steps += 1
                if token in state.eos_ids or state.steps >= state.max_new_tokens:
                    self.release(state)
                    out[i] = TalkerStep(finished=True)
                else:
                    speaking.append((i, state, token))
            for group in slot_groups(speaking, self.slots):
                frames = self._predict_rows([st for _, st, _ in group], [t for _, _, t in group])
                for (i, state, _), frame in zip(group, frames, strict=True):
                    state.frames += 1
                    out[i] = TalkerStep(frame=frame)
        return out

    def release(self, state: TalkerState) -> None:
        """Drops the request's cache and buffers (at its end, or when it is aborted)."""
        state.finished = True
        state.cache = None
        state.past_hidden = None
        state.frame_embed = None
        state.positions = None
        state.text = []
        state.user_embeds = state.user_embeds[:, :0]

    # ---- the model --------------------------------------------------------------------

    def _opt(self, value: Any) -> torch.Tensor | None:
        return None if value is None else torch.as_tensor(value).to(self.device)

    def _prefill(self, state: TalkerState) -> torch.Tensor:
        """`_get_talker_assistant_parts` with the first generated token (if any), then the
        talker's forward over user + assistant parts. Returns the last position's logits."""
        talker = self.talker
        cfg = self.talker_config
        # generate() projects <|im_start|>assistant\n and the text after it together.
        rows = [state.assistant_head]
        if state.text:
            rows.append(_take(state.text, 0).to(self.device, self.dtype).reshape(1, -1))
        assistant_hidden = talker.text_projection(torch.cat(rows, dim=0).unsqueeze(0))
        assistant_text = torch.cat(
            (
                assistant_hidden[:, :3],
                self.tts_pad.expand(1, 4, -1),
                self.tts_bos.expand(1, -1, -1),
                assistant_hidden[:, 3:4],
            ),
            dim=1,
        )
        special = torch.tensor(
            [
                [
                    cfg.codec_nothink_id,
                    cfg.codec_think_bos_id,
                    cfg.codec_think_eos_id,
                    state.speaker_id,
                    cfg.codec_pad_id,
                    cfg.codec_bos_id,
                ]
            ],
            device=self.device,
            dtype=torch.long,
        )
        assistant_codec = torch.cat(
            (
                torch.zeros((1, 3, self.hidden_size), device=self.device, dtype=self.dtype),
                talker.get_input_embeddings()(special),
            ),
            dim=1,
        )
        assistant_embeds = assistant_text + assistant_codec
        assistant_ids = torch.full(
            (1, assistant_text.shape[1]),
            self.config.tts_pad_token_id,
            dtype=torch.long,
            device=self.device,
        )
        inputs_embeds = torch.cat((state.user_embeds, assistant_embeds), dim=1)
        talker_ids = torch.cat((state.user_ids, assistant_ids), dim=1)
        length = inputs_embeds.shape[1]
        attention_mask = torch.ones((1, length), dtype=torch.long, device=self.device)
        state.positions = self._prefill_positions(state, talker_ids, attention_mask)
        state.cache = DynamicCache(config=self.talker_config.text_config)
        out = talker(
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=state.positions,
            past_key_values=state.cache,
            use_cache=True,
            output_hidden_states=True,
        )
        state.user_embeds = state.user_embeds[:, :0]  # in the cache now
        state.positions = state.positions[..., -1:]  # decode steps count on from the last
        state.past_hidden = out.hidden_states[0][-1][:, -1:]
        return out.logits[:, -1, :]

    def _prefill_positions(
        self, state: TalkerState, talker_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        """`_prepare_position_ids_for_generation` of the talker, without writing
        `rope_deltas` on the module: text positions, then the three rope rows (3D for media)."""
        text_positions = attention_mask.long().cumsum(-1) - 1
        text_positions = text_positions.masked_fill(attention_mask == 0, 0)
        rope = state.rope
        has_media = rope["audio_feature_lengths"] is not None or any(
            grid is not None and grid.numel() > 0
            for grid in (rope["image_grid_thw"], rope["video_grid_thw"])
        )
        if has_media:
            vision_positions, _ = self.talker.get_rope_index(
                talker_ids,
                image_grid_thw=rope["image_grid_thw"],
                video_grid_thw=rope["video_grid_thw"],
                attention_mask=attention_mask,
                use_audio_in_video=rope["use_audio_in_video"] or False,
                audio_seqlens=rope["audio_feature_lengths"],
                second_per_grids=rope["video_second_per_grid"],
            )
        else:
            vision_positions = text_positions.unsqueeze(0).expand(3, -1, -1)
        return torch.cat([text_positions[None, ...], vision_positions], dim=0)

    def _decode_rows(self, states: Sequence[TalkerState]) -> torch.Tensor:
        """One talker decode step for each of `states` (at most `slots`): the last frame's
        summed codec embeddings plus the next trailing text embedding, through the talker in
        one slotted forward. Returns the logits (n, V) and keeps each last hidden state.

        The requests' tensors go in and out as whole batches (one cat, one split), not row
        by row: at these sizes a step costs what its operations count."""
        n, slots = len(states), self.slots
        # The trailing text: generated token j + 1 through text_projection (the rows that
        # have one first, all slots in one call, fixed rows: a row's result does not depend
        # on its position), then tts_eos right after the text's end, tts_pad after that.
        texts: list[torch.Tensor] = []
        trailing: list[torch.Tensor | None] = []
        for state in states:
            j = state.steps - 1
            if j + 1 < len(state.text):
                texts.append(_take(state.text, j + 1))
                trailing.append(None)
            else:
                trailing.append(self.tts_eos if j + 1 == len(state.text) else self.tts_pad)
        text = torch.zeros((slots, 1, self.text_width), device=self.device, dtype=self.dtype)
        if texts:
            text[: len(texts), 0] = torch.stack(texts).to(self.device, self.dtype)
        projected = iter(self.talker.text_projection(text).split(1))
        trail = torch.cat([next(projected) if t is None else t for t in trailing])
        rows = torch.cat([state.frame_embed for state in states]) + trail
        positions = torch.cat([state.positions for state in states], dim=1) + 1  # (4, n, 1)
        for state, position in zip(states, positions.split(1, dim=1), strict=True):
            state.positions = position
        hidden = decode_rows(
            self.talker.model,
            pad_slots(rows, slots),
            pad_slots(positions, slots, dim=1),
            [state.cache for state in states],
        )
        for state, last in zip(states, hidden[:n].split(1), strict=True):
            state.past_hidden = last
        return self.talker.codec_head(hidden)[:n, -1, :]

    def _choose(
        self,
        state: TalkerState,
        logits: torch.Tensor,
        processors: LogitsProcessorList | None,
        previous: torch.Tensor | None = None,
    ) -> int:
        scores = logits.to(copy=True, dtype=torch.float32, device=self.device)
        if processors:
            if previous is None:
                previous = torch.tensor([state.tokens], dtype=torch.long, device=self.device)
            scores = processors(previous, scores)
        if state.do_sample:
            probs = torch.softmax(scores, dim=-1)
            return int(torch.multinomial(probs, 1, generator=state.generator)[0, 0])
        return int(torch.argmax(scores, dim=-1)[0])

    def _predict_rows(self, states: Sequence[TalkerState], tokens: Sequence[int]) -> list:
        """The code predictor's groups 1.. for each request's group-0 code (as the talker's
        `prepare_inputs_for_generation` runs it: the talker's last hidden state and the
        code's embedding, then one code per step), all requests in one slotted forward per
        step (they all have the same length: no padding inside a row), and each frame's
        summed codec embeddings for the next talker step. Returns the frames
        `(num_code_groups,)` long, on the CPU."""
        n, slots = len(states), self.slots
        embeddings = self.talker.code_predictor.get_input_embeddings()
        chosen = torch.tensor(list(tokens), dtype=torch.long)
        ids = pad_slots(chosen.to(self.device).unsqueeze(1), slots)
        last_id_hidden = self.talker.get_input_embeddings()(ids)  # (slots, 1, H)
        past = pad_slots(torch.cat([state.past_hidden for state in states]), slots)
        inputs_embeds = torch.cat((past, last_id_hidden), dim=1)
        logits = self.predictor_rows(inputs_embeds, 0, 0)
        codes = torch.zeros((slots, self.num_code_groups - 1), dtype=torch.long)
        residual_hiddens = []
        for group in range(1, self.num_code_groups):
            codes[:, group - 1] = self._choose_rows(states, logits, codes[:, : group - 1])
            code_ids = codes[:, group - 1 : group].to(self.device)
            if group == self.num_code_groups - 1:
                residual_hiddens.append(embeddings[-1](code_ids))
                break
            # The next predictor step's input is this code's embedding (generation step
            # `group`, at position group + 1 after the prefill's two), which generate() also
            # takes as the frame's residual embedding.
            embed = embeddings[group - 1](code_ids)
            residual_hiddens.append(embed)
            logits = self.predictor_rows(embed, group + 1, group)
        frame_embeds = torch.cat([last_id_hidden, *residual_hiddens], dim=1).sum(1, keepdim=True)
        for state, embed in zip(states, frame_embeds[:n].split(1), strict=True):
            state.frame_embed = embed
        return list(torch.cat((chosen.unsqueeze(1), codes[:n]), dim=1).unbind(0))

    def _choose_codes(
        self, states: Sequence[TalkerState], logits: Sequence[torch.Tensor]
    ) -> list[int]:
        """Each request's next group-0 code from its logits (1, V). The greedy ones in one
        pass over their rows: the reference's repetition penalty (divide a seen code's
        positive logit by the penalty, multiply a negative one: the same float operations
        as `RepetitionPenaltyLogitsProcessor`, elementwise) and the suppressed top ids at
        -inf (`SuppressTokensLogitsProcessor`), then argmax; sampled ones with their
        request's processors and generator."""
        out = [0] * len(states)
        greedy = [i for i, state in enumerate(states) if not state.do_sample]
        for i, state in enumerate(states):
            if state.do_sample:
                out[i] = self._choose(state, logits[i], state.processors)
        if not greedy:
            return out
        scores = torch.cat([logits[i] for i in greedy]).to(dtype=torch.float32).cpu()
        penalty = torch.tensor(
            [[states[i].repetition_penalty] for i in greedy], dtype=torch.float32
        )
        seen = torch.stack([states[i].seen for i in greedy])
        penalized = torch.where(scores < 0, scores * penalty, scores / penalty)
        scores = torch.where(seen, penalized, scores).masked_fill(self.suppress_mask, -math.inf)
        for i, token in zip(greedy, torch.argmax(scores, dim=-1).tolist(), strict=True):
            out[i] = int(token)
        return out

    def _choose_rows(
        self, states: Sequence[TalkerState], logits: torch.Tensor, previous: torch.Tensor
    ) -> torch.Tensor:
        """The code predictor's next code for each row (slots,): greedy rows by one argmax,
        sampled ones with their request's warpers and generator (padding rows: 0)."""
        scores = logits.to(dtype=torch.float32)
        codes = torch.argmax(scores, dim=-1).cpu()
        codes[len(states) :] = 0
        for i, state in enumerate(states):
            if state.do_sample:
                prev = previous[i : i + 1].to(self.device)
                codes[i] = self._choose(state, logits[i : i + 1], state.predictor_processors, prev)
        return codes


def _take(items: list[Any], i: int) -> Any:
    item, items[i] = items[i], None
    if item is None:
        raise AssertionError(f"text embedding {i} was used twice")
    return item


def _warpers(temperature: float, top_k: int, top_p: float) -> list[Any]:
    out: list[Any] = []
    if temperature != 1.0:
        out.append(TemperatureLogitsWarper(temperature))
    if top_k:
        out.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        out.append(TopPLogitsWarper(top_p))
    return out
