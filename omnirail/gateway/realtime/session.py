"""One Realtime API session as a state machine, free of WebSockets and of the mesh.

The transport feeds it client frames (`receive`) and sends what it puts in its `outbox`
(`Outbox.get`), in order. The model is a `Responder`: `respond(request)` yields `Delta`s
(text, and float32 audio at any sample rate) and is cancelled as a task; the mesh's
responder aborts its mesh request when cancelled. A responder that fails raises
`ResponseFailed` (its type, code and message go to the client) or any exception (a bug:
logged, and the client hears `server_error` / `response_failed`); either way the response
ends with `response.done` status `failed`, and the session goes on.

What holds:
- Every client frame gets the API's answer or an `error` event; nothing a client sends
  raises out of `receive`.
- Outbound events leave through one queue with unique `event_id`s. Response deltas wait
  for room in it (`Limits.max_pending_events`), so a slow reader slows the model down
  instead of growing memory.
- At most one response runs. `response.create` while one runs is an error
  (`conversation_already_has_active_response`) and the running one goes on.
- Server VAD (`turn_detection` `server_vad`, the default; null means manual commits): on
  speech start with `interrupt_response`, a running response is cancelled at once
  (barge-in, `response.done` status `cancelled`, reason `turn_detected`); on speech stop,
  the turn's audio (from `audio_start_ms` to `audio_end_ms`) is committed as a user item
  and, with `create_response`, a response starts.
- Output audio is quantized as the gateway's HTTP routes quantize theirs
  (`omnirail.gateway.audio.pcm16`: clipped to [-1, 1], times 32767, rounded), after
  resampling to 24 kHz (none for a model that speaks at 24 kHz): the same model output
  gives the same pcm16 samples here and from `/v1/chat/completions`.
- Audio sent: an audio delta counts as sent when the transport takes it from the outbox.
  A cancelled response's deltas still queued are dropped, and its item keeps only the
  audio sent. Its transcript is cut by the same share (`items.truncate_transcript`): the
  share of characters equal to the share of audio kept, back to a whole word. The same
  rule serves `conversation.item.truncate` (`audio_end_ms` past the audio's end is an
  error).
- Refusals, as `error` events with the client event's `event_id` (events.py lists the
  validation codes): `input_audio_buffer_commit_empty` (under `min_commit_ms`),
  `input_audio_buffer_full`, `conversation_already_has_active_response`,
  `response_cancel_not_active`, `item_not_found`, `item_in_progress` (truncating or
  deleting the item a response is making), `duplicate_item_id`,
  `conversation_item_limit_reached`, `invalid_value` (a truncation past the audio, of a
  non-assistant item, a model change); with type `server_error`: `vad_unavailable`,
  `internal_error` (a bug, logged; the session goes on).
- Bounds (`Limits`): items per conversation, seconds of buffered input audio (errors, not
  growth), seconds of audio kept in items (the oldest items' audio is dropped, their text
  kept). With server VAD, buffered audio from before the current turn (less the prefix
  padding) is let go as it ages, so a manual commit between turns commits at most
  `prefix_padding_ms` + 200 ms.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Literal, Protocol

import numpy as np

from omnirail.gateway.audio import pcm16 as output_pcm16
from omnirail.gateway.realtime import events as ev
from omnirail.gateway.realtime.audio import (
    BYTES_PER_SAMPLE,
    VAD_RATE,
    WIRE_RATE,
    Resampler,
    ms_to_samples,
    pcm16_to_float,
    samples_to_ms,
)
from omnirail.gateway.realtime.items import Item, Part, truncate_transcript
from omnirail.gateway.realtime.vad import ServerVad, SpeechStarted, SpeechStopped, VadConfig

log = logging.getLogger(__name__)

Modality = Literal["text", "audio"]


@dataclass(frozen=True)
class Limits:
    max_items: int = 512
    max_buffer_seconds: float = 120.0
    max_item_audio_seconds: float = 1800.0  # over all items (~86 MB of pcm16)
    min_commit_ms: int = 100
    audio_delta_ms: int = 100  # the longest audio delta sent
    max_pending_events: int = 64
    idle_keep_ms: int = 200  # kept past the prefix padding between VAD turns


@dataclass(frozen=True)
class Delta:
    """A piece of a response: text (the transcript, for audio output) and/or audio."""

    text: str = ""
    audio: np.ndarray | None = None  # float32 mono in [-1, 1]
    sample_rate: int = WIRE_RATE


@dataclass(frozen=True)
class ResponseRequest:
    """What a responder answers: the conversation so far (copies) and the settings;
    `conversation_id` is the session's (one per session: every response of a session is a
    turn of it)."""

    response_id: str
    items: tuple[Item, ...]
    instructions: str | None
    output_modalities: tuple[Modality, ...]
    voice: str | None
    speed: float
    max_output_tokens: int | None  # None: no limit
    conversation_id: str = ""


class ResponseFailed(Exception):
    """A responder's refusal or failure the client should hear as it is (not a bug): the
    response's `status_details.error` gets this type, code and message."""

    def __init__(self, message: str, code: str = "response_failed", type: str = "server_error"):
        super().__init__(message)
        self.message = message
        self.code = code
        self.type = type


