"""Qwen3-Omni's thinker on vLLM: the `thinker` stage with `engine: vllm`.

The same stage contract as the hand-written thinker (`stages.create_thinker`), so decode and
the talker cannot tell them apart: it takes preprocessing's merged payload, streams each token
id to `decode`, and, for requests that speak, streams the talker its `TalkerPrompt` as the
first token comes out of prefill, then the input embedding of every token it feeds back, one
token behind (the last token is never fed). Its result is `{"token_ids", "speak"}`.

vLLM runs the thinker's text model (`vllm_model.py`): continuous batching, paged KV, prefix
caching, chunked prefill, fused MoE. What the talker reads is not the model's output: the
prompt's input embeddings and every fed token's embedding are rows of the input embedding
table, which this stage reads from the checkpoint itself (`thinker.model.embed_tokens`),
bitwise what the model's lookup gives. A prompt without media needs nothing else from the
model: the talker reads the accept-layer hidden state only at media positions.

A prompt with images or audio (the encoder stages' outputs) is built as the hand-written
thinker builds it (`ThinkerRunner.prompt_inputs`, from the embedding table alone) and handed
to the model through `vllm_model.MediaPrompts`; its rows then take the model's hidden state at
the talker's accept layer, which go to the talker with its prompt. Such a prompt gets a cache
salt of its own: vLLM's prefix cache knows its token ids, not its media.

Not yet: `tp_size` > 1.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import uuid
from typing import Any

import torch

from omnirail.engines.vllm import (
    Chunk,
    EngineOptionError,
    EngineRequest,
    VLLMScheduler,
)
from omnirail.engines.vllm.options import stage_options
from omnirail.stage import InputError, TensorParallel

from .encoders import AudioEncoding, ImageEncoding
from .encoders import InputError as ModelInputError
from .thinker import ThinkerRunner

TOKEN = {"modality": "token"}


def create_vllm_thinker(
    model_path: str,
    device: str = "cpu",
    tp: TensorParallel | None = None,
    max_unsent: int = 64,
    **engine_options: Any,
) -> VLLMScheduler:
    """The thinker on a vLLM engine; `engine_options` are `EngineOptions`."""
    from . import vllm_model

    stage, options = stage_options(tp, "thinker", engine_options)
    if options.engine_process:
        raise EngineOptionError(
            f"stages[{stage}].factory_args.engine_process: the vLLM thinker's model reads the "
            "stage's media rows, so its engine core runs in the stage's process"
        )
    prompts = ThinkerRunner.prompts_only(model_path)
    table = prompts.model.embed_tokens.weight
    accept_layer = prompts.accept_hidden_layer
    media = vllm_model.MediaPrompts()
    limits: dict[str, int] = {}

    def attach(engine: Any) -> None:
        vllm_model.attach(engine, media)
        limits["max_model_len"] = int(engine.model_config.max_model_len)

    view = tempfile.mkdtemp(prefix=f"omnirail-{stage}-vllm-")
    atexit.register(shutil.rmtree, view, True)
    vllm_model.write_model_view(model_path, view)

    def prepare(data: Any) -> EngineRequest:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        audio = AudioEncoding(**data["audio"]) if "audio" in data else None
        image = ImageEncoding(**data["image"]) if "image" in data else None
        opts = data["options"]
        try:
            ids, max_new, eos = prompts.check_request(
                torch.as_tensor(data["input_ids"]),
                opts["max_new_tokens"],
                data.get("attention_mask"),
                audio,
                image,
            )
        except ModelInputError as exc:
            raise InputError(str(exc), stage) from None
        if ids.shape[1] + max_new > limits["max_model_len"]:
            # vLLM would cut the answer short without a word; the hand-written thinker would not.
            raise InputError(
                f"max_new_tokens: {max_new} after a prompt of {ids.shape[1]} tokens passes the "
                f"engine's max_model_len {limits['max_model_len']}",
                stage,
            )
        ctx: dict[str, Any] = {"ids": ids, "speak": bool(opts["speak"]), "last": None}
        prompt: dict[str, Any] = {"prompt_token_ids": ids[0].tolist()}
        on_added = on_end = None
        if audio is not None or image is not None:
            inputs = prompts.prompt_inputs(ids, audio, image)
            entry = vllm_model.MediaPrompt(
                embeds=inputs.embeds[0],
                positions=inputs.position_ids[1:, 0].long(),
                delta=int(inputs.rope_deltas.reshape(-1)[0]),
                visual=None if inputs.visual_pos_masks is None else inputs.visual_pos_masks[0],
                deepstack=inputs.deepstack,
                media=inputs.multimodal_mask[0],
                accept_layer=accept_layer,
            )
            ctx.update(inputs=inputs, media=entry, grid=data.get("image_grid_thw"))
            ctx["audio_lengths"] = data.get("audio_feature_lengths")
            prompt["cache_salt"] = uuid.uuid4().hex  # its KV blocks are its own
            engine_ids: list[str] = []

            def on_added(engine_id: str) -> None:
                engine_ids.append(engine_id)
                media[engine_id] = entry

            def on_end() -> None:
                for engine_id in engine_ids:
                    media.pop(engine_id, None)

        params = SamplingParams(
            max_tokens=max_new,
            temperature=0.0,
            # generate()'s stop rule: the end-of-turn token (kept in the output), or the length.
            ignore_eos=True,
            stop_token_ids=sorted(eos),
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        return EngineRequest(prompt, params, ctx, on_added=on_added, on_end=on_end)

    def talker_prompt(ctx: dict[str, Any]) -> dict[str, Any]:
        ids = ctx["ids"]
        if "media" not in ctx:
            return {
                "input_ids": ids,
                "embeds": table[ids[0]].unsqueeze(0).contiguous(),
                "multimodal_mask": torch.zeros_like(ids, dtype=torch.bool),
            }
        inputs, entry = ctx["inputs"], ctx["media"]
        chunk: dict[str, Any] = {
            "input_ids": ids,
            "embeds": inputs.embeds.contiguous(),
            "multimodal_mask": inputs.multimodal_mask.contiguous(),
        }
        if entry.accept is not None and entry.accept.numel():
            chunk["multimodal_hidden"] = entry.accept
        if ctx["grid"] is not None:
            chunk["image_grid_thw"] = ctx["grid"]
        if ctx["audio_lengths"] is not None:
            chunk["audio_feature_lengths"] = ctx["audio_lengths"]
        return chunk

    def make_chunks(request: EngineRequest, new_ids: list[int], _text: str) -> list[Chunk]:
        ctx = request.context
        out: list[Chunk] = []
        for token in new_ids:
            if ctx["speak"]:
                if ctx["last"] is None:
                    out.append(Chunk(talker_prompt(ctx), "talker"))
                else:  # the previous token, fed back for this one
                    fed = table[ctx["last"]].view(1, 1, -1).clone()
                    out.append(Chunk({"embed": fed}, "talker"))
            out.append(Chunk(int(token), "decode", TOKEN))
            ctx["last"] = int(token)
        return out

    def make_result(request: EngineRequest, ids: list[int], _text: str, _reason: str) -> Any:
        return {"token_ids": [int(t) for t in ids], "speak": request.context["speak"]}

    return VLLMScheduler(
        stage=stage,
        model_path=view,
        options=options,
        device=device,
        prepare=prepare,
        make_chunks=make_chunks,
        make_result=make_result,
        max_unsent=max_unsent,
        before_build=vllm_model.register,
        after_build=attach,
        # Prompts arrive as token ids and nothing is detokenized here (decode does it).
        engine_args={"skip_tokenizer_init": True, "tokenizer": None},
    )
