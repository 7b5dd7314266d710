"""`omnirail bench realtime`: spoken conversations over the gateway's `/v1/realtime`.

A mesh of the installed Qwen3-Omni pipeline (a random checkpoint made on the spot, or
`--model-path`) with the OpenAI gateway; at each level, N WebSocket sessions speak a
multi-turn conversation at once, as a voice client does: synthetic speech
(`omnirail.testing.speech`) in 40 ms `input_audio_buffer.append` chunks at real-time pace,
then silence until the answer has ended; the server's VAD ends each turn and answers. The
turns run in lockstep across sessions (a barrier between turns), so the thinker's
conversation counters, read from every thinker replica between turns, say what each turn
index computed. In the last turn every session speaks again as soon as the answer's first
audio arrives (barge-in).

Per level: time from the end of speech (the last speech chunk sent) and from the server's
`speech_stopped` to the first audio delta (p50/p99); barge-in time from the barge-in
speech's first chunk to the cancelled `response.done`, and to the old answer's last audio
delta; prefill and reused tokens per turn (mean over sessions: they must not grow with the
history when state is kept); the mesh's memory per session (RSS of every process, and the
thinker's kept state); CPU seconds per turn over every process of the mesh.
"""

from __future__ import annotations

import asyncio
import base64
import json
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from omnirail.bench import cpu_seconds, rss_kib

CHUNK_MS = 40
RATE = 24_000
SPEECH_S = 1.2
BARGE_S = 0.8


@dataclass
class _Turn:
    speech_end: float = 0.0  # last speech chunk sent (monotonic)
    stopped: float = 0.0  # speech_stopped received
    first_audio: float = 0.0
    done: float = 0.0
    status: str = ""
    audio_bytes: int = 0
    # Barge-in: its first speech chunk sent, the old answer's cancelled end and last audio.
    barge_sent: float = 0.0
    barge_done: float = 0.0
    last_audio: float = 0.0


