"""`omnirail bench llm`: text requests through a mesh's vLLM stage against the same vLLM engine
driven directly in one process, interleaved in one run.

Both sides run the same engine options on the same model directory (a tiny random Qwen3 made
on the spot unless `--model-path` names one): `direct` is vLLM's `LLMEngine` stepped by a plain
loop on its own thread in this process, requests added as others finish (closed loop at each
concurrency); `mesh` is a pipeline whose one stage is `omnirail.engines.vllm:create_llm`,
streamed to by the SDK at the same concurrency. Every request asks for the same number of new
tokens (`ignore_eos`), so tokens/s compare like for like. Rounds alternate direct, mesh,
direct, mesh... and each figure is the median over rounds.

Per mode and concurrency: output tokens/s, time to first token (p50, ms: to the first token
out of the engine for direct, to the first chunk at the client for the mesh) and CPU seconds
per request (this process for direct; the mesh's processes with their children, and this
client's, for the mesh).
`mesh_vs_direct` gives the tokens/s ratio and the milliseconds the mesh adds to first token:
the aim is a ratio of at least 0.9 at concurrency 8 and at most 5 ms added.
"""

from __future__ import annotations

import os
import queue
import resource
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omnirail.bench import cpu_seconds, pipeline_file

PROMPT = "Good morning, good night, yes, no, maybe, thanks, please, sorry, welcome."


