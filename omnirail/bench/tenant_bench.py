"""`omnirail bench tenants`: a caller flooding the mesh beside a quiet one.

The mesh: one stage that steps up to `max_batch` requests together (`steps` steps of
`step_ms` each per request, like decode steps on an accelerator), `max_live_requests` of
`live`, two principals with their own tokens, and `security.quotas` giving them equal
weights. Its capacity is `live` requests per request time (`steps * step_ms`).

Phases, each `seconds` long, open loop (requests are sent on a clock, not when the last
one answered, as independent callers do):
1. alone: the quiet principal at `quiet_x` times the capacity;
2. flooded: the same, while the flooding principal sends at `flood_x` times the capacity
   from a process of its own (so its sending does not slow the quiet one's client).
With `baseline`, phase 2 runs once more on a mesh without quotas (one limit, first come
first served), to show what the quotas change.

Reported: the quiet principal's outcomes and latency in each phase, p50 flooded over p50
alone, the flooder's outcomes and the retry hints it got, and the CPU seconds per request
of the coordinator and the stage.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omnirail.bench import cpu_seconds, pipeline_file
from omnirail.tuning import aio

QUIET, FLOOD = "quiet", "flood"
_TOKENS = {QUIET: "bench-quiet-token", FLOOD: "bench-flood-token"}


def tenants_yaml(
    live: int, steps: int, step_ms: float, max_batch: int, quotas: bool
) -> dict[str, Any]:
    security: dict[str, Any] = {"tokens_file": "tokens"}
    if quotas:
        security["quotas"] = {"default": {"weight": 1}}
    return {
        "name": "bench-tenants",
        "max_live_requests": live,
        "security": security,
        "stages": [
            {
                "name": "work",
                "factory": "omnirail.bench.stages:tenant_work",
                "factory_args": {"steps": steps, "step_ms": step_ms, "max_batch": max_batch},
                "terminal": True,
                "max_queue": 100_000,
            }
        ],
    }


async def send_open_loop(
    address: str, token: str, rate: float, seconds: float, tag: str
) -> list[tuple[str, float, int]]:
    """Sends at `rate` per second for `seconds`; each request's (code, ms, retry hint)."""
    from omnirail.client.sdk import AsyncClient
    from omnirail.wire.errors import OmniError

    async with AsyncClient(address, timeout=60, token=token) as client:

        async def one(i: int) -> tuple[str, float, int]:
            t0 = time.perf_counter()
            try:
                await client.generate({"i": i}, request_id=f"{tag}-{i}")
                return "OK", (time.perf_counter() - t0) * 1000, 0
            except OmniError as exc:
                return exc.code_name, (time.perf_counter() - t0) * 1000, exc.retry_after_ms

        loop = asyncio.get_running_loop()
        start = loop.time()
        tasks = []
        count = max(1, round(rate * seconds))
        for i in range(count):
            delay = start + i / rate - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(i)))
        return list(await asyncio.gather(*tasks))


def flood_main() -> None:
    """The flooding caller's process: argv[1] is a JSON object of `send_open_loop`'s
    arguments, argv[2] the file its outcomes are written to (JSON)."""
    args = json.loads(sys.argv[1])
    Path(sys.argv[2]).write_text(json.dumps(aio.run(send_open_loop(**args))))


def _quiet_summary(results: list[tuple[str, float, int]]) -> dict[str, Any]:
    ok = sorted(ms for code, ms, _ in results if code == "OK")
    return {
        "sent": len(results),
        "outcomes": dict(Counter(code for code, _, _ in results)),
        "p50_ms": round(statistics.median(ok), 2) if ok else None,
        "p90_ms": round(ok[min(len(ok) - 1, int(0.9 * len(ok)))], 2) if ok else None,
    }


def _flood_summary(results: list[tuple[str, float, int]]) -> dict[str, Any]:
    hints = sorted(h for code, _, h in results if code == "RESOURCE_EXHAUSTED")
    refused_ms = sorted(ms for code, ms, _ in results if code == "RESOURCE_EXHAUSTED")
    return {
        "sent": len(results),
        "outcomes": dict(Counter(code for code, _, _ in results)),
        "refusals_with_retry_hint": sum(1 for h in hints if h > 0),
        "retry_hint_ms": sorted(set(hints))[:5],
        "refused_p50_ms": round(statistics.median(refused_ms), 2) if refused_ms else None,
    }


