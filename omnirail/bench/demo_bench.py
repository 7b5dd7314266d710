"""`omnirail bench demo`: time to first audio and real-time factor of a speech pipeline.

Streams the same request `runs` times (after one warm-up) through a pipeline whose
terminal stages stream "text" and "audio" chunks (the installed omni demo,
`omnirail.models.omni_demo`, by default), either on a mesh it starts itself or on a running
one (`--address`, e.g. a compose deployment), and reports per run: time to the first text
and first audio chunk, total time, seconds of audio, and the real-time factor (total time
/ audio seconds; below 1 is faster than real time). With `concurrency > 1` that many
streams run at once, each run timed on its own.

`via="http"` measures the OpenAI gateway against the native gRPC SDK in one run: the mesh
starts with `--http`, and each run streams the same request both ways (a chat completion
with audio over SSE, and the SDK's stream), alternating which goes first, so the report's
`http_overhead_ms` (the medians' differences) is what the gateway adds to time to first
text and first audio.
"""

from __future__ import annotations

import base64
import json
import socket
import statistics
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any

from omnirail.models.omni_demo import pipeline_file

# The installed omni demo's pipeline file (package data: runs from a wheel).
DEMO = pipeline_file()
DEFAULT_INPUT: dict[str, Any] = {
    "text": "Tell me a story about a river and a mountain.",
    "max_new_tokens": 24,
    "seed": 1,
}


def _audio_seconds(data: Any) -> float:
    from omnirail.client.render import pcm_of

    pcm, rate = pcm_of(data)
    return pcm.shape[-1] / rate


def _figures(t0: float, first: dict[str, float], audio_s: float, none: str) -> dict[str, float]:
    """One streamed request's figures from its start, first chunks (ms) and audio."""
    total_ms = (time.perf_counter() - t0) * 1000
    if "audio" not in first:
        raise RuntimeError(none)
    return {
        "ttft_ms": first.get("text", float("nan")),
        "ttfa_ms": first["audio"],
        "total_ms": total_ms,
        "audio_s": audio_s,
        "rtf": total_ms / 1000 / audio_s,
    }


def _one(client: Any, inputs: dict[str, Any]) -> dict[str, float]:
    from omnirail.client.sdk import Chunk

    t0 = time.perf_counter()
    first: dict[str, float] = {}
    audio_s = 0.0
    for event in client.stream(inputs):
        if not isinstance(event, Chunk):
            break
        first.setdefault(event.modality, (time.perf_counter() - t0) * 1000)
        if event.modality == "audio":
            audio_s += _audio_seconds(event.data)
    return _figures(t0, first, audio_s, "the request streamed no audio chunk")