@dataclass
class _Session:
    index: int
    turns: list[_Turn] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _pcm16(samples: np.ndarray) -> bytes:
    return (np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()


def _chunks(samples: np.ndarray) -> list[str]:
    step = RATE * CHUNK_MS // 1000
    raw = _pcm16(samples)
    return [
        base64.b64encode(raw[i * 2 : (i + step) * 2]).decode() for i in range(0, len(samples), step)
    ]


async def _speak(ws: Any, chunks: list[str], pace: bool = True) -> None:
    for chunk in chunks:
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
        if pace:
            await asyncio.sleep(CHUNK_MS / 1000)


async def _session(
    url: str, model: str, index: int, turns: int, barrier: asyncio.Barrier, between: Callable
) -> _Session:
    import websockets

    from omnirail.testing.speech import silence, speech

    out = _Session(index)
    quiet = _chunks(silence(CHUNK_MS / 1000, RATE))[0]
    async with websockets.connect(f"{url}?model={model}", max_size=None) as ws:
        events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

        async def read() -> None:
            async for frame in ws:
                events.put_nowait(json.loads(frame))

        reader = asyncio.get_running_loop().create_task(read())
        try:
            first = await asyncio.wait_for(events.get(), 30)
            if first.get("type") != "session.created":
                raise RuntimeError(f"session {index}: first event {first}")
            for t in range(turns):
                await barrier.wait()
                await between(t)
                turn = _Turn()
                out.turns.append(turn)
                await _speak(ws, _chunks(speech(SPEECH_S, RATE, seed=1000 * index + t)))
                turn.speech_end = time.monotonic()
                barge = t == turns - 1
                await _answer(ws, events, turn, quiet, barge, 1000 * index + 99)
            await barrier.wait()
            await between(turns)
        finally:
            reader.cancel()
    return out


async def _answer(
    ws: Any,
    events: asyncio.Queue[dict[str, Any]],
    turn: _Turn,
    quiet: str,
    barge: bool,
    seed: int,
) -> None:
    """Silence (a live microphone) until this turn's answer ends; with `barge`, speech again
    as soon as its first audio arrives, and on until the next turn's answer ends too."""
    from omnirail.testing.speech import speech

    sender: asyncio.Task[None] | None = None
    loop = asyncio.get_running_loop()

    async def silence_forever() -> None:
        while True:
            await _speak(ws, [quiet])

    sender = loop.create_task(silence_forever())
    deadline = time.monotonic() + 120
    answers = 0
    try:
        while True:
            event = await asyncio.wait_for(events.get(), max(0.1, deadline - time.monotonic()))
            kind = event.get("type", "")
            now = time.monotonic()
            if kind == "input_audio_buffer.speech_stopped" and not turn.stopped:
                turn.stopped = now
            elif kind == "response.output_audio.delta":
                if answers == 0:  # the old answer's, not the barge-in's own
                    turn.last_audio = now
                if not turn.first_audio:
                    turn.first_audio = now
                    if barge and not turn.barge_sent:
                        sender.cancel()
                        turn.barge_sent = time.monotonic()
                        sender = loop.create_task(
                            _speak(ws, _chunks(speech(BARGE_S, RATE, seed=seed)))
                        )
                if answers == 0:
                    turn.audio_bytes += len(base64.b64decode(event.get("delta", "")))
            elif kind == "response.done":
                answers += 1
                status = event.get("response", {}).get("status", "")
                if answers == 1:
                    turn.done, turn.status = now, status
                    if not barge or status != "cancelled":
                        return
                    turn.barge_done = now
                    await sender  # the barge-in speech to its end, then silence
                    sender = loop.create_task(silence_forever())
                else:
                    return  # the barge-in turn's own answer
            elif kind == "error":
                raise RuntimeError(f"server error: {event.get('error')}")
    finally:
        sender.cancel()


def _figures(client: Any) -> dict[str, float]:
    """The thinker replicas' conversation counters, summed."""
    out: dict[str, float] = {}
    info = next(s for s in client.describe().stages if s.name == "thinker")
    for replica in info.replicas:
        if not replica.metrics_address:
            continue
        text = (
            urllib.request.urlopen(f"http://{replica.metrics_address}/metrics", timeout=10)
            .read()
            .decode()
        )
        for line in text.splitlines():
            for name in ("prefill_tokens_total", "reused_tokens_total", "state_bytes"):
                if line.startswith(f"omnirail_conversation_{name}{{"):
                    out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _pct(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"p50": round(statistics.median(ordered), 1), "p99": round(p99, 1), "n": len(ordered)}


def _level(
    url: str, model: str, client: Any, pids: dict[str, int], sessions: int, turns: int
) -> dict[str, Any]:
    counters: list[dict[str, float]] = []
    rss: list[int] = []

    def snapshot() -> None:
        counters.append(_figures(client))
        rss.append(sum(rss_kib(pid) or 0 for pid in pids.values()))

    cpu0 = sum(cpu_seconds(pid) or 0.0 for pid in pids.values())

    async def run() -> list[_Session]:
        barrier = asyncio.Barrier(sessions)
        lock = asyncio.Lock()
        taken: set[int] = set()

        async def between(t: int) -> None:
            async with lock:  # once per turn, by whichever session gets here first
                if t not in taken:
                    taken.add(t)
                    await asyncio.to_thread(snapshot)

        return await asyncio.gather(
            *(_session(url, model, i, turns, barrier, between) for i in range(sessions))
        )

    results = asyncio.run(run())
    cpu = sum(cpu_seconds(pid) or 0.0 for pid in pids.values()) - cpu0
    done = [t for s in results for t in s.turns]
    per_turn = []
    for t in range(turns):  # the last turn's figures include its barge-in's own answer
        before, after = counters[t], counters[t + 1]
        per_turn.append(
            {
                "turn": t + 1,
                "prefill_tokens": round(
                    (after.get("prefill_tokens_total", 0) - before.get("prefill_tokens_total", 0))
                    / sessions,
                    1,
                ),
                "reused_tokens": round(
                    (after.get("reused_tokens_total", 0) - before.get("reused_tokens_total", 0))
                    / sessions,
                    1,
                ),
            }
        )
    barged = [t for t in done if t.barge_sent]
    cancelled = [t for t in barged if t.barge_done]
    ms = 1000.0
    return {
        "sessions": sessions,
        "turns": turns,
        "end_of_speech_to_first_audio_ms": _pct(
            [(t.first_audio - t.speech_end) * ms for t in done if t.first_audio]
        ),
        "speech_stopped_to_first_audio_ms": _pct(
            [(t.first_audio - t.stopped) * ms for t in done if t.first_audio and t.stopped]
        ),
        "barge_in_to_cancelled_ms": _pct([(t.barge_done - t.barge_sent) * ms for t in cancelled]),
        "barge_in_to_last_old_audio_ms": _pct(
            [max(0.0, t.last_audio - t.barge_sent) * ms for t in cancelled]
        ),
        "barge_ins": {"tried": len(barged), "cancelled": len(cancelled)},
        "per_turn": per_turn,
        "memory_per_session_mb": round((rss[-1] - rss[0]) / 1024 / sessions, 1),
        "kept_state_per_session_mb": round(
            counters[-1].get("state_bytes", 0) / 2**20 / sessions, 2
        ),
        "cpu_s_per_turn": round(cpu / max(1, len(done)), 3),
    }


def run_realtime_bench(
    *,
    model_path: str | None = None,
    sessions: Sequence[int] = (1, 8),
    turns: int = 3,
    max_new_tokens: int = 16,
    talker_max_new_tokens: int = 64,
    size: str = "tiny",
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """One mesh with the gateway; each level of `sessions` speaks `turns` turns at once."""
    from omnirail.bench.omni_bench import checkpoint, write_pipeline
    from omnirail.client.sdk import Client
    from omnirail.ops.launcher import Mesh

    say = progress or (lambda msg: None)
    levels = list(dict.fromkeys(sessions))
    if not levels or min(levels) < 1 or turns < 2:
        raise ValueError("sessions must be at least 1 and turns at least 2")
    with tempfile.TemporaryDirectory(prefix="omnirail-bench-realtime-") as tmp:
        path = checkpoint(tmp, model_path, size, say)
        pipeline = write_pipeline(
            Path(tmp) / "pipeline", path, max_new_tokens, talker_max_new_tokens
        )
        say("starting the mesh with the gateway")
        mesh = Mesh(pipeline, progress=progress, env={"HF_HUB_OFFLINE": "1"}, http="127.0.0.1:0")
        try:
            mesh.start(timeout=600)
            assert mesh.address is not None and mesh.http_address is not None
            url = mesh.http_address.replace("http://", "ws://").rstrip("/") + "/v1/realtime"
            model = mesh.pipeline.model_name
            report_levels = []
            with Client(mesh.address, timeout=60) as client:
                for n in levels:
                    say(f"{n} sessions x {turns} turns")
                    report_levels.append(_level(url, model, client, mesh.processes(), n, turns))
        finally:
            mesh.stop()
    return {
        "model": size if model_path is None else path,
        "pipeline": "qwen3-omni (installed), native thinker",
        "speech_s": SPEECH_S,
        "chunk_ms": CHUNK_MS,
        "max_new_tokens": max_new_tokens,
        "talker_max_new_tokens": talker_max_new_tokens,
        "levels": report_levels,
    }
