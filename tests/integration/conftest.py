"""Integration fixtures: real meshes (coordinator + one process per stage group)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from omnirail.client.sdk import Chunk, Client, GenerateResult
from omnirail.ops.launcher import Mesh
from omnirail.testing.local_mesh import LocalMesh
from omnirail.wire.errors import Code, OmniError

REPO = Path(__file__).resolve().parents[2]
PIPELINES = Path(__file__).parent / "pipelines"
MESH_TIMEOUT = 240  # commands that start a mesh


def omnirail(*args: str, timeout: float = MESH_TIMEOUT) -> subprocess.CompletedProcess[str]:
    """The `omnirail` command line, run from the repository (as a user would)."""
    return subprocess.run(
        [sys.executable, "-m", "omnirail", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def explain(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


def generate_when_back(client: Client, mesh: Mesh, deadline: float) -> dict[str, Any]:
    """`{"n": 4}` through a mesh whose stage is restarting: retried while it answers
    UNAVAILABLE (not registered again yet), until `deadline` (monotonic)."""
    while True:
        try:
            return client.generate({"n": 4}, timeout=10).output
        except OmniError as exc:
            assert exc.code == Code.UNAVAILABLE, exc
            assert time.monotonic() < deadline, mesh.log_tails()
            time.sleep(0.2)


def shm_names(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix + "-"))


def collect_stream(events: Iterable[Any]) -> tuple[list[Chunk], GenerateResult]:
    """A stream's chunks in arrival order, and its result."""
    chunks: list[Chunk] = []
    for event in events:
        if isinstance(event, Chunk):
            chunks.append(event)
        else:
            return chunks, event
    raise AssertionError("stream ended without a result")


def read_openai_stream(stream: Iterable[Any]) -> tuple[str, bytes]:
    """A streamed chat completion from the `openai` SDK: its text, and its audio's bytes
    (the base64 `audio.data` of each delta, decoded)."""
    pieces, audio = [], bytearray()
    for chunk in stream:
        text, data = delta_pieces(chunk)
        pieces.append(text)
        audio += data
    return "".join(pieces), bytes(audio)


def delta_pieces(chunk: Any) -> tuple[str, bytes]:
    """One streamed chat completion chunk's text and audio bytes (its base64 `audio.data`)."""
    import base64

    delta = chunk.choices[0].delta
    extra = (delta.model_extra or {}).get("audio") or getattr(delta, "audio", None)
    audio = b""
    if extra:
        audio = base64.b64decode(extra["data"] if isinstance(extra, dict) else extra.data)
    return delta.content or "", audio


# Prometheus samples by (name, sorted labels).
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(address: str) -> Samples:
    """Every sample a `/metrics` endpoint (host:port) serves now."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def wait_nothing_in_flight(client: Client, timeout: float = 15.0) -> None:
    """Until no stage replica reports a request in flight (loads refresh every moment)."""
    deadline = time.monotonic() + timeout
    while busy := [
        (s.name, r.inflight) for s in client.describe().stages for r in s.replicas if r.inflight
    ]:
        assert time.monotonic() < deadline, busy
        time.sleep(0.2)


def start_mesh(name: str, **kwargs: object) -> Mesh:
    mesh = Mesh(PIPELINES / f"{name}.yaml", **kwargs)  # type: ignore[arg-type]
    mesh.start(timeout=240)
    return mesh


def start_local(name: str) -> LocalMesh:
    """Pipeline `name` of tests/integration/pipelines in this process (no process
    boundary): for tests of a pipeline's behaviour, not of processes."""
    mesh = LocalMesh(PIPELINES / f"{name}.yaml")
    mesh.start()
    return mesh


@pytest.fixture(scope="module")
def linear_mesh() -> Iterator[LocalMesh]:
    mesh = start_local("linear")
    yield mesh
    mesh.stop()
    assert shm_names(mesh.shm_prefix) == [], "shared memory left after shutdown"


def omni_demo_answer(address: str, inputs: dict[str, Any]) -> tuple[str, np.ndarray]:
    """The omni demo's text and audio (code2wav's PCM, joined) for `inputs`, through the
    native SDK: what the front doors' answers are compared with."""
    audio: list[np.ndarray] = []
    text = ""
    with Client(address, timeout=60, tensors="numpy") as client:
        for event in client.stream(inputs):
            if isinstance(event, Chunk):
                if event.stage == "code2wav":
                    audio.append(np.asarray(event.data["pcm"]))
            else:
                text = event.outputs["decode"]["text"]
    return text, np.concatenate(audio) if audio else np.zeros(0, np.float32)
