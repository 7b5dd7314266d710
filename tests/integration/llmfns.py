"""Stage functions around the generic LLM stage in tests/integration/test_vllm_llm.py: our own
stages before and after a vLLM one."""

from __future__ import annotations

from typing import Any

import numpy as np

from omnirail.stage import InputError


def ask(payload: dict[str, Any]) -> dict[str, Any]:
    """The LLM's input from a client's `question` (and its sampling `options`)."""
    question = payload.get("question")
    if isinstance(question, np.ndarray):
        question = question.reshape(-1)[0]
    if isinstance(question, bytes):
        question = question.decode()
    if not isinstance(question, str):
        raise InputError("inputs.question: a string")
    out: dict[str, Any] = {"text": question}
    if "max_new_tokens" in payload:
        out["options"] = {
            "max_new_tokens": int(np.asarray(payload["max_new_tokens"]).reshape(-1)[0])
        }
    return out


def create_ask() -> Any:
    return ask
