"""`omnirail bench overload`: `factor` times more requests at once than the mesh admits.

A 3-stage mesh (each stage sleeping `stage_ms` per request) with `max_live_requests` of
`live` gets waves of `factor * live` requests sent at once. Reported: per wave, how many
were admitted and completed and how many were refused (RESOURCE_EXHAUSTED); how long a
refusal took (it must not wait for the work in front of it); the admitted requests'
latency under overload against waves of exactly `live` requests (the mesh at its limit
without the excess: refusals must not slow what was admitted); and each process's
resident memory after the last wave against after the second (it must stay flat).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from omnirail.bench import pipeline_file, rss_kib
from omnirail.bench.pipeline_bench import pipeline_yaml
from omnirail.tuning import aio


async def _wave(address: str, count: int, start: int) -> list[tuple[str, float]]:
    from omnirail.client.sdk import AsyncClient
    from omnirail.wire.errors import OmniError

    async with AsyncClient(address, timeout=120) as client:

        async def one(i: int) -> tuple[str, float]:
            t0 = time.perf_counter()
            try:
                await client.generate({"i": i}, request_id=f"ov-{start + i}")
                code = "OK"
            except OmniError as exc:
                code = exc.code_name
            return code, (time.perf_counter() - t0) * 1000

        return await asyncio.gather(*(one(i) for i in range(count)))


def run_overload_bench(
    *,
    factor: int = 10,
    live: int = 64,
    stage_ms: float = 5.0,
    waves: int = 10,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    from omnirail.ops.launcher import Mesh

    if factor < 1 or live < 1 or waves < 3:
        raise ValueError("--factor and --live must be >= 1, --waves >= 3")
    cfg = pipeline_yaml(3, 0, stage_ms)
    cfg["max_live_requests"] = live
    with pipeline_file(cfg) as path, Mesh(path, progress=progress) as mesh:
        assert mesh.address is not None
        aio.run(_wave(mesh.address, live, -10 * live))  # warm-up
        # The same mesh at its limit, without the excess: what admitted requests should
        # keep under overload.
        at_limit = sorted(
            ms for w in range(3) for _, ms in aio.run(_wave(mesh.address, live, -(w + 2) * live))
        )
        results = []
        rss_base: dict[str, int | None] = {}
        for w in range(waves):
            results.append(aio.run(_wave(mesh.address, factor * live, w * factor * live)))
            if w == 1:
                rss_base = {n: rss_kib(pid) for n, pid in mesh.processes().items()}
        rss_end = {n: rss_kib(pid) for n, pid in mesh.processes().items()}
    per_wave = [dict(Counter(code for code, _ in wave)) for wave in results]
    admitted = sorted(ms for wave in results for code, ms in wave if code == "OK")
    refused = sorted(ms for wave in results for code, ms in wave if code == "RESOURCE_EXHAUSTED")
    growth = {
        n: round((rss_end[n] - b) / b * 100, 2) for n, b in rss_base.items() if b and rss_end.get(n)
    }
    return {
        "factor": factor,
        "max_live_requests": live,
        "stage_ms": stage_ms,
        "waves": waves,
        "per_wave": per_wave,
        "refused_ms": _summary(refused),
        "admitted_ms": _summary(admitted),
        "at_limit_ms": _summary(at_limit),
        "admitted_p50_over_at_limit": round(
            statistics.median(admitted) / statistics.median(at_limit), 3
        )
        if admitted
        else None,
        "rss_growth_pct_after_wave_2": growth,
        "rss_growth_pct_max": max(growth.values(), default=0.0),
    }


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"count": 0}
    return {
        "count": len(values),
        "p50": round(values[len(values) // 2], 2),
        "p99": round(values[min(len(values) - 1, int(0.99 * len(values)))], 2),
    }