def _flooded(
    address: str, quiet_rate: float, flood_rate: float, seconds: float, tag: str
) -> tuple[list[tuple[str, float, int]], list[tuple[str, float, int]]]:
    args = {
        "address": address,
        "token": _TOKENS[FLOOD],
        "rate": flood_rate,
        "seconds": seconds,
        "tag": f"flood-{tag}",
    }
    code = "from omnirail.bench.tenant_bench import flood_main; flood_main()"
    with tempfile.TemporaryDirectory(prefix="omnirail-flood-") as tmp:
        out = Path(tmp, "outcomes.json")
        flooder = subprocess.Popen([sys.executable, "-c", code, json.dumps(args), str(out)])
        try:
            time.sleep(min(1.0, seconds / 4))  # the flood is on before the quiet one starts
            quiet = aio.run(send_open_loop(address, _TOKENS[QUIET], quiet_rate, seconds, tag))
            flooder.wait(timeout=seconds + 120)
        finally:
            if flooder.poll() is None:
                flooder.kill()
                flooder.wait()
        if flooder.returncode != 0:
            raise RuntimeError(f"the flooding process failed (exit {flooder.returncode})")
        flood = [tuple(r) for r in json.loads(out.read_text())]
    return quiet, flood  # type: ignore[return-value]


def run_tenant_bench(
    *,
    live: int = 8,
    steps: int = 20,
    step_ms: float = 10.0,
    flood_x: float = 10.0,
    quiet_x: float = 0.2,
    seconds: float = 10.0,
    baseline: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    from omnirail.ops.launcher import Mesh

    if live < 1 or steps < 1 or step_ms <= 0 or flood_x <= 0 or quiet_x <= 0 or seconds <= 0:
        raise ValueError("--live, --steps, --step-ms, --flood-x, --quiet-x, --seconds: > 0")
    request_s = steps * step_ms / 1000.0
    capacity = live / request_s  # requests per second the mesh's limit lets through
    quiet_rate, flood_rate = quiet_x * capacity, flood_x * capacity
    # Room in a step's batch for every request the admission can let in (the mesh's limit
    # plus the quiet principal's share of it): the bound is the admission's, not the batch's.
    max_batch = 2 * live
    report: dict[str, Any] = {
        "max_live_requests": live,
        "request_s": request_s,
        "capacity_rps": round(capacity, 2),
        "quiet_rps": round(quiet_rate, 2),
        "flood_rps": round(flood_rate, 2),
        "seconds": seconds,
    }

    def phase(quotas: bool, alone: bool) -> dict[str, Any]:
        cfg = tenants_yaml(live, steps, step_ms, max_batch, quotas)
        with pipeline_file(cfg) as path:
            lines = [f"{token},{name}" for name, token in _TOKENS.items()]
            Path(path.parent, "tokens").write_text("\n".join(lines) + "\n")
            with Mesh(path, progress=progress) as mesh:
                assert mesh.address is not None
                token = _TOKENS[QUIET]
                aio.run(send_open_loop(mesh.address, token, quiet_rate, 1.0, "warm"))
                pids = mesh.processes()
                cpu0 = {n: cpu_seconds(p) or 0.0 for n, p in pids.items()}
                out: dict[str, Any] = {}
                if alone:
                    quiet = aio.run(send_open_loop(mesh.address, token, quiet_rate, seconds, "q"))
                    out["quiet_alone"] = _quiet_summary(quiet)
                    handled = len(quiet)
                quiet, flood = _flooded(mesh.address, quiet_rate, flood_rate, seconds, "qf")
                out["quiet_flooded"] = _quiet_summary(quiet)
                out["flood"] = _flood_summary(flood)
                handled = (handled if alone else 0) + len(quiet) + len(flood)
                cpu = {n: (cpu_seconds(p) or 0.0) - cpu0[n] for n, p in pids.items()}
                out["cpu_s_per_request"] = {n: round(c / handled, 6) for n, c in cpu.items()}
                out["requests_handled"] = handled
                return out

    fair = phase(quotas=True, alone=True)
    report.update(fair)
    alone_p50 = fair["quiet_alone"]["p50_ms"]
    flooded_p50 = fair["quiet_flooded"]["p50_ms"]
    report["quiet_p50_flooded_over_alone"] = (
        round(flooded_p50 / alone_p50, 3) if alone_p50 and flooded_p50 else None
    )
    report["quiet_all_completed"] = fair["quiet_flooded"]["outcomes"] == {
        "OK": fair["quiet_flooded"]["sent"]
    }
    if baseline:
        report["without_quotas"] = phase(quotas=False, alone=False)
    return report