def chat_body(inputs: dict[str, Any], model: str) -> dict[str, Any]:
    """The OpenAI chat request equal to the omni demo's `inputs` (text in, text and PCM out)."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": inputs["text"]}],
        "modalities": ["text", "audio"],
        "audio": {"voice": "default", "format": "pcm16"},
        "stream": True,
    }
    if "max_new_tokens" in inputs:
        body["max_tokens"] = inputs["max_new_tokens"]
    if "seed" in inputs:
        body["seed"] = inputs["seed"]
    return body


class HttpStreams:
    """Keep-alive HTTP/1.1 connections to the gateway, one per stream in flight (as the SDK
    keeps one channel), read by a minimal chunked-transfer reader over a raw socket: the
    figure is meant to be the gateway's, and a client library's header parsing (http.client
    parses them with the email package) would land on the time to first chunk too."""

    def __init__(self, base_url: str, path: str) -> None:
        parts = urllib.parse.urlsplit(base_url)
        self.host, self.port, self.path = parts.hostname or "", parts.port or 80, path
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()

    def _connection(self) -> socket.socket:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        sock = socket.create_connection((self.host, self.port), timeout=120)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def lines(self, body: dict[str, Any]) -> Iterator[bytes]:
        """The response body's lines as they arrive; raises for a status other than 200."""
        sock = self._connection()
        data = json.dumps(body).encode()
        sock.sendall(
            f"POST {self.path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        buf = bytearray()

        def need(n: int) -> None:
            while len(buf) < n:
                piece = sock.recv(1 << 16)
                if not piece:
                    raise RuntimeError("the gateway closed the connection mid-answer")
                buf.extend(piece)

        while (end := buf.find(b"\r\n\r\n")) < 0:
            need(len(buf) + 1)
        head = bytes(buf[:end]).lower()
        del buf[: end + 4]
        status = int(head.split(b" ", 2)[1])
        if status != 200 or b"transfer-encoding: chunked" not in head:
            raise RuntimeError(f"gateway answered {status}: {head[:200]!r} {bytes(buf[:300])!r}")
        text = b""
        while True:
            while (eol := buf.find(b"\r\n")) < 0:
                need(len(buf) + 1)
            size = int(bytes(buf[:eol]).split(b";")[0], 16)
            del buf[: eol + 2]
            need(size + 2)
            if size == 0:
                del buf[:2]
                break
            text += bytes(buf[:size])
            del buf[: size + 2]
            *whole, text = text.split(b"\n")
            yield from whole
        with self._lock:
            self._idle.append(sock)

    def close(self) -> None:
        for sock in self._idle:
            sock.close()


def _one_http(http: HttpStreams, body: dict[str, Any], rate: int) -> dict[str, float]:
    """`_one` over the gateway: first text and first audio are the first SSE deltas that
    carry them (the role-only preamble does not count)."""
    t0 = time.perf_counter()
    first: dict[str, float] = {}
    audio_s = 0.0
    for line in http.lines(body):
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            raise RuntimeError(f"gateway stream failed: {event['error']}")
        delta = event["choices"][0]["delta"]
        if delta.get("content"):
            first.setdefault("text", (time.perf_counter() - t0) * 1000)
        if delta.get("audio"):
            first.setdefault("audio", (time.perf_counter() - t0) * 1000)
            audio_s += len(base64.b64decode(delta["audio"]["data"])) / 2 / rate
    return _figures(t0, first, audio_s, "the gateway streamed no audio")


def _batch(
    client: Any, inputs: dict[str, Any], concurrency: int, one: Callable[..., Any] | None = None
) -> list[dict[str, float]]:
    one = one or _one
    if concurrency == 1:
        return [one(client, inputs)]
    out: list[dict[str, float]] = []
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out.append(one(client, {**inputs, "seed": int(inputs.get("seed", 0)) + i}))
        except BaseException as exc:  # reported below, in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def run_demo_bench(
    *,
    address: str | None = None,
    pipeline: str | None = None,
    inputs: dict[str, Any] | None = None,
    runs: int = 5,
    concurrency: int = 1,
    via: str = "grpc",
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    from omnirail.client.sdk import Client
    from omnirail.ops.launcher import Mesh

    if runs < 1 or concurrency < 1:
        raise ValueError("runs and concurrency must be at least 1")
    if via not in ("grpc", "http"):
        raise ValueError(f"via must be 'grpc' or 'http', not {via!r}")
    inputs = dict(inputs or DEFAULT_INPUT)
    if via == "http":
        if address is not None:
            raise ValueError("--via http starts its own mesh and gateway; drop --address")
        return _http_vs_grpc(pipeline, inputs, runs, concurrency, progress)

    def measure(addr: str) -> list[dict[str, float]]:
        # numpy: the timing must not include importing torch in this process.
        with Client(addr, timeout=120, tensors="numpy") as client:
            _one(client, inputs)  # warm channels, pools and code paths
            samples: list[dict[str, float]] = []
            for _ in range(runs):
                samples.extend(_batch(client, inputs, concurrency))
            return samples

    if address is not None:
        samples = measure(address)
        where = address
    else:
        with Mesh(pipeline or DEMO, progress=progress) as mesh:
            assert mesh.address is not None
            samples = measure(mesh.address)
        where = "local processes"
    report: dict[str, Any] = {
        "mesh": where,
        "pipeline": str(pipeline or DEMO) if address is None else None,
        "runs": runs,
        "concurrency": concurrency,
        **_summary(samples),
    }
    return report


def _summary(samples: list[dict[str, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("ttft_ms", "ttfa_ms", "total_ms", "audio_s", "rtf"):
        values = [s[key] for s in samples]
        out[key] = round(statistics.median(values), 3)
        out[f"{key}_runs"] = [round(v, 3) for v in values]
    return out


def _http_vs_grpc(
    pipeline: str | None,
    inputs: dict[str, Any],
    runs: int,
    concurrency: int,
    progress: Callable[[str], None] | None,
) -> dict[str, Any]:
    from omnirail.client.sdk import Client
    from omnirail.ops.launcher import Mesh

    with Mesh(pipeline or DEMO, progress=progress, http="127.0.0.1:0") as mesh:
        assert mesh.address is not None and mesh.http_address is not None
        oa = mesh.pipeline.api.openai
        assert oa is not None  # Mesh refuses --http without it
        model = mesh.pipeline.model_name
        http = HttpStreams(mesh.http_address, "/v1/chat/completions")
        with Client(mesh.address, timeout=120, tensors="numpy") as client:

            def over_http(_: Any, request: dict[str, Any]) -> dict[str, float]:
                return _one_http(http, chat_body(request, model), oa.sample_rate)

            sides: dict[str, tuple[Any, Callable[..., Any]]] = {
                "grpc": (client, _one),
                "http": (None, over_http),
            }
            for target, one in sides.values():  # warm both paths
                one(target, inputs)
            samples: dict[str, list[dict[str, float]]] = {"grpc": [], "http": []}
            for r in range(runs):
                order = ["grpc", "http"] if r % 2 == 0 else ["http", "grpc"]
                for side in order:
                    target, one = sides[side]
                    samples[side].extend(_batch(target, inputs, concurrency, one))
        http.close()
    report: dict[str, Any] = {
        "mesh": "local processes",
        "pipeline": str(pipeline or DEMO),
        "via": "http",
        "runs": runs,
        "concurrency": concurrency,
        "grpc": _summary(samples["grpc"]),
        "http": _summary(samples["http"]),
    }
    # Each run's HTTP figure minus the gRPC figure of the same run (they ran back to back),
    # then the median: steadier than the difference of the medians on a noisy host.
    report["http_overhead_ms"] = {
        key: round(
            statistics.median(
                h[f"{key}_ms"] - g[f"{key}_ms"]
                for h, g in zip(samples["http"], samples["grpc"], strict=True)
            ),
            3,
        )
        for key in ("ttft", "ttfa")
    }
    report["http_overhead_of_medians_ms"] = {
        key: round(report["http"][f"{key}_ms"] - report["grpc"][f"{key}_ms"], 3)
        for key in ("ttft", "ttfa")
    }
    return report
