"""`omnirail bench pipeline`: latency and throughput of an N-stage linear mesh.

Each stage runs in its own process (torch threads 1). The first stage materializes a
uint8 tensor of `payload_bytes`, middle stages forward it, the last returns a small dict.
`fused=True` also starts the same stages fused into one process (`fused_stages`: every
edge dispatched in the process) and measures both meshes in turn.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any

from omnirail.bench import pipeline_file
from omnirail.tuning import aio


def pipeline_yaml(
    stages: int, payload_bytes: int, stage_ms: float = 0.0, fused: bool = False
) -> dict[str, Any]:
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
            "retry_safe": True,  # no side effects: a lost replica's requests run again
        }
        if i == stages - 1:
            spec["terminal"] = True
        else:
            spec["next"] = names[i + 1]
        specs.append(spec)
    if fused:
        return {"name": f"bench-{stages}-fused", "stages": specs, "fused_stages": [names]}
    return {"name": f"bench-{stages}", "stages": specs}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _throughput(
    address: str, total: int, concurrency: int, options: dict[str, Any] | None = None
) -> float:
    from omnirail.client.sdk import AsyncClient

    async with AsyncClient(address, timeout=60, **(options or {})) as client:
        counter = iter(range(total))

        async def worker() -> None:
            for i in counter:
                await client.generate({"i": i})

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return total / (time.perf_counter() - start)


# Environment for the mesh processes: tracing off, or on at sampling 1.0 (spans to the
# run directory's files unless OTEL_EXPORTER_OTLP_ENDPOINT points elsewhere).
TRACING_ENV = {
    "off": {"OTEL_SDK_DISABLED": "true"},
    "on": {"OTEL_SDK_DISABLED": "false", "OTEL_TRACES_SAMPLER": "always_on"},
}


def _latencies(
    address: str, requests: int, payload_bytes: int, options: dict[str, Any] | None = None
) -> list[float]:
    return aio.run(_sequential(address, requests, payload_bytes, options))


async def _sequential(
    address: str, requests: int, payload_bytes: int, options: dict[str, Any] | None = None
) -> list[float]:
    # The async client on the services' own loop (uvloop): it has fewer thread hand-offs
    # per call than the blocking client, so the figure is the mesh's, not the SDK's.
    from omnirail.client.sdk import AsyncClient

    async with AsyncClient(address, timeout=60, **(options or {})) as client:
        for i in range(50):  # warm pools, channels and code paths
            await client.generate({"i": i})
        latencies = []
        for i in range(requests):
            t0 = time.perf_counter()
            out = (await client.generate({"i": i})).output
            latencies.append((time.perf_counter() - t0) * 1000)
            if out["nbytes"] != payload_bytes:
                raise RuntimeError(f"sink saw {out['nbytes']} bytes, sent {payload_bytes}")
    return latencies


def _round(
    address: str,
    requests: int,
    payload_bytes: int,
    throughput_requests: int,
    concurrency: int,
    options: dict[str, Any] | None = None,
) -> tuple[float, float, float]:
    """One round on a mesh: sequential latency p50 and p99 (ms), then throughput (rps);
    `options`: the client's TLS and token, for a secured mesh."""
    latencies = _latencies(address, requests, payload_bytes, options)
    rps = aio.run(_throughput(address, throughput_requests, concurrency, options))
    return (
        round(statistics.median(latencies), 3),
        round(_percentile(latencies, 0.99), 3),
        round(rps, 1),
    )


