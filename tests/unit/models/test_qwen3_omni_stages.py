"""The Qwen3-Omni stage hooks around the model code (omnirail/models/qwen3_omni/stages.py)."""

from __future__ import annotations

import pytest
import torch

from omnirail.models.qwen3_omni.code2wav import Code2WavStreamer, chunk_due
from omnirail.models.qwen3_omni.stages import Code2Wav, create_talker
from omnirail.stage.streaming import StreamState


@pytest.fixture
def code2wav(reference):
    return Code2Wav(Code2WavStreamer(reference.code2wav, chunk_frames=4), 24_000)


def test_code2wav_takes_single_and_grouped_frames(code2wav):
    """The talker sends frames a few at a time, (n, groups); one frame (groups,) works too,
    and the audio is the same either way."""
    frames = torch.randint(0, 32, (9, 4), generator=torch.Generator().manual_seed(1))
    one, grouped = StreamState("a", None), StreamState("b", None)
    code2wav.new_request(one)
    code2wav.new_request(grouped)
    pcm_one = [code2wav.process_window(one, [f], False) for f in frames]
    pcm_grouped = [code2wav.process_window(grouped, [frames[i : i + 4]], False) for i in (0, 4)]
    pcm_grouped.append(code2wav.process_window(grouped, [frames[8]], False))
    audio = [torch.as_tensor(p["pcm"]) for p in pcm_one if p is not None]
    audio_grouped = [torch.as_tensor(p["pcm"]) for p in pcm_grouped if p is not None]
    assert torch.equal(torch.cat(audio), torch.cat(audio_grouped))
    assert one.user["codes"] == grouped.user["codes"] == frames.tolist()


@pytest.mark.parametrize("shape", [(5,), (2, 3), (1, 2, 4)])
def test_code2wav_refuses_frames_of_another_shape(code2wav, shape):
    state = StreamState("a", None)
    code2wav.new_request(state)
    with pytest.raises(ValueError, match=r"code frames must be \(4,\) or \(n, 4\), got"):
        code2wav.process_window(state, [torch.zeros(shape, dtype=torch.long)], False)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"frames_per_chunk": 0}, "frames_per_chunk must be >= 1, got 0"),
        ({"frames_growth": 0}, "frames_growth must be >= 1, got 0"),
        (
            {"frames_per_chunk": 8, "max_frames_per_chunk": 4},
            r"max_frames_per_chunk must be >= frames_per_chunk \(8\), got 4",
        ),
    ],
)
def test_talker_frame_chunk_arguments_are_checked(tiny_dir, args, message):
    with pytest.raises(ValueError, match=message):
        create_talker(str(tiny_dir), **args)


def test_chunk_due_grows_to_its_cap():
    """The talker sends frames in the chunk sizes code2wav decodes (one schedule)."""
    assert [chunk_due(n, 4, 2, 48) for n in range(7)] == [4, 8, 16, 32, 48, 48, 48]
    assert [chunk_due(n, 4, 1, 12) for n in range(3)] == [4, 12, 12]
