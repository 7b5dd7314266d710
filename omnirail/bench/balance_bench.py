"""`omnirail bench pipeline --replicas N --slow-factor F`: replica choice under uneven
replicas. One stage with N replicas sleeps `stage_ms` per request, replica 0 `F` times
longer; the same stage runs under each balance policy (least_outstanding, the default,
against request_id, the hash placement the mesh used before), every mesh up at once and
measured in alternating rounds, so all see the same machine load. Reported per policy:
throughput at `concurrency`, latency p50/p99 under that load, and the share of requests
each replica served.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from omnirail.bench import pipeline_file
from omnirail.tuning import aio

POLICIES = ("least_outstanding", "request_id")


def balance_yaml(policy: str, replicas: int, stage_ms: float, slow_factor: float) -> dict[str, Any]:
    return {
        "name": f"bench-balance-{policy}",
        "balance": policy,
        "stages": [
            {
                "name": "work",
                "factory": "omnirail.bench.stages:replica_work",
                "factory_args": {"stage_ms": stage_ms, "slow_factor": slow_factor},
                "replicas": replicas,
                "torch_threads": 1,
                "retry_safe": True,  # no side effects: a lost replica's requests run again
                "terminal": True,
            }
        ],
    }


async def _load(
    address: str, total: int, concurrency: int
) -> tuple[float, list[float], Counter[int]]:
    from omnirail.client.sdk import AsyncClient

    served: Counter[int] = Counter()
    latencies: list[float] = []
    async with AsyncClient(address, timeout=120) as client:
        counter = iter(range(total))

        async def worker() -> None:
            for i in counter:
                t0 = time.perf_counter()
                out = (await client.generate({"i": i})).output
                latencies.append((time.perf_counter() - t0) * 1000)
                served[out["replica"]] += 1

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return total / (time.perf_counter() - start), latencies, served


def run_balance_bench(
    *,
    replicas: int = 2,
    slow_factor: float = 5.0,
    stage_ms: float = 10.0,
    requests: int = 600,
    concurrency: int = 16,
    rounds: int = 3,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    from omnirail.ops.launcher import Mesh

    if replicas < 2:
        raise ValueError("--replicas must be at least 2 to compare replica choice")
    if slow_factor < 1:
        raise ValueError("--slow-factor must be at least 1")
    if stage_ms <= 0:
        raise ValueError("--stage-ms must be > 0 with --replicas")
    rps: dict[str, list[float]] = {p: [] for p in POLICIES}
    lat: dict[str, list[float]] = {p: [] for p in POLICIES}
    served: dict[str, Counter[int]] = {p: Counter() for p in POLICIES}
    with ExitStack() as stack:
        meshes = {}
        for policy in POLICIES:
            path = stack.enter_context(
                pipeline_file(balance_yaml(policy, replicas, stage_ms, slow_factor))
            )
            meshes[policy] = stack.enter_context(Mesh(path, progress=progress))
        for r in range(rounds):
            for policy in POLICIES if r % 2 == 0 else POLICIES[::-1]:
                address = meshes[policy].address
                assert address is not None
                throughput, latencies, counts = aio.run(_load(address, requests, concurrency))
                rps[policy].append(round(throughput, 1))
                lat[policy].extend(latencies)
                served[policy].update(counts)
    report: dict[str, Any] = {
        "replicas": replicas,
        "slow_factor": slow_factor,
        "stage_ms": stage_ms,
        "requests": requests,
        "concurrency": concurrency,
        "rounds": rounds,
    }
    for policy in POLICIES:
        total = sum(served[policy].values())
        ordered = sorted(lat[policy])
        report[policy] = {
            "throughput_rps": statistics.median(rps[policy]),
            "rounds_throughput_rps": rps[policy],
            "latency_p50_ms": round(ordered[len(ordered) // 2], 2),
            "latency_p99_ms": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 2),
            "share_by_replica": {
                str(k): round(served[policy][k] / total, 3) for k in sorted(served[policy])
            },
        }
    report["slow_replica_share"] = {
        p: report[p]["share_by_replica"].get("0", 0.0) for p in POLICIES
    }
    report["throughput_ratio_least_outstanding_over_hash"] = round(
        report["least_outstanding"]["throughput_rps"] / report["request_id"]["throughput_rps"], 3
    )
    return report
