"""Server voice activity detection: the Realtime API's `server_vad` on Silero VAD.

The model is Silero VAD v6 from the `silero-vad` wheel (the `realtime` extra), which ships
it as ONNX (`silero_vad/data/silero_vad.onnx`) and TorchScript (`silero_vad.jit`). The
file is found without importing the `silero_vad` package: the package no longer needs
torchaudio (only its audio I/O helpers do), but importing it runs
`torch.set_num_threads(1)` for the whole process, which is not a library's to do.

Backends, the first one installed wins:
- `onnx` (onnxruntime, in the `realtime` extra): one InferenceSession per process, one
  thread, run from any thread. Measured here (2 cores): 0.03 s and ~30 MB to import
  onnxruntime, 0.04 s and ~22 MB for the session, 0.13 ms of CPU per 32 ms window.
- `torch` (TorchScript, torch being a dependency anyway): importing torch costs the
  gateway ~1.2 s and ~220 MB, the model ~8 MB; 0.3-0.5 ms of CPU per window. It runs on
  torch's intra-op threads, whose barriers stall for a scheduler slice (~90 ms a window
  seen here) when another process holds the other cores.
Both agree to 3e-7 in probability.

One model per process, shared by every session: the network is used as a pure function
`(context + window, state) -> (probability, state)` (the TorchScript wrapper that keeps
state in module attributes is bypassed), and each `ServerVad` keeps its own LSTM state
and 64-sample context, 1.3 KB. So a session costs ~1.3 KB and, while audio streams, 0.4 %
of a core (onnx) or 1-1.5 % (torch).

Semantics (what the API defines for `server_vad`), in the input buffer's timeline (whole
milliseconds of audio appended to the session since it began):
- Silero scores each 32 ms window. Speech starts at the first window whose probability is
  >= `threshold`; `SpeechStarted.audio_start_ms` is that window's start less
  `prefix_padding_ms` (never before `origin_ms`; the session clamps it to the start of
  the audio it still buffers).
- While in speech, a window whose probability is under `max(threshold - 0.15,
  threshold / 2)` is silent (Silero's own hysteresis, kept above zero for low thresholds);
  any other window is speech again.
  Speech stops once the silence since the end of the last speech window has lasted
  `silence_duration_ms`: `SpeechStopped.audio_end_ms` = that end + `silence_duration_ms`
  (the end of the audio the turn's item holds, so it includes the silence, as the API
  says).
- Deterministic: the same audio in any chunking gives the same events (the model runs on
  whole windows only, single-threaded in the onnx backend).
"""

from __future__ import annotations

import importlib.util
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from omnirail.gateway.realtime.audio import VAD_RATE

WINDOW = 512  # samples of 16 kHz audio Silero scores at a time (32 ms)
CONTEXT = 64  # samples of the previous window Silero sees before each one
WINDOW_MS = WINDOW * 1000 // VAD_RATE
HYSTERESIS = 0.15


