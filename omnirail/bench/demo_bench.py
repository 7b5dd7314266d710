"""`omnirail bench demo`: time to first audio and real-time factor of a speech pipeline.

Streams the same request `runs` times (after one warm-up) through a pipeline whose
terminal stages stream "text" and "audio" chunks (`examples/omni_demo` by default), either
on a mesh it starts itself or on a running one (`--address`, e.g. a compose deployment),
and reports per run: time to the first text and first audio chunk, total time, seconds of
audio, and the real-time factor (total time / audio seconds; below 1 is faster than real
time). With `concurrency > 1` that many streams run at once, each run timed on its own.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEMO = Path(__file__).resolve().parents[2] / "examples" / "omni_demo" / "pipeline.yaml"
DEFAULT_INPUT: dict[str, Any] = {
    "text": "Tell me a story about a river and a mountain.",
    "max_new_tokens": 24,
    "seed": 1,
}


def _audio_seconds(data: Any) -> float:
    from omnirail.client.render import pcm_of

    pcm, rate = pcm_of(data)
    return pcm.shape[-1] / rate


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
    total_ms = (time.perf_counter() - t0) * 1000
    if "audio" not in first:
        raise RuntimeError("the request streamed no audio chunk")
    return {
        "ttft_ms": first.get("text", float("nan")),
        "ttfa_ms": first["audio"],
        "total_ms": total_ms,
        "audio_s": audio_s,
        "rtf": total_ms / 1000 / audio_s,
    }


def _batch(client: Any, inputs: dict[str, Any], concurrency: int) -> list[dict[str, float]]:
    if concurrency == 1:
        return [_one(client, inputs)]
    out: list[dict[str, float]] = []
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out.append(_one(client, {**inputs, "seed": int(inputs.get("seed", 0)) + i}))
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
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    from omnirail.client.sdk import Client
    from omnirail.ops.launcher import Mesh

    if runs < 1 or concurrency < 1:
        raise ValueError("runs and concurrency must be at least 1")
    inputs = dict(inputs or DEFAULT_INPUT)

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
    }
    for key in ("ttft_ms", "ttfa_ms", "total_ms", "audio_s", "rtf"):
        values = [s[key] for s in samples]
        report[key] = round(statistics.median(values), 3)
        report[f"{key}_runs"] = [round(v, 3) for v in values]
    return report
