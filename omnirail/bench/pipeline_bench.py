"""`omnirail bench pipeline`: latency and throughput of an N-stage linear mesh.

Each stage runs in its own process (torch threads 1). The first stage materializes a
uint8 tensor of `payload_bytes`, middle stages forward it, the last returns a small dict.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml


def pipeline_yaml(stages: int, payload_bytes: int, stage_ms: float = 0.0) -> dict[str, Any]:
    if stages < 2:
        raise ValueError("--stages must be at least 2")
    names = [f"s{i}" for i in range(stages)]
    specs = []
    for i, name in enumerate(names):
        if i == 0:
            factory, args = "omnirail.bench.stages:source", {"payload_bytes": payload_bytes}
        elif i == stages - 1:
            factory, args = "omnirail.bench.stages:sink", {}
        else:
            factory, args = "omnirail.bench.stages:forward", {}
        if stage_ms:
            args["stage_ms"] = stage_ms
        spec: dict[str, Any] = {
            "name": name,
            "factory": factory,
            "factory_args": args,
            "torch_threads": 1,
        }
        if i == stages - 1:
            spec["terminal"] = True
        else:
            spec["next"] = names[i + 1]
        specs.append(spec)
    return {"name": f"bench-{stages}", "stages": specs}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _throughput(address: str, total: int, concurrency: int) -> float:
    from omnirail.client import AsyncClient

    async with AsyncClient(address, timeout=60) as client:
        counter = iter(range(total))

        async def worker() -> None:
            for i in counter:
                await client.generate({"i": i})

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return total / (time.perf_counter() - start)


def run_pipeline_bench(
    *,
    stages: int = 3,
    payload_bytes: int = 0,
    requests: int = 300,
    concurrency: int = 64,
    throughput_requests: int = 2048,
    stage_ms: float = 0.0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    from omnirail.client import Client
    from omnirail.launcher import Mesh

    with tempfile.TemporaryDirectory(prefix="omnirail-bench-") as tmp:
        path = Path(tmp) / "bench.yaml"
        path.write_text(yaml.safe_dump(pipeline_yaml(stages, payload_bytes, stage_ms)))
        with Mesh(path, progress=progress) as mesh:
            assert mesh.address is not None
            with Client(mesh.address, timeout=60) as client:
                for i in range(50):  # warm pools, channels and code paths
                    client.generate({"i": i})
                latencies = []
                for i in range(requests):
                    t0 = time.perf_counter()
                    out = client.generate({"i": i}).output
                    latencies.append((time.perf_counter() - t0) * 1000)
                    if out["nbytes"] != payload_bytes:
                        raise RuntimeError(f"sink saw {out['nbytes']} bytes, sent {payload_bytes}")
            rps = asyncio.run(_throughput(mesh.address, throughput_requests, concurrency))
    report: dict[str, Any] = {
        "stages": stages,
        "payload_bytes": payload_bytes,
        "requests": requests,
        "latency_p50_ms": round(statistics.median(latencies), 3),
        "latency_p99_ms": round(_percentile(latencies, 0.99), 3),
        "concurrency": concurrency,
        "throughput_requests": throughput_requests,
        "throughput_rps": round(rps, 1),
    }
    if stage_ms:
        report["stage_ms"] = stage_ms
        report["efficiency"] = round(rps * stage_ms / 1000.0, 3)
    return report