@dataclass(frozen=True)
class VadConfig:
    """`server_vad` parameters, with the API's defaults."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold}")
        if self.prefix_padding_ms < 0 or self.silence_duration_ms < 0:
            raise ValueError("prefix_padding_ms and silence_duration_ms must be >= 0")


@dataclass(frozen=True)
class SpeechStarted:
    audio_start_ms: int  # includes the prefix padding
    detected_ms: int  # start of the first window scored as speech


@dataclass(frozen=True)
class SpeechStopped:
    audio_end_ms: int  # end of the last speech window + silence_duration_ms


VadEvent = SpeechStarted | SpeechStopped


BACKENDS = ("onnx", "torch")
_FILES = {"onnx": "silero_vad.onnx", "torch": "silero_vad.jit"}


def model_path(backend: str = "onnx") -> Path:
    """Where the installed `silero-vad` wheel keeps the model file for `backend` (found
    without importing the package)."""
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "server VAD needs the silero-vad package: pip install 'omnirail[realtime]'"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / _FILES[backend]
    if not path.is_file():
        raise RuntimeError(f"silero-vad is installed but has no model at {path}")
    return path


def available_backends() -> list[str]:
    """The backends whose runtime is installed, preferred first."""
    runtimes = {"onnx": "onnxruntime", "torch": "torch"}
    return [b for b in BACKENDS if importlib.util.find_spec(runtimes[b]) is not None]


class SileroModel:
    """Silero VAD's 16 kHz network, shared by sessions: a pure function of (window,
    state). `backend` None takes the first of `available_backends()`."""

    _shared: SileroModel | None = None
    _lock = threading.Lock()

    def __init__(self, backend: str | None = None) -> None:
        if backend is None:
            found = available_backends()
            if not found:
                raise RuntimeError("server VAD needs onnxruntime or torch")
            backend = found[0]
        if backend not in BACKENDS:
            raise ValueError(f"backend: one of {BACKENDS}, got {backend!r}")
        self.backend = backend
        path = model_path(backend)
        # Imported here: the gateway imports without them until VAD is used.
        if backend == "onnx":
            import onnxruntime

            options = onnxruntime.SessionOptions()
            # One thread, in the caller's: no barrier waits on a busy host, and the
            # gateway's other work keeps its cores.
            options.intra_op_num_threads = 1
            options.inter_op_num_threads = 1
            options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
            self._net: Any = onnxruntime.InferenceSession(
                str(path), sess_options=options, providers=["CPUExecutionProvider"]
            )
            self._rate = np.array(VAD_RATE, dtype=np.int64)
        else:
            import torch

            with warnings.catch_warnings():
                # torch 2.13 deprecates TorchScript loading; silero ships no other torch form.
                warnings.simplefilter("ignore", DeprecationWarning)
                module = torch.jit.load(str(path), map_location="cpu")
            module.eval()
            self._net = module._model  # the 16 kHz network; the wrapper would hold state
            self._torch = torch

    @classmethod
    def shared(cls) -> SileroModel:
        """The process's model, loaded on first use."""
        with cls._lock:
            if cls._shared is None:
                cls._shared = SileroModel()
            return cls._shared

    def initial_state(self) -> tuple[Any, np.ndarray]:
        """A new session's (LSTM state, context)."""
        state = np.zeros((2, 1, 128), dtype=np.float32)
        if self.backend == "torch":
            return self._torch.from_numpy(state), np.zeros(CONTEXT, dtype=np.float32)
        return state, np.zeros(CONTEXT, dtype=np.float32)

    def score(
        self, windows: np.ndarray, state: Any, context: np.ndarray
    ) -> tuple[list[float], Any, np.ndarray]:
        """Speech probabilities of consecutive `WINDOW`-sample windows (a 2-D float32
        array), and the state and context after them."""
        probabilities: list[float] = []
        if self.backend == "onnx":
            for window in windows:
                frame = np.concatenate([context, window])[None, :]
                feed = {"input": frame, "state": state, "sr": self._rate}
                out, state = self._net.run(None, feed)
                probabilities.append(float(out.reshape(-1)[0]))
                context = window[-CONTEXT:]
            return probabilities, state, context
        torch = self._torch
        # Unoptimized execution: the profiling executor's first calls specialize a graph
        # (tens of ms each) that runs no faster for windows this small.
        with torch.inference_mode(), torch.jit.optimized_execution(False):
            for window in windows:
                frame = np.concatenate([context, window])[None, :]
                out, state = self._net(torch.from_numpy(frame), state)
                probabilities.append(float(out.reshape(-1)[0]))
                context = window[-CONTEXT:]
        return probabilities, state, context


class ServerVad:
    """Streaming `server_vad` for one session: feed 16 kHz float32 audio in chunks of any
    length; get speech start/stop events in the session's millisecond timeline.

    `origin_ms` is where the first sample fed sits in that timeline (a session that turns
    VAD on mid-way starts it at the audio appended so far).
    """

    def __init__(
        self,
        config: VadConfig | None = None,
        *,
        model: SileroModel | None = None,
        origin_ms: int = 0,
    ) -> None:
        self.config = config or VadConfig()
        self._model = model or SileroModel.shared()
        self._state, self._context = self._model.initial_state()
        self._pending = np.zeros(0, dtype=np.float32)  # fed, not yet a whole window
        self._origin_ms = origin_ms
        self._windows = 0  # windows scored
        self._speaking = False
        self._speech_end_ms = 0  # end of the last window scored as speech

    @property
    def speaking(self) -> bool:
        return self._speaking

    @property
    def position_ms(self) -> int:
        """The end of the audio scored so far, in the session's timeline."""
        return self._window_start_ms(self._windows)

    def reset_turn(self) -> None:
        """Forgets speech in progress (the buffer was committed or cleared under it): the
        next stop needs a new start first. Silero's state carries on."""
        self._speaking = False

    def feed(self, samples: np.ndarray) -> list[VadEvent]:
        """Scores every whole window now available; the events they cause, in order."""
        audio = np.asarray(samples, dtype=np.float32).reshape(-1)
        self._pending = np.concatenate([self._pending, audio])
        whole = len(self._pending) // WINDOW
        if not whole:
            return []
        windows = self._pending[: whole * WINDOW].reshape(whole, WINDOW)
        self._pending = self._pending[whole * WINDOW :].copy()
        probabilities, self._state, self._context = self._model.score(
            windows, self._state, self._context
        )
        events: list[VadEvent] = []
        for probability in probabilities:
            event = self._step(probability)
            if event is not None:
                events.append(event)
        return events

    def _window_start_ms(self, index: int) -> int:
        return self._origin_ms + index * WINDOW * 1000 // VAD_RATE

    def _step(self, probability: float) -> VadEvent | None:
        config = self.config
        start = self._window_start_ms(self._windows)
        end = self._window_start_ms(self._windows + 1)
        self._windows += 1
        if not self._speaking:
            if probability < config.threshold:
                return None
            self._speaking = True
            self._speech_end_ms = end
            begin = max(self._origin_ms, start - config.prefix_padding_ms)
            return SpeechStarted(audio_start_ms=begin, detected_ms=start)
        if probability >= max(config.threshold - HYSTERESIS, config.threshold / 2):
            self._speech_end_ms = end
            return None
        if end - self._speech_end_ms < config.silence_duration_ms:
            return None
        self._speaking = False
        return SpeechStopped(audio_end_ms=self._speech_end_ms + config.silence_duration_ms)
