"""The Qwen3-Omni pipeline's stage factories (named by pipeline.yaml), around the model code:

- `audio_encoder` / `image_encoder`: the thinker's audio tower / vision encoder, one request
  at a time (`encoders.py`).
- `thinker`: fan-in of preprocessing and the encoders (`omnirail.models.fanin`),
  then `ThinkerRunner` (`thinker.py`) under `ARScheduler`: prefill as a request joins, one
  greedy token per step. It streams each token id to `decode` and, for requests that speak,
  what the talker needs to `talker`: first the prompt's parts (`TalkerPrompt`), then the
  input embedding of every token it feeds back, one step behind.
- `decode`: token ids to text, streamed to the client as it decodes.

Each factory takes `model_path` (a local Hugging Face directory) and `device`, and loads
only its own submodule's tensors (`weights.load_submodule`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from omnirail.stage import (
    ARRequest,
    ARScheduler,
    ARStep,
    ConversationFigures,
    ConversationStore,
    StreamingScheduler,
    StreamState,
)
from omnirail.stage import InputError as RequestInputError

from .code2wav import Code2WavStreamer, chunk_due
from .encoders import AudioEncoder, AudioEncoding, ImageEncoder, ImageEncoding, InputError
from .sizes import STAGE_SUBMODULES
from .talker import TalkerRunner
from .thinker import KeptPrompt, TalkerPrompt, ThinkerRunner

log = logging.getLogger(__name__)
TEXT = {"modality": "text"}
AUDIO = {"modality": "audio"}
# code2wav's output rate: Qwen3-Omni's 12.5 Hz code frames, 1920 samples each.
AUDIO_SAMPLE_RATE = 24_000


def _holds(stage: str, *modules: torch.nn.Module) -> None:
    """Logs how many parameters this stage process holds (tests compare it with the
    reference model's submodule: a stage loads its part, not the whole model)."""
    count = sum(p.numel() for m in modules for p in m.parameters())
    log.info("holds %d parameters: %s", count, STAGE_SUBMODULES[stage])


# ---- encoders ---------------------------------------------------------------------------


def create_audio_encoder(model_path: str, device: str = "cpu") -> Any:
    encoder = AudioEncoder.from_pretrained(model_path, torch.device(device))
    _holds("audio_encoder", encoder.module)

    def encode(payload: dict[str, Any]) -> dict[str, Any]:
        out = encoder.encode(payload["input_features"], payload["feature_attention_mask"])
        return {
            "audio": {
                "embeds": out.embeds,
                "feature_lengths": out.feature_lengths,
                "token_lengths": out.token_lengths,
                "keys": out.keys,
            }
        }

    return encode


def create_image_encoder(model_path: str, device: str = "cpu") -> Any:
    encoder = ImageEncoder.from_pretrained(model_path, torch.device(device))
    _holds("image_encoder", encoder.module)

    def encode(payload: dict[str, Any]) -> dict[str, Any]:
        out = encoder.encode(payload["pixel_values"], payload["image_grid_thw"])
        return {
            "image": {
                "embeds": out.embeds,
                "deepstack": list(out.deepstack),
                "grid_thw": out.grid_thw,
                "token_lengths": out.token_lengths,
                "keys": out.keys,
            }
        }

    return encode


# ---- thinker ----------------------------------------------------------------------------


def talker_prompt_chunk(prefill: Any, data: dict[str, Any]) -> dict[str, Any]:
    """The first chunk a speaking request's thinker sends the talker: its `TalkerPrompt`
    (multimodal rows of the accept-layer hidden state only: the talker reads no others) and
    what the talker's 3D rope needs."""
    prompt = prefill.talker
    chunk: dict[str, Any] = {
        "input_ids": prompt.input_ids,
        "embeds": prompt.embeds,
        "multimodal_mask": prompt.multimodal_mask,
    }
    hidden = prompt.multimodal_hidden()
    if hidden is not None and hidden.numel():
        chunk["multimodal_hidden"] = hidden
    if "image_grid_thw" in data:
        chunk["image_grid_thw"] = data["image_grid_thw"]
    if "audio_feature_lengths" in data:
        chunk["audio_feature_lengths"] = data["audio_feature_lengths"]
    return chunk


def create_thinker(
    model_path: str,
    device: str = "cpu",
    max_batch_size: int = 8,
    engine: str = "native",
    tp: Any = None,
    conversation_mb: int = 1024,
    conversation_idle_s: float = 600.0,
    **engine_options: Any,
) -> Any:
    """The thinker: `engine: native` (the hand-written step machine below, exact) or
    `engine: vllm` (`vllm_thinker.py`; `engine_options` are its `EngineOptions`).

    The native thinker keeps each conversation's KV cache between its turns
    (`ConversationStore`: `conversation_mb` in all, dropped after `conversation_idle_s`
    without a turn), so a turn prefills only what its prompt adds to the last one
    (`ThinkerRunner.prefill(kept=...)`); its result says how much (`prefill_tokens`,
    `reused_tokens`)."""
    if engine == "vllm":
        from .vllm_thinker import create_vllm_thinker

        return create_vllm_thinker(model_path, device, tp, **engine_options)
    stage = tp.stage if tp is not None else "thinker"
    if engine != "native":
        raise ValueError(f"stages[{stage}].factory_args.engine: native or vllm, got {engine!r}")
    if engine_options:
        raise ValueError(
            f"stages[{stage}].factory_args.{sorted(engine_options)[0]}: an engine option; "
            "the native thinker takes none (set engine: vllm)"
        )
    if (
        isinstance(conversation_mb, bool)
        or not isinstance(conversation_mb, int)
        or (conversation_mb < 0)
    ):
        raise ValueError(
            f"stages[{stage}].factory_args.conversation_mb: an int >= 0 (0 keeps no "
            f"conversation state), got {conversation_mb!r}"
        )
    if (
        isinstance(conversation_idle_s, bool)
        or not isinstance(conversation_idle_s, int | float)
        or not 0 < conversation_idle_s < float("inf")
    ):
        raise ValueError(
            f"stages[{stage}].factory_args.conversation_idle_s: seconds above 0, got "
            f"{conversation_idle_s!r}"
        )
    runner = ThinkerRunner.from_pretrained(model_path, torch.device(device), slots=max_batch_size)
    _holds("thinker", runner.model, runner.lm_head)
    kept: ConversationStore[KeptPrompt] = ConversationStore(
        conversation_mb << 20, float(conversation_idle_s)
    )
    render = AnswerRenderer(model_path, runner.default_eos) if conversation_mb else None

    def init(req: ARRequest) -> None:
        data = req.data
        audio = AudioEncoding(**data["audio"]) if "audio" in data else None
        image = ImageEncoding(**data["image"]) if "image" in data else None
        before = kept.take(req.conversation) if req.conversation else None
        try:
            prefill = runner.prefill(
                data["input_ids"],
                max_new_tokens=data["options"]["max_new_tokens"],
                attention_mask=data.get("attention_mask"),
                audio=audio,
                image=image,
                kept=before,
                keepable=bool(req.conversation) and render is not None,
            )
        except InputError as exc:  # e.g. a prompt longer than the model's positions
            raise RequestInputError(str(exc)) from None
        length = prefill.state.prompt_length
        if req.conversation:
            kept.record_turn(prefill.reused > 0, length - prefill.reused, prefill.reused)
        speak = bool(data["options"]["speak"])
        req.state.update(
            thinker=prefill.state,
            speak=speak,
            prefill=length - prefill.reused,
            reused=prefill.reused,
        )
        if speak:
            req.emit(talker_prompt_chunk(prefill, data), target="talker")
        req.emit(prefill.first.token, target="decode", metadata={"modality": "token"})

    def step(batch: list[ARRequest]) -> list[ARStep]:
        live = [r for r in batch if not r.state["thinker"].finished]
        outputs = runner.step_many([r.state["thinker"] for r in live])
        for req, out in zip(live, outputs, strict=True):
            if req.state["speak"]:
                req.emit({"embed": out.fed_embed}, target="talker")
            req.emit(out.token, target="decode", metadata={"modality": "token"})
        steps = []
        for req in batch:
            state = req.state["thinker"]
            if not state.finished:
                steps.append(ARStep())
                continue
            tokens = list(state.tokens)
            if req.conversation and render is not None:
                turn = runner.keep(state, render(tokens))
                if turn is not None:
                    kept.put(req.conversation, turn, turn.nbytes)
            runner.release(state)
            result = {
                "token_ids": tokens,
                "speak": req.state["speak"],
                "prefill_tokens": req.state["prefill"],
                "reused_tokens": req.state["reused"],
            }
            steps.append(ARStep(finished=True, result=result))
        return steps

    return _ConversationalAR(
        kept, step, init_fn=init, max_batch_size=max_batch_size, name="thinker"
    )


class AnswerRenderer:
    """An answer's tokens as the next turn's prompt will hold them: the text the client got
    (`decode`'s: special tokens skipped) as the chat template renders an assistant turn,
    `text<|im_end|>\n`, tokenized (special tokens split the text, so the parts tokenize
    alone as they do in the whole prompt; the thinker checks the next prompt anyway)."""

    def __init__(self, model_path: str, end_of_turn: int | None) -> None:
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        self._end = [] if end_of_turn is None else [end_of_turn]
        self._newline = self._tokenizer.encode("\n", add_special_tokens=False)

    def __call__(self, tokens: list[int]) -> list[int]:
        text = self._tokenizer.decode(tokens, skip_special_tokens=True)
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        return [*ids, *self._end, *self._newline]


class _ConversationalAR(ARScheduler):
    """An `ARScheduler` whose step keeps conversations' state in `store`: reports it and
    drops a closed conversation's."""

    def __init__(self, store: ConversationStore[Any], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._store = store

    def conversations(self) -> ConversationFigures:
        return self._store.figures()

    def close_conversation(self, conversation_id: str) -> None:
        self._store.close(conversation_id)


def thinker_done_to(request_id: str, output: Any) -> list[str]:
    """`stream_done_to_fn`: decode always; the talker only if the request speaks (the
    thinker streamed nothing to it otherwise)."""
    return ["decode", "talker"] if output.get("speak", True) else ["decode"]


# ---- decode -----------------------------------------------------------------------------


class Detokenizer(StreamingScheduler):
    """Token ids in, text out to the client as it decodes; the result is the whole text and
    the token ids (special tokens included, as the thinker made them)."""

    def __init__(self, model_path: str) -> None:
        super().__init__(window=1, metadata=TEXT, name="decode")
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)

    def new_request(self, state: StreamState) -> None:
        state.user["tokens"] = []
        state.user["text"] = ""

    def process_window(self, state: StreamState, chunks: list[Any], final: bool) -> Any:
        if not chunks:
            return None
        tokens = state.user["tokens"]
        tokens.append(int(chunks[-1]))
        # Decoding the whole sequence keeps multi-token characters and spacing right.
        text = self._tokenizer.decode(tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # half a character: wait for the rest
            return None
        piece, state.user["text"] = text[len(state.user["text"]) :], text
        return piece or None

    def finish(self, state: StreamState) -> Any:
        tokens = state.user["tokens"]
        text = self._tokenizer.decode(tokens, skip_special_tokens=True)
        # What was held back (a character still missing bytes) goes out as the last chunk.
        tail = text[len(state.user["text"]) :]
        if tail:
            self.emit(state, tail, metadata=TEXT)
        return {"text": text, "token_ids": tokens}


def create_decode(model_path: str) -> Detokenizer:
    return Detokenizer(model_path)


# ---- talker -----------------------------------------------------------------------------


def _talker_prompt(chunk: dict[str, Any]) -> TalkerPrompt:
    """The thinker's `TalkerPrompt` back from its first chunk (`talker_prompt_chunk`); only
    the media rows of the accept-layer hidden state crossed, which the talker takes as is."""
    return TalkerPrompt(
        input_ids=chunk["input_ids"],
        embeds=chunk["embeds"],
        accept_hidden=chunk.get("multimodal_hidden"),
        multimodal_mask=chunk["multimodal_mask"],
    )


def create_talker(
    model_path: str,
    device: str = "cpu",
    max_new_tokens: int = 4096,
    max_batch_size: int = 8,
    frames_per_chunk: int = 4,
    frames_growth: int = 2,
    max_frames_per_chunk: int = 48,
) -> ARScheduler:
    """The talker and its code predictor under `ARScheduler`, fed by the thinker's stream:
    its first chunk starts the request (`TalkerRunner.start`), each later one is a token's
    embedding, and the stream's end is the end of the text. One codec frame per step; a
    request whose next step needs a token the thinker has not sent yet is parked until it
    arrives. The requests that can step run together (`TalkerRunner.step_many`).

    Frames go to code2wav in chunks (n, groups) of the sizes code2wav decodes them in:
    `frames_per_chunk` first, then growing by `frames_growth` up to `max_frames_per_chunk`
    (4, 8, 16, 32, 48, 48, ...: code2wav's `first_chunk_frames`, `growth` and
    `chunk_frames`); a request's last chunk may be shorter. code2wav decodes nothing before
    a chunk of its own is complete, so smaller items would only mean more stream items and
    no earlier audio (measured: sending frames one by one, the talker stage spent ~0.3 of
    its 0.84 CPU-seconds per wave of 8 requests on its IO; four at a time, code2wav still
    handled 32 items per request where 6 do)."""
    if frames_per_chunk < 1:
        raise ValueError(f"frames_per_chunk must be >= 1, got {frames_per_chunk}")
    if frames_growth < 1:
        raise ValueError(f"frames_growth must be >= 1, got {frames_growth}")
    if max_frames_per_chunk < frames_per_chunk:
        raise ValueError(
            f"max_frames_per_chunk must be >= frames_per_chunk ({frames_per_chunk}), "
            f"got {max_frames_per_chunk}"
        )
    runner = TalkerRunner.from_pretrained(model_path, torch.device(device), slots=max_batch_size)
    _holds("talker", runner.talker)

    def take(req: ARRequest) -> Any:
        state = req.state.get("talker")
        for chunk in req.take_inputs():
            if state is None:
                state = req.state["talker"] = runner.start(
                    _talker_prompt(chunk),
                    image_grid_thw=chunk.get("image_grid_thw"),
                    audio_feature_lengths=chunk.get("audio_feature_lengths"),
                    max_new_tokens=max_new_tokens,
                )
            else:
                runner.push_text(state, chunk["embed"])
        if state is not None and req.inputs_done and not state.text_done:
            runner.end_text(state)
        return state

    def step(batch: list[ARRequest]) -> list[ARStep]:
        steps: list[ARStep | None] = [None] * len(batch)
        ready: list[tuple[int, Any]] = []
        for i, req in enumerate(batch):
            state = take(req)
            if state is None:
                if req.inputs_done:  # the thinker sent nothing: nothing to speak
                    steps[i] = ARStep(finished=True, result={"frames": 0})
                else:
                    steps[i] = ARStep(needs_input=True)
            elif not runner.ready(state):
                steps[i] = ARStep(needs_input=True)
            else:
                ready.append((i, state))
        # The ready requests step together (one slotted forward: see rows.py).
        outs = runner.step_many([state for _, state in ready])
        for (i, state), out in zip(ready, outs, strict=True):
            scratch = batch[i].state
            pending = scratch.setdefault("frames", [])
            if out.frame is not None:
                pending.append(out.frame)
            chunk = None
            sent = scratch.get("chunks_sent", 0)
            due = chunk_due(sent, frames_per_chunk, frames_growth, max_frames_per_chunk)
            if pending and (out.finished or len(pending) >= due):
                chunk, scratch["frames"] = torch.stack(pending), []
                scratch["chunks_sent"] = sent + 1
            if out.finished:
                result = {"frames": state.frames}
                steps[i] = ARStep(chunk=chunk, target="code2wav", finished=True, result=result)
            else:
                steps[i] = ARStep(chunk=chunk, target="code2wav")
        return [s for s in steps if s is not None]

    return ARScheduler(step, max_batch_size=max_batch_size, hold_inputs=True, name="talker")


# ---- code2wav ---------------------------------------------------------------------------


class Code2Wav(StreamingScheduler):
    """Codec frames in, audio out to the client in chunks as they decode (left context
    kept, see `Code2WavStreamer`): `{"pcm": float32 samples, "sample_rate": 24000}`. The
    result is every code frame it decoded and the number of samples."""

    def __init__(self, streamer: Code2WavStreamer, sample_rate: int) -> None:
        super().__init__(window=1, metadata=AUDIO, name="code2wav")
        self._streamer = streamer
        self._rate = sample_rate

    def new_request(self, state: StreamState) -> None:
        state.user["c2w"] = self._streamer.start()
        state.user["codes"] = []
        state.user["samples"] = 0

    def process_window(self, state: StreamState, chunks: list[Any], final: bool) -> Any:
        # Each chunk is one frame (groups,) or several (n, groups).
        groups = self._streamer.num_quantizers
        parts = [torch.as_tensor(c) for c in chunks]
        if not parts:
            return None
        for part in parts:
            if part.ndim not in (1, 2) or part.shape[-1] != groups:
                raise ValueError(
                    f"code frames must be ({groups},) or (n, {groups}), got {tuple(part.shape)}"
                )
        frames = torch.cat([p.reshape(-1, groups) for p in parts])
        state.user["codes"].extend(frames.tolist())
        return self._audio(state, self._streamer.push(state.user["c2w"], frames))

    def finish(self, state: StreamState) -> Any:
        # The stream ended: the frames not yet decoded go out as the last audio chunk.
        tail = self._audio(state, self._streamer.flush(state.user["c2w"]))
        if tail is not None:
            self.emit(state, tail, metadata=AUDIO)
        return {
            "codes": state.user["codes"],
            "samples": state.user["samples"],
            "sample_rate": self._rate,
        }

    def _audio(self, state: StreamState, pcm: torch.Tensor) -> dict[str, Any] | None:
        if not pcm.numel():
            return None
        state.user["samples"] += pcm.numel()
        return {"pcm": pcm.reshape(-1).float().cpu().numpy(), "sample_rate": self._rate}


def create_code2wav(
    model_path: str,
    device: str = "cpu",
    first_chunk_frames: int = 4,
    chunk_frames: int = 48,
    growth: int = 2,
) -> Code2Wav:
    """Audio chunks of 4, 8, 16, 32, then 48 frames (0.32 s of audio first, 3.84 s at most;
    see `Code2WavStreamer` for why they grow)."""
    streamer = Code2WavStreamer.from_pretrained(
        model_path,
        torch.device(device),
        first_chunk_frames=first_chunk_frames,
        chunk_frames=chunk_frames,
        growth=growth,
    )
    _holds("code2wav", streamer.code2wav)
    return Code2Wav(streamer, AUDIO_SAMPLE_RATE)


def terminal_stages(request_id: str, inputs: dict[str, Any]) -> list[str] | None:
    """Text only when the request says `"speak": false`; text and audio otherwise (a
    malformed `speak` is left to preprocessing, which fails the request naming it)."""
    speak = inputs.get("speak", True) if isinstance(inputs, dict) else True
    return ["decode"] if speak is False else ["decode", "code2wav"]
