"""Server VAD on Silero: one start and one stop per utterance at the right milliseconds,
the API's parameters, determinism, and state kept per session over one shared model.

The audio is synthetic (omnirail/testing/speech.py says what Silero takes for
speech). Window granularity is 32 ms, so times are checked to within one window."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from omnirail.gateway.realtime.audio import resample
from omnirail.gateway.realtime.vad import (
    WINDOW_MS,
    ServerVad,
    SileroModel,
    SpeechStarted,
    SpeechStopped,
    VadConfig,
    available_backends,
    model_path,
)
from omnirail.testing.speech import silence, speech

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("silero_vad") is None, reason="needs the realtime extra (silero-vad)"
)
RATE = 16000


def _utterance(
    lead: float = 1.0, talk: float = 1.5, tail: float = 1.0, seed: int = 0
) -> np.ndarray:
    return np.concatenate([silence(lead, RATE), speech(talk, RATE, seed), silence(tail, RATE)])


def _feed(vad: ServerVad, audio: np.ndarray, chunk: int) -> list[SpeechStarted | SpeechStopped]:
    found: list[SpeechStarted | SpeechStopped] = []
    for at in range(0, len(audio), chunk):
        found += vad.feed(audio[at : at + chunk])
    return found


BACKENDS = available_backends()


@pytest.fixture(scope="module", params=BACKENDS)
def model(request: pytest.FixtureRequest) -> SileroModel:
    return SileroModel(request.param)


def test_the_model_loads_from_the_wheel_without_importing_the_package() -> None:
    import sys

    assert model_path("onnx").name == "silero_vad.onnx"
    assert model_path("torch").name == "silero_vad.jit"
    assert SileroModel.shared().backend == BACKENDS[0]
    assert "silero_vad" not in sys.modules  # its import would set torch's thread count
    assert "torchaudio" not in sys.modules


def test_the_backends_agree() -> None:
    if len(BACKENDS) < 2:
        pytest.skip("one backend installed")
    audio = _utterance()[: 100 * 512].reshape(100, 512)
    scores = []
    for backend in BACKENDS:
        net = SileroModel(backend)
        scores.append(net.score(audio, *net.initial_state())[0])
    assert np.abs(np.subtract(*scores)).max() < 1e-4


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_utterance_gives_one_start_and_one_stop(model: SileroModel, seed: int) -> None:
    found = ServerVad(model=model).feed(_utterance(seed=seed))
    assert [type(e) for e in found] == [SpeechStarted, SpeechStopped]
    start, stop = found
    assert isinstance(start, SpeechStarted) and isinstance(stop, SpeechStopped)
    # Speech begins at 1000 ms: the window holding it, or the next, is the first scored
    # as speech.
    assert 1000 - WINDOW_MS <= start.detected_ms <= 1000 + WINDOW_MS
    assert start.audio_start_ms == start.detected_ms - 300  # prefix padding
    # Speech ends at 2500 ms; Silero's score falls under the threshold's hysteresis within
    # a few windows, and the stop is declared silence_duration_ms after that.
    assert 2500 + 500 - WINDOW_MS <= stop.audio_end_ms <= 2500 + 500 + 4 * WINDOW_MS


def test_silence_noise_and_tones_are_not_speech() -> None:
    rng = np.random.default_rng(0)
    t = np.arange(3 * RATE) / RATE
    signals = [
        silence(3, RATE),
        0.1 * rng.standard_normal(3 * RATE),
        0.3 * np.sin(2 * np.pi * 440 * t),
        0.3 * np.sin(2 * np.pi * 200 * t) * (1 + np.sin(2 * np.pi * 4 * t)) / 2,
    ]
    for signal in signals:
        assert ServerVad().feed(signal.astype(np.float32)) == []


def test_any_chunking_gives_the_same_events(model: SileroModel) -> None:
    audio = _utterance()
    expected = ServerVad(model=model).feed(audio)
    for chunk in (160, 320, 511, 512, 2400):
        assert _feed(ServerVad(model=model), audio, chunk) == expected


def test_sessions_keep_their_own_state_over_the_shared_model(model: SileroModel) -> None:
    a_audio, b_audio = _utterance(seed=0), _utterance(lead=0.5, seed=3)
    alone_a = ServerVad(model=model).feed(a_audio)
    alone_b = ServerVad(model=model).feed(b_audio)
    a, b = ServerVad(model=model), ServerVad(model=model)
    found_a, found_b = [], []
    for at in range(0, max(len(a_audio), len(b_audio)), 480):
        found_a += a.feed(a_audio[at : at + 480])
        found_b += b.feed(b_audio[at : at + 480])
    assert (found_a, found_b) == (alone_a, alone_b)


def test_a_pause_shorter_than_silence_duration_keeps_one_turn() -> None:
    pause = np.concatenate([speech(0.8, RATE, 1), silence(0.3, RATE), speech(0.8, RATE, 2)])
    audio = np.concatenate([silence(0.5, RATE), pause, silence(1.0, RATE)])
    long_wait = ServerVad(VadConfig(silence_duration_ms=500)).feed(audio)
    short_wait = ServerVad(VadConfig(silence_duration_ms=150)).feed(audio)
    assert [type(e) for e in long_wait] == [SpeechStarted, SpeechStopped]
    assert [type(e) for e in short_wait] == [SpeechStarted, SpeechStopped] * 2


def test_padding_origin_and_threshold() -> None:
    audio = _utterance(lead=0.2)
    start = ServerVad(VadConfig(prefix_padding_ms=1000), origin_ms=5000).feed(audio)[0]
    assert isinstance(start, SpeechStarted)
    assert 5200 - WINDOW_MS <= start.detected_ms <= 5200 + WINDOW_MS
    assert start.audio_start_ms == 5000  # padding never reaches before the origin
    # Silero never scores a window 1.0 exactly: the strictest threshold hears nothing.
    assert ServerVad(VadConfig(threshold=1.0)).feed(audio) == []


def test_reset_turn_forgets_speech_in_progress() -> None:
    vad = ServerVad()
    found = vad.feed(np.concatenate([silence(0.5, RATE), speech(1.0, RATE)]))
    assert [type(e) for e in found] == [SpeechStarted] and vad.speaking
    vad.reset_turn()
    assert not vad.speaking
    # Speech goes on: a new start is reported before the stop.
    found = vad.feed(np.concatenate([speech(0.5, RATE, 4), silence(1.0, RATE)]))
    assert [type(e) for e in found] == [SpeechStarted, SpeechStopped]


def test_the_24k_wire_audio_resampled_gives_the_same_times() -> None:
    wire = np.concatenate([silence(1.0), speech(1.5), silence(1.0)])  # 24 kHz
    found = ServerVad().feed(resample(wire, 24000, 16000))
    assert [type(e) for e in found] == [SpeechStarted, SpeechStopped]
    assert 1000 - WINDOW_MS <= found[0].detected_ms <= 1000 + WINDOW_MS  # type: ignore[union-attr]


def test_config_is_checked() -> None:
    with pytest.raises(ValueError):
        VadConfig(threshold=1.5)
    with pytest.raises(ValueError):
        VadConfig(silence_duration_ms=-1)
