"""A generic LLM stage: any model directory vLLM serves, text in, token ids and text out,
streamed as they decode. Put it anywhere in a pipeline:

    - name: llm
      factory: omnirail.engines.vllm:create_llm
      factory_args: {model_path: /models/my-lm, max_model_len: 4096, kv_cache_gib: 4}

A request's payload gives the prompt as one of `text` (used as is), `messages` (a chat, run
through the tokenizer's chat template with the generation prompt) or `prompt_token_ids`,
and optionally `options` (`Sampling`: max_new_tokens, temperature, top_p, top_k, seed, stop,
ignore_eos; greedy by default). Each stream chunk is `{"token_ids": int64 array, "text":
str}` (modality "text"); the result is `{"token_ids", "text", "finish_reason",
"prompt_tokens"}`. Engine options (`EngineOptions`) are the other factory arguments.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from omnirail.engines.vllm.options import EngineOptionError, Sampling, stage_options
from omnirail.engines.vllm.scheduler import Chunk, EngineRequest, VLLMScheduler
from omnirail.stage import InputError, TensorParallel

TEXT = {"modality": "text"}
_PROMPT_FIELDS = ("text", "messages", "prompt_token_ids")


def create_llm(
    model_path: str,
    device: str = "cpu",
    tp: TensorParallel | None = None,
    max_unsent: int = 16,
    **engine_options: Any,
) -> VLLMScheduler:
    """The stage's scheduler: a vLLM engine on `model_path` (a local directory)."""
    stage, options = stage_options(tp, "llm", engine_options)
    check_model_dir(stage, model_path)
    tokenizer = _Tokenizer(options.tokenizer or model_path)

    def prepare(payload: Any) -> EngineRequest:
        return make_request(payload, tokenizer)

    return VLLMScheduler(
        stage=stage,
        model_path=model_path,
        options=options,
        device=device,
        prepare=prepare,
        make_chunks=text_chunks,
        make_result=text_result,
        max_unsent=max_unsent,
    )


def check_model_dir(stage: str, model_path: str) -> None:
    """A model directory vLLM can try to load: a directory holding config.json."""
    path = Path(model_path)
    if not path.is_dir():
        raise EngineOptionError(
            f"stages[{stage}].factory_args.model_path: {model_path!r} is not a directory"
        )
    if not (path / "config.json").is_file():
        raise EngineOptionError(
            f"stages[{stage}].factory_args.model_path: {model_path!r} has no config.json"
        )


class _Tokenizer:
    """The checkpoint's tokenizer, loaded on first use (chat templates)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._tokenizer: Any = None

    def chat(self, messages: Any) -> list[int]:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self._path, local_files_only=True)
        try:
            ids = self._tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        except Exception as exc:
            raise InputError(f"messages: not a chat the model's template takes ({exc})") from None
        if isinstance(ids, Mapping):
            ids = ids["input_ids"]
        return [int(i) for i in ids]


def make_request(payload: Any, tokenizer: _Tokenizer) -> EngineRequest:
    """The engine request of a payload (see the module's docstring)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    if not isinstance(payload, Mapping):
        raise InputError(f"inputs: a mapping with one of {', '.join(_PROMPT_FIELDS)}")
    given = [f for f in _PROMPT_FIELDS if payload.get(f) is not None]
    if len(given) != 1:
        raise InputError(
            f"inputs: exactly one of {', '.join(_PROMPT_FIELDS)} (got {', '.join(given) or 'none'})"
        )
    field = given[0]
    value = payload[field]
    if field == "text":
        if isinstance(value, bytes):
            value = value.decode("utf-8", errors="replace")
        if isinstance(value, np.ndarray) and value.size == 1:
            value = value.reshape(-1)[0]
            value = (
                value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)
            )
        if not isinstance(value, str) or not value:
            raise InputError("inputs.text: a non-empty string")
        prompt: Any = {"prompt": value}
    elif field == "messages":
        if not isinstance(value, Sequence) or isinstance(value, (str, bytes)) or not value:
            raise InputError("inputs.messages: a non-empty list of chat messages")
        prompt = {"prompt_token_ids": tokenizer.chat(list(value))}
    else:
        ids = np.asarray(value)
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise InputError("inputs.prompt_token_ids: a non-empty list of integers")
        if (ids < 0).any():
            raise InputError("inputs.prompt_token_ids: token ids are >= 0")
        prompt = {"prompt_token_ids": [int(i) for i in ids]}
    options = payload.get("options") or {}
    if not isinstance(options, Mapping):
        raise InputError("options: a mapping of sampling options")
    sampling = Sampling.parse(options)
    params = SamplingParams(
        max_tokens=sampling.max_new_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        seed=sampling.seed,
        stop=sampling.stop or None,
        ignore_eos=sampling.ignore_eos,
        output_kind=RequestOutputKind.DELTA,
    )
    return EngineRequest(prompt, params, context=prompt)


def text_chunks(request: EngineRequest, token_ids: list[int], text: str) -> list[Chunk]:
    """One chunk for all the new tokens: their ids and text."""
    return [Chunk({"token_ids": np.asarray(token_ids, dtype=np.int64), "text": text}, None, TEXT)]


def text_result(
    request: EngineRequest, token_ids: list[int], text: str, finish_reason: str
) -> dict[str, Any]:
    prompt = request.context
    prompt_tokens = len(prompt["prompt_token_ids"]) if "prompt_token_ids" in prompt else -1
    return {
        "token_ids": np.asarray(token_ids, dtype=np.int64),
        "text": text,
        "finish_reason": finish_reason,
        "prompt_tokens": prompt_tokens,
    }