class Responder(Protocol):
    """The model side of a session. `respond` is an async generator (or any async
    iterator); cancelling the task that iterates it must stop the work behind it. A
    responder may also have `async aclose()`: the endpoint awaits it once its session has
    ended (the mesh's responder drops the conversation's state there)."""

    def respond(self, request: ResponseRequest) -> AsyncIterator[Delta]: ...


class Vad(Protocol):
    """What the session needs of a VAD (`vad.ServerVad`, or a test's script)."""

    config: VadConfig

    @property
    def speaking(self) -> bool: ...

    def feed(self, samples: np.ndarray) -> list[SpeechStarted | SpeechStopped]: ...

    def reset_turn(self) -> None: ...


VadFactory = Callable[[VadConfig, int], Vad]


def silero_vad(config: VadConfig, origin_ms: int) -> Vad:
    return ServerVad(config, origin_ms=origin_ms)


@dataclass(frozen=True)
class TurnDetection:
    """`server_vad` settings with the API's defaults."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True

    def vad_config(self) -> VadConfig:
        return VadConfig(self.threshold, self.prefix_padding_ms, self.silence_duration_ms)

    def to_json(self) -> dict[str, Any]:
        return {
            "type": "server_vad",
            "threshold": self.threshold,
            "prefix_padding_ms": self.prefix_padding_ms,
            "silence_duration_ms": self.silence_duration_ms,
            "create_response": self.create_response,
            "interrupt_response": self.interrupt_response,
            "idle_timeout_ms": None,
        }


@dataclass
class SessionConfig:
    """The effective session configuration (`session.created/updated` report it)."""

    model: str
    instructions: str | None = None
    output_modalities: tuple[Modality, ...] = ("audio",)
    turn_detection: TurnDetection | None = field(default_factory=TurnDetection)
    voice: Any = None
    speed: float = 1.0
    max_output_tokens: int | Literal["inf"] = "inf"

    def to_json(self) -> dict[str, Any]:
        detection = self.turn_detection.to_json() if self.turn_detection else None
        return {
            "type": "realtime",
            "model": self.model,
            "instructions": self.instructions,
            "output_modalities": list(self.output_modalities),
            "audio": {
                "input": {
                    "format": dict(ev.AUDIO_FORMAT),
                    "noise_reduction": None,
                    "transcription": None,
                    "turn_detection": detection,
                },
                "output": {
                    "format": dict(ev.AUDIO_FORMAT),
                    "voice": self.voice,
                    "speed": self.speed,
                },
            },
            "max_output_tokens": self.max_output_tokens,
            "tools": [],
            "tool_choice": "auto",
        }


class Outbox:
    """The session's outbound events, in order, for one transport to drain.

    `put` never blocks (control events are small); producers of many events (response
    deltas) await `room()` first. `get` runs an event's `on_sent` as it hands it over.
    """

    def __init__(self, high_water: int = 64) -> None:
        self.high_water = high_water
        self._tag = secrets.token_hex(5)
        self._count = itertools.count(1)
        self._queue: deque[tuple[dict[str, Any], Callable[[], None] | None]] = deque()
        self._nonempty = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._closed = False

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def closed(self) -> bool:
        return self._closed

    def pending(self) -> list[dict[str, Any]]:
        """The events waiting, oldest first (copies of the list, not of the events)."""
        return [event for event, _ in self._queue]

    def put(self, event: dict[str, Any], on_sent: Callable[[], None] | None = None) -> str:
        """Queues `event` with a new `event_id` (returned); dropped once closed."""
        event_id = f"event_{self._tag}{next(self._count):x}"
        if self._closed:
            return event_id
        self._queue.append(({"event_id": event_id, **event}, on_sent))
        self._nonempty.set()
        if len(self._queue) >= self.high_water:
            self._room.clear()
        return event_id

    async def room(self) -> None:
        """Returns once fewer than `high_water` events wait (or the outbox is closed)."""
        await self._room.wait()

    async def get(self) -> dict[str, Any] | None:
        """The next event; None once closed and drained."""
        while not self._queue:
            if self._closed:
                return None
            self._nonempty.clear()
            await self._nonempty.wait()
        event, on_sent = self._queue.popleft()
        if on_sent is not None:
            on_sent()
        if len(self._queue) < self.high_water:
            self._room.set()
        return event

    def drop(self, predicate: Callable[[dict[str, Any]], bool]) -> int:
        """Removes the waiting events `predicate` selects; how many."""
        kept = deque(entry for entry in self._queue if not predicate(entry[0]))
        dropped = len(self._queue) - len(kept)
        self._queue = kept
        if len(self._queue) < self.high_water:
            self._room.set()
        return dropped

    def close(self) -> None:
        """No more events: `get` drains what waits, then returns None."""
        self._closed = True
        self._nonempty.set()
        self._room.set()


@dataclass
class _Response:
    id: str
    request: ResponseRequest
    metadata: dict[str, str] | None
    max_output_tokens: int | Literal["inf"]
    status: str = "in_progress"
    status_details: dict[str, Any] | None = None
    item: Item | None = None
    part: Part | None = None
    ref: ev.PartRef | None = None
    previous_item_id: str | None = None
    task: asyncio.Task[None] | None = None
    resampler: Resampler | None = None
    sent_bytes: int = 0  # audio taken by the transport
    finished: bool = False

    @property
    def audio_out(self) -> bool:
        return "audio" in self.request.output_modalities

    def to_json(self, conversation_id: str) -> dict[str, Any]:
        voice = self.request.voice
        return {
            "object": "realtime.response",
            "id": self.id,
            "status": self.status,
            "status_details": self.status_details,
            "output": [self.item.to_json()] if self.item else [],
            "conversation_id": conversation_id,
            "output_modalities": list(self.request.output_modalities),
            "max_output_tokens": self.max_output_tokens,
            "audio": {"output": {"format": dict(ev.AUDIO_FORMAT), "voice": voice}},
            "usage": None,
            "metadata": self.metadata,
        }


class _Refused(Exception):
    """A client event the session cannot carry out: becomes an `error` event."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


