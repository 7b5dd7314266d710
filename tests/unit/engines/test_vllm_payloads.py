"""The generic LLM stage's payloads: what is refused, naming the request's field."""

from __future__ import annotations

import numpy as np
import pytest

from omnirail.stage import InputError

pytest.importorskip("vllm")

from omnirail.engines.vllm.llm_stage import _Tokenizer, make_request


class _NoChat(_Tokenizer):
    def __init__(self) -> None:
        super().__init__("/nowhere")

    def chat(self, messages):
        return [1, 2, 3]


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ("hello", "inputs: a mapping"),
        ({}, "inputs: exactly one of text, messages, prompt_token_ids (got none)"),
        ({"text": "a", "prompt_token_ids": [1]}, "(got text, prompt_token_ids)"),
        ({"text": ""}, "inputs.text: a non-empty string"),
        ({"text": 3}, "inputs.text: a non-empty string"),
        ({"messages": "hi"}, "inputs.messages: a non-empty list"),
        ({"prompt_token_ids": [[1, 2]]}, "inputs.prompt_token_ids: a non-empty list of integers"),
        ({"prompt_token_ids": [1.5]}, "inputs.prompt_token_ids: a non-empty list of integers"),
        ({"prompt_token_ids": [-1]}, "inputs.prompt_token_ids: token ids are >= 0"),
        ({"text": "a", "options": 3}, "options: a mapping"),
        ({"text": "a", "options": {"max_new_tokens": 0}}, "options.max_new_tokens"),
        ({"text": "a", "options": {"temperature": -1}}, "options.temperature"),
        ({"text": "a", "options": {"top_p": 0}}, "options.top_p"),
        ({"text": "a", "options": {"beams": 2}}, "options.beams"),
    ],
)
def test_bad_payloads_name_the_field(payload, message):
    with pytest.raises(InputError) as err:
        make_request(payload, _NoChat())
    assert message in str(err.value)


def test_good_payloads():
    r = make_request({"text": np.array([b"hi"], dtype=object)}, _NoChat())
    assert r.prompt == {"prompt": "hi"} and r.params.max_tokens == 256
    assert r.params.temperature == 0.0  # greedy unless asked
    r = make_request({"messages": [{"role": "user", "content": "x"}]}, _NoChat())
    assert r.prompt == {"prompt_token_ids": [1, 2, 3]}
    r = make_request(
        {"prompt_token_ids": np.array([5, 6]), "options": {"max_new_tokens": 3, "stop": ["."]}},
        _NoChat(),
    )
    assert r.prompt == {"prompt_token_ids": [5, 6]}
    assert r.params.max_tokens == 3 and r.params.stop == ["."]
