"""code2wav streamed (omnirail/models/qwen3_omni/code2wav.py, conv_stream.py): the audio equals the
reference's `chunked_decode` within float rounding, for any length and chunking."""

from __future__ import annotations

import pytest
import torch

from omnirail.models.qwen3_omni.code2wav import Code2WavStreamer
from omnirail.testing.tiny import qwen3_omni as tiny_model
from tests.unit.models.code2wav_helpers import (
    assert_audio_close,
    random_codes,
    stream_audio,
)


@pytest.mark.parametrize("frames", [1, 2, 37, 300])
@pytest.mark.parametrize("chunk", [(1, 1), (4, 2), (12, 4), (25, None)])
def test_code2wav_stream_equals_chunked_decode(frames, chunk, reference):
    codes = random_codes(frames)
    with torch.no_grad():
        ref = reference.code2wav.chunked_decode(codes.unsqueeze(0))[0, 0]
    streamer = Code2WavStreamer(
        reference.code2wav, chunk_frames=chunk[0], first_chunk_frames=chunk[1]
    )
    assert_audio_close(stream_audio(streamer, codes), ref)


@pytest.mark.slow
@pytest.mark.parametrize("frames", [301, 326, 601, 700])
def test_code2wav_stream_equals_chunked_decode_past_one_segment(frames, reference, streamer):
    """Past 300 frames the reference restarts its decode (25 frames of context) and loses
    samples at each boundary; the stream does the same, so stays within rounding of it."""
    codes = random_codes(frames, seed=frames)
    with torch.no_grad():
        ref = reference.code2wav.chunked_decode(codes.unsqueeze(0))[0, 0]
        whole = reference.code2wav(codes.unsqueeze(0))[0, 0]
    assert ref.shape[0] < whole.shape[0]  # the reference's boundary loss
    assert_audio_close(stream_audio(streamer, codes), ref)
    one = Code2WavStreamer(reference.code2wav, segment_frames=None)
    assert_audio_close(stream_audio(one, codes), whole)


def test_code2wav_chunks_arrive_as_frames_do(reference):
    streamer = Code2WavStreamer(reference.code2wav, chunk_frames=5, first_chunk_frames=2)
    state = streamer.start()
    sizes = [streamer.push(state, frame).numel() for frame in random_codes(13).T]
    # The first chunk after 2 frames, then every 5.
    assert [i for i, n in enumerate(sizes) if n] == [1, 6, 11]
    assert sizes[1] == streamer.samples(2)
    assert sizes[6] == 5 * streamer.upsample
    tail = streamer.flush(state)
    assert tail.numel() == streamer.upsample
    assert state.cache is None and state.convs == {}


def test_conv_stream_equals_the_whole_stack(reference):
    """code2wav's convolution stack fed in pieces of 1 to 7 frames gives the samples the
    module gives for all frames at once, in order (its tail of 555 samples still to come)."""
    from omnirail.models.qwen3_omni.conv_stream import ConvStream

    c2w = reference.code2wav
    hidden = torch.randn(
        (1, c2w.config.hidden_size, 40), generator=torch.Generator().manual_seed(7)
    )
    with torch.no_grad():
        whole = hidden
        for blocks in c2w.upsample:
            for block in blocks:
                whole = block(whole)
        for block in c2w.decoder:
            whole = block(whole)
        whole = whole.clamp(-1, 1)[0, 0]
    assert whole.shape[0] == 40 * 1920 - 555
    stream, state, parts, at = ConvStream(c2w), {}, [], 0
    for size in [1, 3, 7, 2, 5, 1, 4, 6, 3, 1, 7]:
        parts.append(stream(state, hidden[..., at : at + size])[0, 0])
        at += size
    assert at == 40
    assert (torch.cat(parts) - whole).abs().max().item() < 1e-6


def test_code2wav_bad_codes(streamer):
    state = streamer.start()
    with pytest.raises(ValueError, match="code frames"):
        streamer.push(state, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="codes must be"):
        streamer.push(state, torch.full((4,), tiny_model.CODEBOOK_SIZE))
    with pytest.raises(ValueError, match="codes must be"):
        streamer.push(state, torch.zeros(4))
    assert streamer.flush(state).numel() == 0


def test_code2wav_chunks_grow(reference):
    """With growth 2 the chunks after the first double, up to chunk_frames, and the audio
    still equals the reference's."""
    streamer = Code2WavStreamer(reference.code2wav, chunk_frames=12, first_chunk_frames=2, growth=2)
    codes = random_codes(40, seed=5)
    state = streamer.start()
    sizes = [streamer.push(state, frame).numel() for frame in codes.T]
    ends = [i + 1 for i, n in enumerate(sizes) if n]
    assert ends == [2, 6, 14, 26, 38]  # chunks of 2, 4, 8, 12, 12 frames
    with torch.no_grad():
        ref = reference.code2wav.chunked_decode(codes.unsqueeze(0))[0, 0]
    assert_audio_close(stream_audio(streamer, codes), ref)
    with pytest.raises(ValueError, match="growth"):
        Code2WavStreamer(reference.code2wav, growth=0)
