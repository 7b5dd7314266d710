"""The Qwen3-Omni pipeline's preprocessing stage: its input checks, and that it gives the
processor's own tensors for the same chat."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("PIL")

from omnirail.models.qwen3_omni import preprocessing
from omnirail.models.qwen3_omni.processor import load_processor
from omnirail.testing.tiny import qwen3_omni as tiny_model
from omnirail.wire.errors import Code, OmniError


@pytest.fixture(scope="module")
def preprocess(tiny_dir):
    return preprocessing.create_preprocessing(str(tiny_dir), max_new_tokens=16, max_tokens_cap=64)


@pytest.mark.parametrize("kind", ["text", "image", "audio", "image+audio"])
def test_shorthand_gives_the_processors_tensors(tiny_dir, preprocess, kind: str) -> None:
    request: dict = {"text": "Describe this."}
    if "image" in kind:
        request["image"] = tiny_model.sample_image()
    if "audio" in kind:
        request["audio"] = tiny_model.sample_audio()
        request["sample_rate"] = 16_000
    out = preprocess(request)
    expected = tiny_model.processor_inputs(
        load_processor(tiny_dir), tiny_model.sample_conversation(kind)
    )
    for key, value in expected.items():
        assert torch.equal(out[key], value), key
    assert out["options"] == {"max_new_tokens": 16, "speak": True}
    assert preprocessing.route("r", out) == ["thinker", *preprocessing.needed_encoders(out)]
    assert out["has_image"] == ("image" in kind) and out["has_audio"] == ("audio" in kind)


def test_messages_form_equals_the_shorthand(preprocess) -> None:
    image = tiny_model.sample_image()
    short = preprocess({"text": "Hi", "image": image, "max_new_tokens": 3, "speak": False})
    chat = preprocess(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image", "image": image}, {"type": "text", "text": "Hi"}],
                }
            ],
            "max_new_tokens": 3,
            "speak": False,
        }
    )
    assert torch.equal(short["input_ids"], chat["input_ids"])
    assert torch.equal(short["pixel_values"], chat["pixel_values"])
    assert chat["options"] == {"max_new_tokens": 3, "speak": False}


def test_thinker_gets_the_audio_lengths_and_no_media(preprocess) -> None:
    out = preprocess({"text": "Hi", "audio": tiny_model.sample_audio()})
    thinker = preprocessing.to_thinker(out)
    assert "input_features" not in thinker and "pixel_values" not in thinker
    assert torch.equal(thinker["audio_feature_lengths"], out["feature_attention_mask"].sum(-1))
    assert set(preprocessing.to_audio_encoder(out)) == {"input_features", "feature_attention_mask"}


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        ("hello", "inputs: expected an object, got str"),
        ({"text": "x", "video": 1}, "inputs: unknown fields ['video']"),
        ({"text": " "}, "inputs.text: required, a non-empty string"),
        (
            {"messages": [{"role": "user", "content": [{"type": "video", "video": 1}]}]},
            "inputs.messages[0].content[0].type: unknown content type 'video' "
            "(expected one of ['text', 'image', 'audio'])",
        ),
        (
            {"text": "x", "image": np.zeros((8, 8), np.uint8)},
            "inputs.image: expected an HxWx3 RGB image, got shape [8, 8]",
        ),
        (
            {"text": "x", "audio": np.zeros(800, np.float32), "sample_rate": 8000},
            "inputs.sample_rate: audio must be at 16000 Hz, got 8000 (resample it first)",
        ),
        (
            {"text": "x", "audio": np.zeros((2, 800), np.float32)},
            "inputs.audio: expected mono samples (1-D), got shape [2, 800]",
        ),
        ({"text": "x", "max_new_tokens": 0}, "inputs.max_new_tokens: an integer within 1..64"),
        ({"text": "x", "max_new_tokens": 65}, "inputs.max_new_tokens: an integer within 1..64"),
        ({"text": "x", "speak": "yes"}, "inputs.speak: true or false"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "inputs.messages[0].role: one of"),
        (
            {"messages": [{"role": "system", "content": "be brief"}]},
            "inputs.messages: needs at least one user turn",
        ),
        (
            {
                "messages": [
                    {"role": "assistant", "content": [{"type": "image", "image": None}]},
                ]
            },
            "inputs.messages[0].content[0].image: expected an array",
        ),
        ({"messages": [], "text": "x"}, "inputs: give either messages or ['text'], not both"),
    ],
)
def test_bad_input_names_the_field(preprocess, request_, message: str) -> None:
    with pytest.raises(OmniError) as info:
        preprocess(request_)
    assert info.value.code == Code.INVALID_ARGUMENT
    assert info.value.message.startswith(message), info.value.message


def test_an_audio_has_the_same_features_whatever_follows_it(tiny_dir) -> None:
    """A conversation's history audio keeps its features as turns add audio after it (the
    processor's batch would change its last frames: it pads the waveforms before the
    STFT), so a kept turn can match it."""
    processor = load_processor(tiny_dir)
    # Lengths that are not whole 10 ms frames, as a microphone's turns are.
    first = tiny_model.sample_audio(0, 1.19)[:-37]
    second = tiny_model.sample_audio(1, 1.25)[:-5]

    def user(audio: np.ndarray) -> dict:
        part = {"type": "audio", "audio": audio, "sample_rate": tiny_model.SAMPLE_RATE}
        return {"role": "user", "content": [part, {"type": "text", "text": "hi"}]}

    alone = preprocessing.model_inputs(processor, [user(first)], {})
    both = preprocessing.model_inputs(processor, [user(first), user(second)], {})
    frames = int(alone["feature_attention_mask"][0].sum())
    assert torch.equal(both["feature_attention_mask"].sum(1), torch.tensor([frames, 125]))
    assert frames == 119  # its partial last frame padded with silence, alone as in the batch
    assert torch.equal(
        both["input_features"][0, :, :frames], alone["input_features"][0, :, :frames]
    )
    assert not both["input_features"][0, :, frames:].any()
    batched = processor.feature_extractor(
        [first, second], sampling_rate=16000, padding=True, return_attention_mask=True,
        return_tensors="pt",
    )  # fmt: skip
    assert not torch.equal(
        batched["input_features"][0, :, :frames], alone["input_features"][0, :, :frames]
    )