def _tree_cpu(pid: int) -> float:
    """CPU seconds of `pid` and every live process below it (a stage's vLLM engine core
    runs in a child process with `engine_process`)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += cpu_seconds(p) or 0.0
        todo.extend(children.get(p, []))
    return total


def _self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class DirectEngine:
    """vLLM's `LLMEngine` on its own thread (vLLM binds the threads of the thread that builds
    it), running batches of requests in a closed loop."""

    def __init__(self, model_path: str, engine: dict[str, Any]) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._main, args=(model_path, engine), name="direct-vllm", daemon=True
        )
        self._thread.start()
        ok, error = self._done.get()
        if not ok:
            raise RuntimeError(f"direct engine did not start: {error}")

    def _main(self, model_path: str, engine: dict[str, Any]) -> None:
        try:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            # vLLM logs to stdout by default: the bench's stdout is its JSON report.
            os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
            from vllm.engine.arg_utils import EngineArgs
            from vllm.v1.engine.llm_engine import LLMEngine

            from omnirail.engines.vllm.options import EngineOptions

            # The stage's own arguments (max_unsent) are not the engine's.
            fields = EngineOptions.model_fields
            options = EngineOptions.parse(
                "direct", {k: v for k, v in engine.items() if k in fields}
            )
            self.engine = LLMEngine.from_engine_args(
                EngineArgs(**options.engine_args(model_path, "cpu"))
            )
        except Exception as exc:  # reported to the constructor's caller
            self._done.put((False, exc))
            return
        self._done.put((True, None))
        while (job := self._jobs.get()) is not None:
            self._done.put(self._run(*job))

    def run(self, requests: int, concurrency: int, max_new: int) -> dict[str, Any]:
        self._jobs.put((requests, concurrency, max_new))
        return self._done.get()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=30)

    def _run(self, requests: int, concurrency: int, max_new: int) -> dict[str, Any]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            max_tokens=max_new,
            temperature=0.0,
            ignore_eos=True,
            output_kind=RequestOutputKind.DELTA,
        )
        engine = self.engine
        started: dict[str, float] = {}
        ttft: list[float] = []
        tokens = 0
        sent = 0
        cpu0, t0 = _self_cpu(), time.perf_counter()

        def add() -> None:
            nonlocal sent
            rid = uuid.uuid4().hex
            started[rid] = time.perf_counter()
            engine.add_request(rid, PROMPT, params)
            sent += 1

        while sent < min(concurrency, requests):
            add()
        while engine.has_unfinished_requests():
            for out in engine.step():
                n = len(out.outputs[0].token_ids)
                if n and out.request_id in started:
                    ttft.append((time.perf_counter() - started.pop(out.request_id)) * 1000)
                tokens += n
                if out.finished and sent < requests:
                    add()
        wall = time.perf_counter() - t0
        return _figures(requests, tokens, wall, ttft, _self_cpu() - cpu0)


def _figures(
    requests: int, tokens: int, wall: float, ttft: list[float], cpu: float
) -> dict[str, Any]:
    return {
        "requests": requests,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "ttft_p50_ms": statistics.median(ttft),
        "cpu_s_per_request": cpu / requests,
    }


def _mesh_run(mesh: Any, requests: int, concurrency: int, max_new: int) -> dict[str, Any]:
    from omnirail.client.sdk import Chunk, Client

    pids = list(mesh.processes().values())
    before = {pid: _tree_cpu(pid) for pid in pids}
    ttft: list[float] = []
    tokens = [0]
    lock = threading.Lock()
    left = [requests]
    inputs = {"text": PROMPT, "options": {"max_new_tokens": max_new, "ignore_eos": True}}

    def worker(client: Client) -> None:
        while True:
            with lock:
                if left[0] == 0:
                    return
                left[0] -= 1
            t = time.perf_counter()
            first = None
            n = 0
            for event in client.stream(inputs):
                if isinstance(event, Chunk):
                    if first is None:
                        first = (time.perf_counter() - t) * 1000
                    n += len(event.data["token_ids"])
            with lock:
                ttft.append(first if first is not None else float("nan"))
                tokens[0] += n

    cpu0, t0 = _self_cpu(), time.perf_counter()
    with Client(mesh.address, timeout=300) as client:
        threads = [threading.Thread(target=worker, args=(client,)) for _ in range(concurrency)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    wall = time.perf_counter() - t0
    cpu = _self_cpu() - cpu0 + sum(_tree_cpu(p) - before[p] for p in pids)
    return _figures(requests, tokens[0], wall, ttft, cpu)


def run_llm_bench(
    model_path: str | None = None,
    concurrency: list[int] | None = None,
    requests: int = 16,
    max_new_tokens: int = 64,
    rounds: int = 2,
    engine: dict[str, Any] | None = None,
    progress: Callable[[str], None] = lambda _msg: None,
) -> dict[str, Any]:
    from omnirail.ops.launcher import Mesh

    levels = concurrency or [1, 8]
    engine = {"enforce_eager": True, "kv_cache_gib": 0.5, "max_model_len": 512, **(engine or {})}
    with tempfile.TemporaryDirectory(prefix="omnirail-bench-llm-") as tmp:
        if model_path is None:
            from omnirail.testing.tiny import qwen3

            progress("making a tiny random Qwen3")
            model_path = str(qwen3.make_tiny_model(Path(tmp) / "qwen3"))
        config = {
            "name": f"bench-llm-{uuid.uuid4().hex[:6]}",
            "model_path": model_path,
            "entry_stage": "llm",
            "stages": [
                {
                    "name": "llm",
                    "factory": "omnirail.engines.vllm:create_llm",
                    "factory_args": dict(engine),
                    "terminal": True,
                }
            ],
        }
        progress("starting the direct engine")
        direct = DirectEngine(model_path, engine)
        try:
            with pipeline_file(config) as path:
                progress("starting the mesh")
                mesh = Mesh(path)
                mesh.start(timeout=600)
                try:
                    results = _interleave(
                        direct, mesh, levels, requests, max_new_tokens, rounds, progress
                    )
                finally:
                    mesh.stop()
        finally:
            direct.close()
    return {
        "bench": "llm",
        "model_path": model_path,
        "engine": engine,
        "requests": requests,
        "max_new_tokens": max_new_tokens,
        "rounds": rounds,
        "cores": os.cpu_count(),
        **results,
    }


def _interleave(
    direct: DirectEngine,
    mesh: Any,
    levels: list[int],
    requests: int,
    max_new: int,
    rounds: int,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    # A warm-up of each, not counted.
    direct.run(2, 2, 8)
    _mesh_run(mesh, 2, 2, 8)
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {"direct": {}, "mesh": {}}
    for r in range(rounds):
        for c in levels:
            order = ("direct", "mesh") if r % 2 == 0 else ("mesh", "direct")
            for mode in order:
                progress(f"round {r + 1}/{rounds}: {mode} at concurrency {c}")
                fig = (
                    direct.run(requests, c, max_new)
                    if mode == "direct"
                    else _mesh_run(mesh, requests, c, max_new)
                )
                runs[mode].setdefault(c, []).append(fig)
    out: dict[str, Any] = {}
    for mode, by_level in runs.items():
        out[mode] = {
            str(c): {
                key: statistics.median(f[key] for f in figs)
                for key in ("tokens_per_s", "ttft_p50_ms", "cpu_s_per_request")
            }
            for c, figs in by_level.items()
        }
    out["mesh_vs_direct"] = {
        str(c): {
            "tokens_per_s_ratio": out["mesh"][str(c)]["tokens_per_s"]
            / out["direct"][str(c)]["tokens_per_s"],
            "ttft_added_ms": out["mesh"][str(c)]["ttft_p50_ms"]
            - out["direct"][str(c)]["ttft_p50_ms"],
        }
        for c in levels
    }
    return out
