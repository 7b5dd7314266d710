"""Conversation items of a realtime session and their JSON form (the GA `realtime.item`).

Only `message` items exist here (no function calls: the mesh has no tools). A message has
a role and content parts:
- system: `input_text`;
- user: `input_text`, `input_audio` (pcm16 24 kHz bytes, transcript null: the gateway does
  not transcribe input);
- assistant: `output_text`, or `output_audio` with its transcript.

Audio is kept as pcm16 bytes. Item JSON leaves the audio out unless asked for
(`conversation.item.retrieve` asks), as the API does in `conversation.item.added/done`.
"""

from __future__ import annotations

import base64
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from omnirail.gateway.realtime.audio import BYTES_PER_SAMPLE, WIRE_RATE

Role = Literal["system", "user", "assistant"]
PartType = Literal["input_text", "input_audio", "output_text", "output_audio"]
Status = Literal["completed", "incomplete", "in_progress"]


@dataclass
class Part:
    """One content part. `audio` is pcm16 mono 24 kHz (bytes; a bytearray while an
    assistant's audio is still being made)."""

    type: PartType
    text: str | None = None  # input_text, output_text
    transcript: str | None = None  # input_audio (None), output_audio
    audio: bytes | bytearray = b""

    @property
    def is_audio(self) -> bool:
        return self.type in ("input_audio", "output_audio")

    @property
    def audio_ms(self) -> int:
        return len(self.audio) // BYTES_PER_SAMPLE * 1000 // WIRE_RATE

    def to_json(self, include_audio: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.is_audio:
            if include_audio:
                out["audio"] = base64.b64encode(self.audio).decode("ascii")
            out["transcript"] = self.transcript
        else:
            out["text"] = self.text or ""
        return out


@dataclass
class Item:
    """A message in the conversation."""

    id: str
    role: Role
    content: list[Part] = field(default_factory=list)
    status: Status = "completed"

    def to_json(self, include_audio: bool = False) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "realtime.item",
            "type": "message",
            "status": self.status,
            "role": self.role,
            "content": [part.to_json(include_audio) for part in self.content],
        }

    def snapshot(self) -> Item:
        """A copy whose parts later edits (truncation) do not change; audio is copied only
        when it is still a bytearray."""
        parts = [dataclasses.replace(p, audio=bytes(p.audio)) for p in self.content]
        return Item(self.id, self.role, parts, self.status)

    @property
    def audio_bytes(self) -> int:
        return sum(len(p.audio) for p in self.content)


def truncate_transcript(transcript: str, kept_ms: int, total_ms: int) -> str:
    """The transcript of the first `kept_ms` of `total_ms` of speech.

    The rule: the share of characters equal to the share of audio kept, cut back to the
    last whole word (a word cut in the middle was not heard whole). Speech runs at a
    roughly even rate of characters, so this keeps about what was heard; the API instead
    drops the whole transcript, which would leave the mesh's text-history models with no
    record of what the user did hear.
    """
    if total_ms <= 0 or kept_ms >= total_ms:
        return transcript
    if kept_ms <= 0:
        return ""
    cut = len(transcript) * kept_ms // total_ms
    if cut < len(transcript) and not transcript[cut].isspace():
        space = transcript.rfind(" ", 0, cut + 1)
        cut = space if space >= 0 else 0
    return transcript[:cut].rstrip()