_DROPPED_ON_CANCEL = frozenset({"response.output_audio.delta"})


class Session:
    """A realtime session: client events in (`receive`), server events out (`outbox`).

    `start()` sends `session.created`; `close()` cancels a running response (its
    responder's work is aborted) and closes the outbox.
    """

    def __init__(
        self,
        responder: Responder,
        *,
        model: str,
        limits: Limits | None = None,
        vad_factory: VadFactory = silero_vad,
        vad_executor: Executor | None = None,
        max_frame_chars: int = ev.MAX_FRAME_CHARS,
    ) -> None:
        self.limits = limits or Limits()
        self.config = SessionConfig(model=model)
        self.outbox = Outbox(self.limits.max_pending_events)
        self.conversation_id = f"conv_{secrets.token_hex(10)}"
        self._responder = responder
        self._vad_factory = vad_factory
        self._vad_executor = vad_executor
        self._max_frame_chars = max_frame_chars
        self._ids = itertools.count(1)
        self._tag = secrets.token_hex(6)
        self._items: list[Item] = []
        self._index: dict[str, Item] = {}
        self._buffer = bytearray()  # pcm16 input not yet committed
        self._buffer_start = 0  # session sample index of the buffer's first sample
        self._appended = 0  # samples appended in the session
        self._vad: Vad | None = None
        self._vad_resampler: Resampler | None = None
        self._speech: tuple[str, int] | None = None  # (item id, audio_start_ms) of a turn
        self._response: _Response | None = None
        self._closed = False

    # -- life -------------------------------------------------------------------------------

    def start(self) -> None:
        """Turns on the default turn detection and sends `session.created` (and an error
        after it if server VAD cannot run here)."""
        problem = self._apply_turn_detection(self.config.turn_detection, event_id=None)
        self._send(ev.session_created(self.config.to_json()))
        if problem is not None:
            self._send(problem)

    async def close(self) -> None:
        """The client is gone: stop the running response and end the outbox."""
        self._closed = True
        await self._cancel("client_cancelled")
        self.outbox.close()

    @property
    def active_response(self) -> str | None:
        return self._response.id if self._response else None

    @property
    def items(self) -> list[Item]:
        return list(self._items)

    @property
    def buffered_ms(self) -> int:
        return samples_to_ms(len(self._buffer) // BYTES_PER_SAMPLE)

    # -- client events ----------------------------------------------------------------------

    async def receive(self, frame: str | bytes) -> None:
        """Handles one client frame; a bad one, or one that cannot be carried out, is
        answered with an `error` event."""
        event = ev.parse_client_event(frame, max_chars=self._max_frame_chars)
        if isinstance(event, ev.ProtocolError):
            self._send(ev.error_event(event))
            return
        await self.handle(event)

    async def handle(self, event: ev.ClientEvent) -> None:
        """Carries out one validated client event."""
        if self._closed:
            return
        try:
            await self._dispatch(event)
        except _Refused as refused:
            error = ev.ProtocolError(refused.code, refused.message, refused.param, event.event_id)
            self._send(ev.error_event(error))
        except Exception:
            # A bug here must not end the session: the client hears of it.
            log.exception("realtime session: %s failed", event.type)
            error = ev.ProtocolError(
                "internal_error", f"the server failed on {event.type}", None, event.event_id,
                type="server_error",
            )  # fmt: skip
            self._send(ev.error_event(error))

    async def _dispatch(self, event: ev.ClientEvent) -> None:
        if isinstance(event, ev.AudioAppend):
            await self._append(event.audio)
        elif isinstance(event, ev.SessionUpdate):
            self._update(event)
        elif isinstance(event, ev.AudioCommit):
            self._commit_buffer()
        elif isinstance(event, ev.AudioClear):
            self._clear_buffer()
        elif isinstance(event, ev.ItemCreate):
            self._create_item(event)
        elif isinstance(event, ev.ItemTruncate):
            self._truncate(event)
        elif isinstance(event, ev.ItemDelete):
            self._delete(event.item_id)
        elif isinstance(event, ev.ItemRetrieve):
            self._send(ev.item_retrieved(self._find(event.item_id)))
        elif isinstance(event, ev.ResponseCreate):
            self._create_response(event.response)
        elif isinstance(event, ev.ResponseCancel):
            response = self._response
            if response is None or event.response_id not in (None, response.id):
                raise _Refused(
                    "response_cancel_not_active",
                    "Cancellation failed: no active response found"
                    + (f" with id '{event.response_id}'." if event.response_id else "."),
                    "response_id" if event.response_id else None,
                )
            await self._cancel("client_cancelled")

    # -- session.update ---------------------------------------------------------------------

    def _update(self, event: ev.SessionUpdate) -> None:
        params = event.session
        given = params.model_fields_set
        if "model" in given and params.model not in (None, self.config.model):
            raise _Refused(
                "invalid_value",
                f"This session serves '{self.config.model}'; the model cannot be changed.",
                "session.model",
            )
        config = self.config
        if "instructions" in given:
            config.instructions = params.instructions
        if params.output_modalities is not None:
            config.output_modalities = tuple(params.output_modalities)
        if "max_output_tokens" in given:
            config.max_output_tokens = params.max_output_tokens or "inf"
        audio = params.audio
        if audio is not None and audio.output is not None:
            if "voice" in audio.output.model_fields_set:
                config.voice = audio.output.voice
            if audio.output.speed is not None:
                config.speed = audio.output.speed
        if audio is not None and audio.input is not None:
            if "turn_detection" in audio.input.model_fields_set:
                wanted = audio.input.turn_detection
                detection = None
                if isinstance(wanted, ev.ServerVadParams):
                    # The given object replaces the old one; what it omits is the default.
                    detection = replace(TurnDetection(), **wanted.model_dump(
                        exclude_none=True, exclude={"type", "idle_timeout_ms"}
                    ))  # fmt: skip
                problem = self._apply_turn_detection(detection, event.event_id)
                if problem is not None:
                    self._send(problem)
        self._send(ev.session_updated(config.to_json()))

    def _apply_turn_detection(
        self, detection: TurnDetection | None, event_id: str | None
    ) -> dict[str, Any] | None:
        """Turns server VAD on, off or to new settings; the error event to send if it
        cannot run (turn detection is then off)."""
        problem = None
        if detection is None:
            self._vad = None
            self._vad_resampler = None
            self._speech = None
        elif self._vad is not None:
            self._vad.config = detection.vad_config()
        else:
            try:
                self._vad = self._vad_factory(detection.vad_config(), self._timeline_ms())
            except (RuntimeError, ImportError, OSError) as exc:
                log.warning("realtime: server VAD unavailable: %s", exc)
                error = ev.ProtocolError(
                    "vad_unavailable", f"server VAD is unavailable here ({exc}); "
                    "turn detection is off: commit the input audio buffer yourself",
                    "session.audio.input.turn_detection", event_id, type="server_error",
                )  # fmt: skip
                problem = ev.error_event(error)
                detection = None
            else:
                self._vad_resampler = Resampler(WIRE_RATE, VAD_RATE)
        self.config.turn_detection = detection
        return problem

    # -- the input audio buffer -------------------------------------------------------------

    def _timeline_ms(self) -> int:
        return samples_to_ms(self._appended)

    async def _append(self, pcm: bytes) -> None:
        if not pcm:
            return
        samples = len(pcm) // BYTES_PER_SAMPLE
        if self._vad is not None and self._speech is None:
            self._let_idle_audio_go()
        limit = int(self.limits.max_buffer_seconds * WIRE_RATE)
        if len(self._buffer) // BYTES_PER_SAMPLE + samples > limit:
            raise _Refused(
                "input_audio_buffer_full",
                f"The input audio buffer holds at most {self.limits.max_buffer_seconds:g} s "
                "of audio: commit or clear it. This audio was dropped.",
                "audio",
            )
        self._buffer += pcm
        self._appended += samples
        if self._vad is None or self._vad_resampler is None:
            return
        audio = self._vad_resampler.process(pcm16_to_float(pcm))
        vad = self._vad
        if self._vad_executor is not None:
            loop = asyncio.get_running_loop()
            found = await loop.run_in_executor(self._vad_executor, vad.feed, audio)
        else:
            found = vad.feed(audio)
        for event in found:
            if self._vad is not vad:
                break  # turned off or replaced meanwhile
            if isinstance(event, SpeechStarted):
                await self._speech_started(event)
            else:
                self._speech_stopped(event)

    def _let_idle_audio_go(self) -> None:
        assert self.config.turn_detection is not None
        keep = ms_to_samples(
            self.config.turn_detection.prefix_padding_ms + self.limits.idle_keep_ms
        )
        self._drop_buffer_before(self._appended - keep)

    def _drop_buffer_before(self, sample: int) -> None:
        drop = sample - self._buffer_start
        if drop > 0:
            del self._buffer[: drop * BYTES_PER_SAMPLE]
            self._buffer_start += drop

    def _take_buffer(self, end_sample: int) -> bytes:
        """The buffer's audio up to `end_sample`, removed from it."""
        count = max(0, min(end_sample, self._appended) - self._buffer_start)
        pcm = bytes(self._buffer[: count * BYTES_PER_SAMPLE])
        del self._buffer[: count * BYTES_PER_SAMPLE]
        self._buffer_start += count
        return pcm

    async def _speech_started(self, event: SpeechStarted) -> None:
        assert self.config.turn_detection is not None
        start_ms = max(event.audio_start_ms, samples_to_ms(self._buffer_start))
        item_id = self._new_id("item")
        self._speech = (item_id, start_ms)
        self._drop_buffer_before(ms_to_samples(start_ms))
        self._send(ev.speech_started(start_ms, item_id))
        if self.config.turn_detection.interrupt_response and self._response is not None:
            await self._cancel("turn_detected")

    def _speech_stopped(self, event: SpeechStopped) -> None:
        if self._speech is None:
            return  # the turn was committed or cleared under the VAD
        item_id, _ = self._speech
        self._speech = None
        self._send(ev.speech_stopped(event.audio_end_ms, item_id))
        pcm = self._take_buffer(ms_to_samples(event.audio_end_ms))
        try:
            self._commit(item_id, pcm)
        except _Refused as refused:
            self._send(ev.error_event(ev.ProtocolError(refused.code, refused.message)))
            return
        detection = self.config.turn_detection
        if detection is not None and detection.create_response:
            try:
                self._create_response(None)
            except _Refused as refused:
                self._send(ev.error_event(ev.ProtocolError(refused.code, refused.message)))

    def _commit_buffer(self) -> None:
        have = self.buffered_ms
        if have < self.limits.min_commit_ms:
            raise _Refused(
                "input_audio_buffer_commit_empty",
                "Error committing input audio buffer: buffer too small. Expected at least "
                f"{self.limits.min_commit_ms}ms of audio, but buffer only has {have}ms of audio.",
            )
        item_id = self._speech[0] if self._speech else self._new_id("item")
        self._end_turn()
        self._commit(item_id, self._take_buffer(self._appended))

    def _clear_buffer(self) -> None:
        self._take_buffer(self._appended)
        self._end_turn()
        self._send(ev.buffer_cleared())

    def _end_turn(self) -> None:
        self._speech = None
        if self._vad is not None:
            self._vad.reset_turn()

    def _commit(self, item_id: str, pcm: bytes) -> None:
        self._check_room()
        item = Item(item_id, "user", [Part("input_audio", audio=pcm)])
        previous = self._insert(item, len(self._items))
        self._send(ev.buffer_committed(item_id, previous))
        self._send(ev.item_added(item, previous))
        self._send(ev.item_done(item, previous))

    # -- conversation items -----------------------------------------------------------------

    def _new_id(self, kind: str) -> str:
        while True:
            new = f"{kind}_{self._tag}{next(self._ids):x}"
            if new not in self._index:
                return new

    def _find(self, item_id: str) -> Item:
        item = self._index.get(item_id)
        if item is None:
            raise _Refused(
                "item_not_found",
                f"Conversation item with id '{item_id[:64]}' not found.",
                "item_id",
            )
        return item

    def _check_room(self) -> None:
        # A running response that has not yet added its item holds a place for it.
        pending = self._response is not None and self._response.item is None
        if len(self._items) + pending >= self.limits.max_items:
            raise _Refused(
                "conversation_item_limit_reached",
                f"The conversation holds at most {self.limits.max_items} items: delete some.",
            )

    def _insert(self, item: Item, position: int) -> str | None:
        """Puts `item` at `position`; the id of the item before it."""
        self._items.insert(position, item)
        self._index[item.id] = item
        self._keep_audio_bounded()
        return self._items[position - 1].id if position > 0 else None

    def _keep_audio_bounded(self) -> None:
        budget = int(self.limits.max_item_audio_seconds * WIRE_RATE) * BYTES_PER_SAMPLE
        total = sum(item.audio_bytes for item in self._items)
        for item in self._items:
            if total <= budget:
                return
            if item.status == "in_progress":
                continue
            for part in item.content:
                total -= len(part.audio)
                part.audio = b""

    def _create_item(self, event: ev.ItemCreate) -> None:
        params = event.item
        item_id = params.id or self._new_id("item")
        if item_id in self._index:
            raise _Refused(
                "duplicate_item_id", f"An item with id '{item_id}' already exists.", "item.id"
            )
        self._check_room()
        position = len(self._items)
        after = event.previous_item_id
        if after == "root":
            position = 0
        elif after is not None:
            before = self._find_previous(after)
            position = self._items.index(before) + 1
        item = ev.item_from_params(params, item_id)
        previous = self._insert(item, position)
        self._send(ev.item_added(item, previous))
        self._send(ev.item_done(item, previous))

    def _find_previous(self, item_id: str) -> Item:
        try:
            return self._find(item_id)
        except _Refused:
            raise _Refused(
                "item_not_found",
                f"previous_item_id '{item_id[:64]}' names no item in the conversation.",
                "previous_item_id",
            ) from None

    def _truncate(self, event: ev.ItemTruncate) -> None:
        item = self._find(event.item_id)
        if item.role != "assistant":
            raise _Refused("invalid_value", "Only assistant messages can be truncated.", "item_id")
        if item.status == "in_progress":
            raise _Refused(
                "item_in_progress",
                "The item is still being generated: cancel the response first.",
                "item_id",
            )
        index = event.content_index
        if index >= len(item.content) or not item.content[index].is_audio:
            raise _Refused(
                "invalid_value", f"Content part {index} of the item has no audio.", "content_index"
            )
        part = item.content[index]
        total = part.audio_ms
        if event.audio_end_ms > total:
            raise _Refused(
                "invalid_value",
                f"audio_end_ms ({event.audio_end_ms}) is past the end of the item's audio "
                f"({total} ms).",
                "audio_end_ms",
            )
        part.transcript = truncate_transcript(part.transcript or "", event.audio_end_ms, total)
        part.audio = bytes(part.audio[: ms_to_samples(event.audio_end_ms) * BYTES_PER_SAMPLE])
        self._send(ev.item_truncated(item.id, index, event.audio_end_ms))

    def _delete(self, item_id: str) -> None:
        item = self._find(item_id)
        if item.status == "in_progress":
            raise _Refused(
                "item_in_progress",
                "The item is still being generated: cancel the response first.",
                "item_id",
            )
        self._items.remove(item)
        del self._index[item_id]
        self._send(ev.item_deleted(item_id))

    # -- responses --------------------------------------------------------------------------

    def _create_response(self, params: ev.ResponseParams | None) -> None:
        if self._response is not None:
            raise _Refused(
                "conversation_already_has_active_response",
                f"Conversation already has an active response in progress: {self._response.id}. "
                "Wait until the response is finished before creating a new one.",
            )
        self._check_room()
        config = self.config
        given = params.model_fields_set if params else set()
        instructions = params.instructions if params and "instructions" in given else None
        modalities = config.output_modalities
        if params and params.output_modalities is not None:
            modalities = tuple(params.output_modalities)
        max_tokens = config.max_output_tokens
        if params and params.max_output_tokens is not None:
            max_tokens = params.max_output_tokens
        voice = config.voice
        if params and params.audio and params.audio.output and params.audio.output.voice:
            voice = params.audio.output.voice
        if isinstance(voice, dict):
            voice = voice.get("id")
        response_id = self._new_id("resp")
        request = ResponseRequest(
            response_id=response_id,
            items=tuple(item.snapshot() for item in self._items),
            instructions=instructions if instructions is not None else config.instructions,
            output_modalities=modalities,
            voice=voice,
            speed=config.speed,
            max_output_tokens=None if max_tokens == "inf" else int(max_tokens),
            conversation_id=self.conversation_id,
        )
        metadata = params.metadata if params else None
        response = _Response(response_id, request, metadata, max_tokens)
        self._response = response
        self._send(ev.response_created(response.to_json(self.conversation_id)))
        response.task = asyncio.create_task(self._run(response), name=f"realtime {response_id}")

    async def _run(self, response: _Response) -> None:
        stream: AsyncIterator[Delta] | None = None
        try:
            stream = self._responder.respond(response.request)
            async for delta in stream:
                await self.outbox.room()
                self._on_delta(response, delta)
        except asyncio.CancelledError:
            raise  # whoever cancelled ends the response
        except ResponseFailed as exc:
            log.info("realtime: response %s failed: %s", response.id, exc.message)
            error = {"type": exc.type, "code": exc.code, "message": exc.message[:1000]}
            self._finish(response, "failed", {"type": "failed", "error": error})
            return
        except Exception as exc:
            log.exception("realtime: response %s failed", response.id)
            error = {"type": "server_error", "code": "response_failed", "message": str(exc)[:300]}
            self._finish(response, "failed", {"type": "failed", "error": error})
            return
        finally:
            close = getattr(stream, "aclose", None)  # ends the work behind it
            if close is not None:
                with contextlib.suppress(Exception):
                    await close()
        self._finish(response, "completed", None)

    def _on_delta(self, response: _Response, delta: Delta) -> None:
        has_audio = delta.audio is not None and np.size(delta.audio) > 0
        if response.finished or not (delta.text or (has_audio and response.audio_out)):
            return
        if response.item is None:
            self._open_item(response)
        part, ref = response.part, response.ref
        assert part is not None and ref is not None
        if delta.text and response.audio_out:
            part.transcript = (part.transcript or "") + delta.text
            self._send(ev.transcript_delta(ref, delta.text))
        elif delta.text:
            part.text = (part.text or "") + delta.text
            self._send(ev.text_delta(ref, delta.text))
        if has_audio and response.audio_out:
            assert delta.audio is not None
            self._send_audio(response, self._to_wire(response, delta.audio, delta.sample_rate))

    def _open_item(self, response: _Response) -> None:
        """The response's assistant item, added to the conversation as output starts."""
        if response.audio_out:
            part = Part("output_audio", transcript="", audio=bytearray())
        else:
            part = Part("output_text", text="")
        item = Item(self._new_id("item"), "assistant", [], status="in_progress")
        response.item, response.part = item, part
        response.ref = ev.PartRef(response.id, item.id, 0, 0)
        response.previous_item_id = self._insert(item, len(self._items))
        self._send(ev.output_item_added(response.id, 0, item))
        self._send(ev.item_added(item, response.previous_item_id))
        item.content.append(part)
        self._send(ev.content_part_added(response.ref, part))

    def _to_wire(self, response: _Response, audio: np.ndarray, rate: int) -> bytes:
        """float audio at `rate` -> pcm16 at 24 kHz, resampled as one stream per rate."""
        flushed = b""
        if response.resampler is None or response.resampler.src_rate != rate:
            if response.resampler is not None:
                flushed = output_pcm16(response.resampler.flush())
            response.resampler = Resampler(rate, WIRE_RATE)
        return flushed + output_pcm16(response.resampler.process(audio))

    def _send_audio(self, response: _Response, pcm: bytes) -> None:
        part, ref = response.part, response.ref
        assert part is not None and ref is not None and isinstance(part.audio, bytearray)
        part.audio += pcm
        step = ms_to_samples(self.limits.audio_delta_ms) * BYTES_PER_SAMPLE
        for offset in range(0, len(pcm), step):
            piece = pcm[offset : offset + step]
            self._send(ev.audio_delta(ref, piece), partial(self._audio_sent, response, len(piece)))

    @staticmethod
    def _audio_sent(response: _Response, count: int) -> None:
        response.sent_bytes += count

    async def _cancel(self, reason: str) -> None:
        response = self._response
        if response is None:
            return
        task = response.task
        if task is not None and not task.done():
            task.cancel()
            # asyncio.wait, not `await task`: a cancellation of this caller must not be
            # taken for the task's own.
            await asyncio.wait({task})
        self._finish(response, "cancelled", {"type": "cancelled", "reason": reason})

    def _finish(self, response: _Response, status: str, details: dict[str, Any] | None) -> None:
        if response.finished:
            return
        response.finished = True
        if self._response is response:
            self._response = None
        response.status, response.status_details = status, details
        item, part, ref = response.item, response.part, response.ref
        if item is not None and part is not None and ref is not None:
            if status == "completed" and response.resampler is not None:
                tail = output_pcm16(response.resampler.flush())
                if tail:
                    self._send_audio(response, tail)
            if status == "cancelled" and response.audio_out:
                self._keep_what_was_sent(response, part)
            part.audio = bytes(part.audio)
            item.status = "completed" if status == "completed" else "incomplete"
            if response.audio_out:
                self._send(ev.audio_done(ref))
                self._send(ev.transcript_done(ref, part.transcript or ""))
            else:
                self._send(ev.text_done(ref, part.text or ""))
            self._send(ev.content_part_done(ref, part))
            self._send(ev.output_item_done(response.id, 0, item))
            self._send(ev.item_done(item, response.previous_item_id))
            self._keep_audio_bounded()
        self._send(ev.response_done(response.to_json(self.conversation_id)))

    def _keep_what_was_sent(self, response: _Response, part: Part) -> None:
        """A cancelled response's audio: what the transport took, and the transcript cut
        by the same share."""
        self.outbox.drop(
            lambda event: (
                event["type"] in _DROPPED_ON_CANCEL and event.get("response_id") == response.id
            )
        )
        total_ms = part.audio_ms
        kept = min(response.sent_bytes, len(part.audio))
        part.audio = bytes(part.audio[:kept])
        part.transcript = truncate_transcript(part.transcript or "", part.audio_ms, total_ms)

    def _send(self, event: dict[str, Any], on_sent: Callable[[], None] | None = None) -> None:
        self.outbox.put(event, on_sent)