def run_pipeline_bench(
    *,
    stages: int = 3,
    payload_bytes: int = 0,
    requests: int = 300,
    concurrency: int = 64,
    throughput_requests: int = 2048,
    stage_ms: float = 0.0,
    tracing: str = "off",
    pin: bool = True,
    rounds: int = 1,
    fused: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """`pin`: the mesh pins each process to one CPU (`omnirail up --pin`). `rounds`: the
    latency and throughput runs are repeated on the same mesh, in turn, and the report
    gives the median of each figure (and every round's): on a shared host, whose speed
    changes from one minute to the next, one run of 300 requests says little."""
    from omnirail.ops.launcher import Mesh

    if rounds < 1:
        raise ValueError("--rounds must be at least 1")
    if fused:
        if tracing == "compare":
            raise ValueError("--fused and --tracing compare each compare two meshes; pick one")
        return _compare_fused(
            stages,
            payload_bytes,
            requests,
            concurrency,
            throughput_requests,
            stage_ms,
            tracing,
            pin,
            max(rounds, 3),
            progress,
        )
    if tracing == "compare":
        return _compare_tracing(
            stages,
            payload_bytes,
            requests,
            concurrency,
            throughput_requests,
            stage_ms,
            pin,
            progress,
        )
    if tracing not in TRACING_ENV:
        raise ValueError(f"tracing must be off, on or compare, not {tracing!r}")
    with pipeline_file(pipeline_yaml(stages, payload_bytes, stage_ms)) as path:
        with Mesh(path, progress=progress, env=TRACING_ENV[tracing], pin=pin) as mesh:
            assert mesh.address is not None
            p50s, p99s, rpss = [], [], []
            for _ in range(rounds):
                p50, p99, rps = _round(
                    mesh.address, requests, payload_bytes, throughput_requests, concurrency
                )
                p50s.append(p50)
                p99s.append(p99)
                rpss.append(rps)
    report: dict[str, Any] = {
        "stages": stages,
        "payload_bytes": payload_bytes,
        "requests": requests,
        "latency_p50_ms": statistics.median(p50s),
        "latency_p99_ms": statistics.median(p99s),
        "concurrency": concurrency,
        "throughput_requests": throughput_requests,
        "throughput_rps": statistics.median(rpss),
        "rounds": rounds,
    }
    if rounds > 1:
        report["rounds_latency_p50_ms"] = p50s
        report["rounds_latency_p99_ms"] = p99s
        report["rounds_throughput_rps"] = rpss
    if stage_ms:
        report["stage_ms"] = stage_ms
        report["efficiency"] = round(report["throughput_rps"] * stage_ms / 1000.0, 3)
    report["tracing"] = tracing
    report["pinned"] = pin
    return report


def _compare_tracing(
    stages: int,
    payload_bytes: int,
    requests: int,
    concurrency: int,
    throughput_requests: int,
    stage_ms: float,
    pin: bool,
    progress: Callable[[str], None] | None,
    rounds: int = 3,
) -> dict[str, Any]:
    """Throughput with tracing off and on, measured in alternating rounds on two meshes
    so both see the same machine load; reports the median of each and their ratio."""
    from omnirail.ops.launcher import Mesh

    with pipeline_file(pipeline_yaml(stages, payload_bytes, stage_ms)) as path:
        with (
            Mesh(path, progress=progress, env=TRACING_ENV["off"], pin=pin) as off,
            Mesh(path, progress=progress, env=TRACING_ENV["on"], pin=pin) as on,
        ):
            assert off.address is not None and on.address is not None
            p50 = {}
            for name, mesh in (("off", off), ("on", on)):
                assert mesh.address is not None
                p50[name] = statistics.median(_latencies(mesh.address, requests, payload_bytes))
            rps: dict[str, list[float]] = {"off": [], "on": []}
            for _ in range(rounds):
                for name, mesh in (("off", off), ("on", on)):
                    assert mesh.address is not None
                    rps[name].append(
                        aio.run(_throughput(mesh.address, throughput_requests, concurrency))
                    )
            spans = sum(1 for _ in on.span_dir.glob("*.otlp"))
    off_rps, on_rps = statistics.median(rps["off"]), statistics.median(rps["on"])
    return {
        "stages": stages,
        "payload_bytes": payload_bytes,
        "concurrency": concurrency,
        "throughput_requests": throughput_requests,
        "rounds": rounds,
        "latency_p50_ms_tracing_off": round(p50["off"], 3),
        "latency_p50_ms_tracing_on": round(p50["on"], 3),
        "throughput_rps_tracing_off": round(off_rps, 1),
        "throughput_rps_tracing_on": round(on_rps, 1),
        "throughput_rps_runs": {k: [round(x, 1) for x in v] for k, v in rps.items()},
        "tracing_throughput_ratio": round(on_rps / off_rps, 3),
        "span_files": spans,
        "pinned": pin,
    }


def _compare_fused(
    stages: int,
    payload_bytes: int,
    requests: int,
    concurrency: int,
    throughput_requests: int,
    stage_ms: float,
    tracing: str,
    pin: bool,
    rounds: int,
    progress: Callable[[str], None] | None,
) -> dict[str, Any]:
    """The same stages one process each and fused into one process, both meshes up at
    once and measured in alternating rounds (latency, then throughput) so both see the
    same machine load; medians of the rounds and the fused-over-separate ratios."""
    from omnirail.ops.launcher import Mesh

    if tracing not in TRACING_ENV:
        raise ValueError(f"tracing must be off or on with --fused, not {tracing!r}")
    env = TRACING_ENV[tracing]
    with (
        pipeline_file(pipeline_yaml(stages, payload_bytes, stage_ms)) as separate_path,
        pipeline_file(pipeline_yaml(stages, payload_bytes, stage_ms, fused=True)) as fused_path,
        Mesh(separate_path, progress=progress, env=env, pin=pin) as separate,
        Mesh(fused_path, progress=progress, env=env, pin=pin) as fused,
    ):
        meshes = {"separate": separate, "fused": fused}
        sides = interleaved_rounds(
            meshes, rounds, requests, payload_bytes, throughput_requests, concurrency
        )
        processes = {k: len(m.processes()) for k, m in meshes.items()}
    report: dict[str, Any] = {
        "stages": stages,
        "payload_bytes": payload_bytes,
        "requests": requests,
        "concurrency": concurrency,
        "throughput_requests": throughput_requests,
        "rounds": rounds,
        "processes": processes,
        **sides,
        "fused_over_separate": ratios(sides["fused"], sides["separate"]),
    }
    if stage_ms:
        report["stage_ms"] = stage_ms
    report["tracing"] = tracing
    report["pinned"] = pin
    return report


def interleaved_rounds(
    meshes: dict[str, Any],
    rounds: int,
    requests: int,
    payload_bytes: int,
    throughput_requests: int,
    concurrency: int,
) -> dict[str, dict[str, Any]]:
    """`rounds` rounds (`_round`) on each of `meshes`, their order reversed every other
    round so all see the same machine load; per mesh, the medians and every round's figure.
    Each mesh is dialled with its own `client_options()` (TLS and a token when secured)."""
    kinds = list(meshes)
    p50: dict[str, list[float]] = {k: [] for k in kinds}
    p99: dict[str, list[float]] = {k: [] for k in kinds}
    rps: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(rounds):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            mesh = meshes[kind]
            assert mesh.address is not None
            figures = _round(
                mesh.address,
                requests,
                payload_bytes,
                throughput_requests,
                concurrency,
                mesh.client_options(),
            )
            for series, value in zip((p50, p99, rps), figures, strict=True):
                series[kind].append(value)
    return {
        kind: {
            "latency_p50_ms": statistics.median(p50[kind]),
            "latency_p99_ms": statistics.median(p99[kind]),
            "throughput_rps": statistics.median(rps[kind]),
            "rounds_latency_p50_ms": p50[kind],
            "rounds_throughput_rps": rps[kind],
        }
        for kind in kinds
    }


def ratios(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """`a`'s medians over `b`'s (from `interleaved_rounds`)."""
    return {
        "latency_p50": round(a["latency_p50_ms"] / b["latency_p50_ms"], 3),
        "latency_p99": round(a["latency_p99_ms"] / b["latency_p99_ms"], 3),
        "throughput": round(a["throughput_rps"] / b["throughput_rps"], 3),
    }
