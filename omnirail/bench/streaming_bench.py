"""`omnirail bench streaming`: time to first chunk and total time of a streamed request.

A producer emits `chunks` chunks `interval_ms` apart (one decode step each); two more
stages forward every chunk as it arrives; the last streams them to the client. Each run
is one request on a warm mesh; the report gives the median run and every run, and how
long an aborted stream takes to end at the client.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from omnirail.bench import pipeline_file

# Chain of three streaming stages: producer -> relay -> sink -> client.
_STAGES = ("producer", "relay", "sink")


def streaming_yaml(chunks: int, interval_ms: float) -> dict[str, Any]:
    factories = {
        "producer": (
            "omnirail.bench.stages:stream_producer",
            {"chunks": chunks, "interval_ms": interval_ms},
        ),
        "relay": ("omnirail.bench.stages:stream_forward", {}),
        "sink": ("omnirail.bench.stages:stream_forward", {}),
    }
    specs = []
    for i, name in enumerate(_STAGES):
        factory, args = factories[name]
        spec: dict[str, Any] = {
            "name": name,
            "factory": factory,
            "factory_args": args,
            "terminal": True,
            "torch_threads": 1,
            "retry_safe": True,  # no side effects: a lost replica's requests run again
        }
        if i + 1 < len(_STAGES):
            spec["stream_to"] = [_STAGES[i + 1]]
        specs.append(spec)
    return {"name": "bench-streaming", "stages": specs}


def _one(client: Any, chunks: int) -> tuple[float, float, int]:
    from omnirail.client.sdk import Chunk

    t0 = time.perf_counter()
    first = None
    seen = 0
    for event in client.stream({"chunks": chunks}):
        if isinstance(event, Chunk):
            if first is None:
                first = time.perf_counter()
            if event.chunk_id != seen:
                raise RuntimeError(f"chunk {event.chunk_id} arrived when {seen} was due")
            seen += 1
    total = time.perf_counter() - t0
    if first is None or seen != chunks:
        raise RuntimeError(f"{seen} of {chunks} chunks arrived")
    return (first - t0) * 1000, total * 1000, seen


def _abort_latency(client: Any, rid: str) -> float:
    """Starts a long stream, aborts it after its first chunk; ms until the stream ends."""
    from omnirail.client.sdk import Chunk
    from omnirail.wire.errors import Code, OmniError

    events = client.stream({"chunks": 100_000}, request_id=rid)
    if not isinstance(next(events), Chunk):
        raise RuntimeError("the stream ended before its first chunk")
    ended: list[float] = []

    def read() -> None:
        try:
            for _ in events:
                pass
        except OmniError as exc:
            if exc.code == Code.CANCELLED:
                ended.append(time.perf_counter())

    reader = threading.Thread(target=read)
    reader.start()
    t0 = time.perf_counter()
    client.abort(rid, "benchmark")
    reader.join(30)
    if not ended:
        raise RuntimeError("the aborted stream did not end with CANCELLED")
    return (ended[0] - t0) * 1000


def run_streaming_bench(
    *,
    chunks: int = 50,
    interval_ms: float = 10.0,
    runs: int = 5,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    from omnirail.client.sdk import Client
    from omnirail.ops.launcher import Mesh

    with pipeline_file(streaming_yaml(chunks, interval_ms)) as path:
        with Mesh(path, progress=progress) as mesh:
            assert mesh.address is not None
            with Client(mesh.address, timeout=60) as client:
                _one(client, min(chunks, 5))  # warm channels, pools and code paths
                samples = [_one(client, chunks) for _ in range(runs)]
                aborts = [_abort_latency(client, f"bench-abort-{i}") for i in range(runs)]
    ttfc = [s[0] for s in samples]
    total = [s[1] for s in samples]
    return {
        "stages": len(_STAGES),
        "chunks": chunks,
        "interval_ms": interval_ms,
        "runs": runs,
        "ttfc_ms": round(statistics.median(ttfc), 2),
        "total_ms": round(statistics.median(total), 2),
        "ttfc_ms_runs": [round(x, 2) for x in ttfc],
        "total_ms_runs": [round(x, 2) for x in total],
        "ideal_total_ms": chunks * interval_ms,
        # Abort RPC sent mid-stream -> the client's stream ends with CANCELLED.
        "abort_to_cancelled_ms": round(statistics.median(aborts), 2),
        "abort_to_cancelled_ms_runs": [round(x, 2) for x in aborts],
    }
