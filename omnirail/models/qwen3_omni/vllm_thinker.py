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

Not yet: prompts with images or audio (they fail with an `InputError` naming the field; the
hand-written thinker serves them), and `tp_size` > 1.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from typing import Any

import torch

from omnirail.engines.vllm import (
    Chunk,
    EngineOptionError,
    EngineOptions,
    EngineRequest,
    VLLMScheduler,
)
from omnirail.stage import InputError, TensorParallel

from .talker_prompt import read_embed_table
from .weights import read_config

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

    stage = tp.stage if tp is not None else "thinker"
    options = EngineOptions.parse(stage, engine_options)
    if tp is not None and tp.size > 1:
        raise EngineOptionError(
            f"stages[{stage}].tp_size: {tp.size}; the vLLM thinker runs as one process for now"
        )
    config = read_config(model_path)
    table = read_embed_table(model_path)
    eos = int(config.im_end_token_id)
    media = tuple(
        int(getattr(config.thinker_config, f))
        for f in ("audio_token_id", "image_token_id", "video_token_id")
    )
    view = tempfile.mkdtemp(prefix=f"omnirail-{stage}-vllm-")
    atexit.register(shutil.rmtree, view, True)
    vllm_model.write_model_view(model_path, view)

    def prepare(data: Any) -> EngineRequest:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        for field in ("audio", "image", "video"):
            if field in data:
                raise InputError(
                    f"inputs.{field}: the vLLM thinker takes prompts without media for now "
                    "(the thinker's `engine: native` serves them)",
                    stage,
                )
        ids = torch.as_tensor(data["input_ids"], dtype=torch.long).reshape(1, -1)
        if torch.isin(ids, torch.tensor(media)).any():
            raise InputError("inputs: the prompt holds media placeholders but no media", stage)
        opts = data["options"]
        ctx = {"ids": ids, "speak": bool(opts["speak"]), "last": None}
        params = SamplingParams(
            max_tokens=int(opts["max_new_tokens"]),
            temperature=0.0,
            # generate()'s stop rule: the end-of-turn token (kept in the output), or the length.
            ignore_eos=True,
            stop_token_ids=[eos],
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        return EngineRequest({"prompt_token_ids": ids[0].tolist()}, params, ctx)

    def talker_prompt(ids: torch.Tensor) -> dict[str, Any]:
        return {
            "input_ids": ids,
            "embeds": table[ids[0]].unsqueeze(0).contiguous(),
            "multimodal_mask": torch.zeros_like(ids, dtype=torch.bool),
        }

    def make_chunks(request: EngineRequest, new_ids: list[int], _text: str) -> list[Chunk]:
        ctx = request.context
        out: list[Chunk] = []
        for token in new_ids:
            if ctx["speak"]:
                if ctx["last"] is None:
                    out.append(Chunk(talker_prompt(ctx["ids"]), "talker"))
                else:  # the previous token, fed back for this one
                    out.append(
                        Chunk({"embed": table[ctx["last"]].view(1, 1, -1).clone()}, "talker")
                    )
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
        # Prompts arrive as token ids and nothing is detokenized here (decode does it).
        engine_args={"skip_tokenizer_init": True, "tokenizer": None},
    )
