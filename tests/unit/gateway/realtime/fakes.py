"""Test doubles for realtime sessions: a responder whose pieces the test releases, a VAD
that reports speech at scripted times, and helpers that drain a session's outbox the way
a transport does (checking every event against the SDK's types)."""

from __future__ import annotations

import asyncio
import base64
import json
from collections import deque
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np

from omnirail.gateway.realtime.session import Delta, ResponseRequest, Session
from omnirail.gateway.realtime.vad import SpeechStarted, SpeechStopped, VadConfig
from tests.unit.gateway.realtime.sdk_types import parse_server_event

WAIT = 30.0  # seconds: generous, for a busy machine; nothing asserts on time


class FakeResponder:
    """Yields `pieces` (an Exception among them is raised there); with `gated`, each piece
    waits for `release()`. Records requests and whether it was cancelled or closed."""

    def __init__(self, pieces: Sequence[Delta | Exception] = (), *, gated: bool = False) -> None:
        self.pieces = list(pieces)
        self.gate: asyncio.Queue[None] | None = asyncio.Queue() if gated else None
        self.requests: list[ResponseRequest] = []
        self.yielded = 0
        self.cancelled = 0
        self.closed = 0
        self.ended = asyncio.Event()

    def release(self, count: int = 1) -> None:
        assert self.gate is not None
        for _ in range(count):
            self.gate.put_nowait(None)

    async def respond(self, request: ResponseRequest) -> AsyncIterator[Delta]:
        self.requests.append(request)
        try:
            for piece in self.pieces:
                if self.gate is not None:
                    await self.gate.get()
                if isinstance(piece, Exception):
                    raise piece
                self.yielded += 1
                yield piece
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled += 1  # the mesh responder aborts its request here
            raise
        finally:
            self.closed += 1
            self.ended.set()


class ScriptedVad:
    """Reports speech start/stop when the audio fed passes scripted milliseconds."""

    def __init__(
        self, config: VadConfig, origin_ms: int, script: Sequence[tuple[int, str]]
    ) -> None:
        self.config = config
        self.origin_ms = origin_ms
        self.script = deque(script)
        self.fed = 0
        self._speaking = False

    @property
    def speaking(self) -> bool:
        return self._speaking

    def feed(self, samples: np.ndarray) -> list[SpeechStarted | SpeechStopped]:
        self.fed += len(samples)
        now = self.origin_ms + self.fed * 1000 // 16000
        found: list[SpeechStarted | SpeechStopped] = []
        while self.script and self.script[0][0] <= now:
            at, kind = self.script.popleft()
            if kind == "start":
                self._speaking = True
                begin = max(self.origin_ms, at - self.config.prefix_padding_ms)
                found.append(SpeechStarted(audio_start_ms=begin, detected_ms=at))
            else:
                self._speaking = False
                found.append(SpeechStopped(audio_end_ms=at))
        return found

    def reset_turn(self) -> None:
        self._speaking = False


def scripted(*script: tuple[int, str]) -> Any:
    """A vad_factory whose VADs follow `script`."""
    return lambda config, origin_ms: ScriptedVad(config, origin_ms, script)


def tone(seconds: float, rate: int = 24000, freq: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def pcm(ms: int, start: int = 0) -> bytes:
    """`ms` of 24 kHz pcm16 whose samples count up from `start` (so slices are checkable)."""
    return (np.arange(start, start + ms * 24) % 30000).astype("<i2").tobytes()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


async def send(session: Session, /, **event: Any) -> None:
    await session.receive(json.dumps(event))


async def append(session: Session, data: bytes) -> None:
    await send(session, type="input_audio_buffer.append", audio=b64(data))


async def take(session: Session) -> list[dict[str, Any]]:
    """Every event queued now, taken as the transport takes them."""
    out = []
    while len(session.outbox):
        event = await session.outbox.get()
        assert event is not None
        parse_server_event(event)
        out.append(event)
    return out


async def take_until(session: Session, kind: str) -> list[dict[str, Any]]:
    """Events up to and including the first of type `kind`."""
    out: list[dict[str, Any]] = []

    async def pull() -> list[dict[str, Any]]:
        while True:
            event = await session.outbox.get()
            assert event is not None, f"outbox closed before {kind}"
            parse_server_event(event)
            out.append(event)
            if event["type"] == kind:
                return out

    return await asyncio.wait_for(pull(), WAIT)


async def until(condition: Any) -> None:
    """Waits (yielding to the loop) until `condition()` holds."""

    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.001)

    await asyncio.wait_for(poll(), WAIT)


def types(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


def of(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == kind]
