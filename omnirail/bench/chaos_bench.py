"""`omnirail bench chaos`: a soak under faults, then an audit of what it left behind.

A mesh of one of the example pipelines (quickstart, streaming, omni demo), every stage
with 2 replicas, is driven through the async SDK at `concurrency` with a mix of normal
requests, client aborts (after 0-50 ms), short deadlines (5-40 ms), malformed and
oversized inputs, while a replica process is SIGKILLed every `kill_every_s` (the
launcher restarts it; replica 0 of each stage is spared, so every stage keeps serving and
the memory of one process per stage can be compared across the run). A warm-up with the
same mix, without kills, comes first. Then:

- every request ended with a terminal status, and within its deadline plus 1 s;
- deadline errors reached the client within how long of the deadline (p50/p99/max), and
  how late the coordinator's deadline timers fired (`omnirail_deadline_overrun_seconds`);
- once the mesh is idle: no request in any stage, nothing queued, no scheduler state
  (KV caches, stream windows), no relay payload held, nothing live in the coordinator,
  no shared-memory segment of a process that is gone;
- resident memory of the coordinator and of every stage process that lived through the
  run, against after the warm-up.

The omni shape is the installed omni demo (`omnirail.models.omni_demo`); quickstart and
streaming are the repository's examples (`examples.quickstart`, `examples.streaming`), which
are not installed: they are found where `examples` is importable (a checkout's working
directory). The pipeline's own directory is linked into a temporary one beside the changed
pipeline file, so its `.module:factory` paths resolve as they do for the original.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import random
import signal
import statistics
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from omnirail.bench import rss_kib

SHAPES: dict[str, tuple[str, dict[str, Any], bool]] = {
    # name: (the package holding its pipeline.yaml, inputs, stream)
    "quickstart": ("examples.quickstart", {"text": "hello omnirail", "image_size": 64}, False),
    "streaming": ("examples.streaming", {"text": "hello omnirail", "voice": 0.6}, True),
    "omni": (
        "omnirail.models.omni_demo",
        {"text": "Tell me about a river.", "max_new_tokens": 8, "seed": 1},
        True,
    ),
}
# A request with no terminal status this long after its deadline is counted as hung.
HUNG_AFTER_S = 5.0
MAX_INPUT_MB = 1
OVERRUN = "omnirail_deadline_overrun_seconds"
# What each stage process must hold no more of once the mesh is idle.
HELD_METRICS = {
    "inflight": "omnirail_stage_inflight",
    "queued": "omnirail_stage_queue_depth",
    "scheduler_state": "omnirail_stage_held_requests",
    "relay_held": "omnirail_relay_held",
}


@dataclass
class Outcome:
    kind: str  # normal, abort, deadline, bad
    code: str  # OK, or the error's code name; HUNG: no terminal status
    elapsed_s: float
    timeout_s: float
    message: str = ""


def shape_dir(shape: str) -> Path:
    """The directory of the shape's pipeline.yaml (module docstring)."""
    if shape not in SHAPES:
        raise ValueError(f"--shape must be one of {sorted(SHAPES)}, not {shape!r}")
    package = SHAPES[shape][0]
    try:
        spec = importlib.util.find_spec(package)
    except ModuleNotFoundError:
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"--shape {shape}: {package} is not importable here; it is an example of the "
            "repository, not installed: run from a checkout's root, or use --shape omni"
        )
    return Path(next(iter(spec.submodule_search_locations)))


@contextmanager
def chaos_pipeline(shape: str, replicas: int) -> Iterator[Path]:
    """The shape's example pipeline with every stage replicated and a generous restart
    budget, in a temporary directory that links the example's files."""
    source = shape_dir(shape)
    cfg = yaml.safe_load((source / "pipeline.yaml").read_text())
    for stage in cfg["stages"]:
        stage["replicas"] = replicas
        stage["restart"] = {"max": 1000, "window_s": 60, "backoff_s": 0.1, "backoff_max_s": 1}
    cfg["max_input_mb"] = MAX_INPUT_MB  # oversized inputs stay cheap to send
    cfg["name"] = f"chaos-{shape}"
    with tempfile.TemporaryDirectory(prefix="omnirail-chaos-") as tmp:
        for entry in source.iterdir():
            if entry.name != "pipeline.yaml":
                (Path(tmp) / entry.name).symlink_to(entry)
        path = Path(tmp) / "pipeline.yaml"
        path.write_text(yaml.safe_dump(cfg))
        yield path


def _bad_input(i: int) -> dict[str, Any]:
    """Malformed (a wrong type, nothing at all) or oversized."""
    return [
        {"text": 12345, "image_size": "big"},
        {},
        {"blob": b"\0" * ((MAX_INPUT_MB << 20) + 1)},
    ][i % 3]


async def _one(
    client: Any, i: int, kind: str, inputs: dict[str, Any], stream: bool, rng: random.Random
) -> Outcome:
    from omnirail.wire.errors import OmniError

    rid = f"chaos-{i}"
    timeout = rng.uniform(0.005, 0.04) if kind == "deadline" else 30.0
    if kind == "bad":
        inputs = _bad_input(i)
    t0 = time.monotonic()

    async def run() -> None:
        if stream:
            async for _ in client.stream(inputs, request_id=rid, timeout=timeout):
                pass
        else:
            await client.generate(inputs, request_id=rid, timeout=timeout)

    code, message = "OK", ""
    try:
        async with asyncio.timeout(timeout + HUNG_AFTER_S):
            task = asyncio.get_running_loop().create_task(run())
            if kind == "abort":
                await asyncio.sleep(rng.uniform(0, 0.05))
                try:
                    await client.abort(rid, "chaos")
                except OmniError:
                    pass  # it ended already, or the abort came first (its start is refused)
            await task
    except TimeoutError:
        code = "HUNG"
    except OmniError as exc:
        code, message = exc.code_name, exc.message
    return Outcome(kind, code, time.monotonic() - t0, timeout, message)


async def _drive(
    address: str,
    shape: str,
    start: int,
    count: int,
    concurrency: int,
    fractions: dict[str, float],
    seed: int,
) -> list[Outcome]:
    from omnirail.client.sdk import AsyncClient

    _, inputs, stream = SHAPES[shape]
    rng = random.Random(seed)
    kinds = [*fractions, "normal"]
    weights = [*fractions.values(), max(0.0, 1 - sum(fractions.values()))]
    plan = [(start + i, rng.choices(kinds, weights)[0]) for i in range(count)]
    outcomes: list[Outcome] = []
    async with AsyncClient(address, timeout=60) as client:
        todo = iter(plan)

        async def worker() -> None:
            for i, kind in todo:
                outcomes.append(await _one(client, i, kind, inputs, stream, rng))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes


def _spared(process: str) -> bool | None:
    """Replica 0 of each stage is never killed: every stage keeps serving through the
    soak, and its memory can be compared with after the warm-up. None: the coordinator."""
    if process == "coordinator":
        return None
    return not process.rsplit("-", 1)[-1].isdigit() or process.endswith("-0")


def _samples(address: str) -> list[Any]:
    """Every sample a /metrics endpoint serves (parsed by prometheus_client)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def _scrape(address: str) -> dict[str, float]:
    """Sample name -> value, summed over labels."""
    out: Counter[str] = Counter()
    for sample in _samples(address):
        out[sample.name] += sample.value
    return dict(out)


def _buckets(address: str, name: str) -> dict[float, float]:
    """A histogram's cumulative bucket counts (upper bound -> count)."""
    return {float(s.labels["le"]): s.value for s in _samples(address) if s.name == name + "_bucket"}


def _bucket_quantiles(before: dict[float, float], after: dict[float, float]) -> dict[str, Any]:
    """p50/p99 of what a histogram gained between two scrapes, as bucket upper bounds."""
    gained = sorted((le, after[le] - before.get(le, 0.0)) for le in after)
    total = gained[-1][1] if gained else 0.0
    out: dict[str, Any] = {"count": int(total)}
    for label, q in (("p50_at_most_ms", 0.5), ("p99_at_most_ms", 0.99)):
        if total:
            le = next(le for le, n in gained if n >= q * total)
            out[label] = None if le == float("inf") else round(le * 1000, 3)
    return out


def _settle(mesh: Any, replicas: int, timeout: float = 120.0) -> dict[str, Any]:
    """Waits until every stage has all its replicas and nothing runs or is held; returns
    what is still held (all zero when clean) after `timeout` at the latest."""
    from omnirail.client.sdk import Client

    deadline = time.monotonic() + timeout
    with Client(mesh.address) as client:
        while True:
            info = client.describe()
            full = all(sum(r.live for r in s.replicas) == replicas for s in info.stages)
            held: dict[str, Any] = dict.fromkeys(["coordinator_running", *HELD_METRICS], 0.0)
            if full:
                held["coordinator_running"] = _scrape(info.metrics_address).get(
                    "omnirail_requests_running", 0.0
                )
                where: dict[str, float] = Counter()
                for stage in info.stages:
                    for rep in stage.replicas:
                        m = _scrape(rep.metrics_address)
                        for key, metric in HELD_METRICS.items():
                            held[key] += m.get(metric, 0.0)
                            where[f"{stage.name}/{rep.replica_id} {key}"] += m.get(metric, 0.0)
            if (full and not any(held.values())) or time.monotonic() > deadline:
                held["all_replicas_live"] = full
                if full:
                    held["where"] = {k: v for k, v in where.items() if v}
                return held
            time.sleep(0.25)


def _orphan_segments(prefix: str, pids: set[int]) -> list[str]:
    """Shared-memory segments of this mesh whose process is gone."""
    orphans = []
    for name in os.listdir("/dev/shm"):
        if name.startswith(prefix + "-"):
            owner = name[len(prefix) + 1 :].split(".", 1)[0]
            if not owner.isdigit() or int(owner) not in pids:
                orphans.append(name)
    return sorted(orphans)


def run_chaos_bench(
    *,
    shape: str = "omni",
    requests: int = 10_000,
    concurrency: int = 32,
    abort_fraction: float = 0.3,
    deadline_fraction: float = 0.1,
    bad_fraction: float = 0.05,
    kill_every_s: float = 3.0,
    warmup: int | None = None,
    replicas: int = 2,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    from omnirail.ops.launcher import Mesh

    fractions = {"abort": abort_fraction, "deadline": deadline_fraction, "bad": bad_fraction}
    if any(not 0 <= f <= 1 for f in fractions.values()) or sum(fractions.values()) > 1:
        raise ValueError(
            "--abort-fraction, --deadline-fraction and --bad-fraction: each 0-1, sum <= 1"
        )
    if requests < 1 or concurrency < 1 or replicas < 1:
        raise ValueError("--requests, --concurrency and --replicas must be >= 1")
    say = progress or (lambda msg: None)
    warmup = min(1000, max(50, requests // 5)) if warmup is None else warmup
    with chaos_pipeline(shape, replicas) as path, Mesh(path, progress=progress) as mesh:
        assert mesh.address is not None
        say(f"warm-up: {warmup} requests")
        from omnirail.tuning import aio

        aio.run(_drive(mesh.address, shape, 0, warmup, concurrency, fractions, seed))
        _settle(mesh, replicas)
        rss_before = {name: rss_kib(pid) for name, pid in mesh.processes().items()}
        from omnirail.client.sdk import Client

        with Client(mesh.address) as client:
            coordinator_metrics = client.describe().metrics_address
        overrun_before = _buckets(coordinator_metrics, OVERRUN)
        pids_before = dict(mesh.processes())
        kills: list[str] = []
        stop = asyncio.Event()

        async def killer() -> None:
            rng = random.Random(seed + 1)
            while not stop.is_set():
                try:
                    await asyncio.wait_for(stop.wait(), kill_every_s)
                except TimeoutError:
                    victims = sorted(n for n in mesh.processes() if _spared(n) is False)
                    victim = rng.choice(victims)
                    pid = mesh.processes()[victim]
                    try:
                        os.kill(pid, signal.SIGKILL)
                        kills.append(victim)
                    except ProcessLookupError:
                        pass

        async def main() -> list[Outcome]:
            task = asyncio.get_running_loop().create_task(killer()) if kill_every_s > 0 else None
            try:
                return await _drive(
                    mesh.address or "", shape, warmup, requests, concurrency, fractions, seed + 2
                )
            finally:
                stop.set()
                if task is not None:
                    await task

        say(f"soak: {requests} requests, a replica killed every {kill_every_s:g}s")
        t0 = time.monotonic()
        outcomes = aio.run(main())
        soak_s = time.monotonic() - t0
        say("settling, then auditing")
        held = _settle(mesh, replicas)
        overrun = _bucket_quantiles(overrun_before, _buckets(coordinator_metrics, OVERRUN))
        time.sleep(0.5)  # a killed process's segments go as the launcher sees its exit
        pids_now = mesh.processes()
        orphans = _orphan_segments(mesh.shm_prefix, set(pids_now.values()))
        survivors = {n for n, pid in pids_before.items() if pids_now.get(n) == pid}
        rss_after = {n: rss_kib(pids_now[n]) for n in survivors}
    report = _report(
        shape,
        requests,
        concurrency,
        fractions,
        kill_every_s,
        warmup,
        soak_s,
        outcomes,
        kills,
        held,
        orphans,
        rss_before,
        rss_after,
    )
    # How late the coordinator's deadline timers fired (its loop's load), apart from the
    # client's round trip, which the client-side figure includes.
    report["coordinator_deadline_overrun"] = overrun
    return report


def _report(
    shape: str,
    requests: int,
    concurrency: int,
    fractions: dict[str, float],
    kill_every_s: float,
    warmup: int,
    soak_s: float,
    outcomes: list[Outcome],
    kills: list[str],
    held: dict[str, Any],
    orphans: list[str],
    rss_before: dict[str, int | None],
    rss_after: dict[str, int | None],
) -> dict[str, Any]:
    late = [o for o in outcomes if o.code != "HUNG" and o.elapsed_s > o.timeout_s + 1.0]
    deadline_lateness = sorted(
        (o.elapsed_s - o.timeout_s) * 1000 for o in outcomes if o.code == "DEADLINE_EXCEEDED"
    )
    growth = {}
    for name, after in rss_after.items():
        before = rss_before.get(name)
        if before and after:
            growth[name] = round((after - before) / before * 100, 2)
    by_kind: dict[str, dict[str, int]] = {}
    said: dict[str, str] = {}  # an example message per kind and error code
    for o in outcomes:
        by_kind.setdefault(o.kind, Counter())[o.code] += 1  # type: ignore[index]
        if o.message:
            said.setdefault(f"{o.kind} {o.code}", o.message[:200])
    report: dict[str, Any] = {
        "shape": shape,
        "requests": requests,
        "concurrency": concurrency,
        "fractions": fractions,
        "kill_every_s": kill_every_s,
        "warmup_requests": warmup,
        "soak_s": round(soak_s, 1),
        "requests_per_s": round(requests / soak_s, 1),
        "replica_kills": len(kills),
        "killed": dict(Counter(kills)),
        "outcomes": {k: dict(v) for k, v in sorted(by_kind.items())},
        "error_examples": dict(sorted(said.items())),
        "without_terminal_status": sum(o.code == "HUNG" for o in outcomes),
        "ended_after_deadline_plus_1s": len(late),
        "held_after": held,
        "orphan_segments": orphans,
        "rss_growth_pct": growth,
        "rss_growth_pct_max": max(growth.values(), default=0.0),
    }
    if deadline_lateness:
        report["deadline_error_after_deadline_ms"] = {
            "count": len(deadline_lateness),
            "p50": round(statistics.median(deadline_lateness), 1),
            "p99": round(
                deadline_lateness[
                    min(len(deadline_lateness) - 1, int(0.99 * len(deadline_lateness)))
                ],
                1,
            ),
            "max": round(deadline_lateness[-1], 1),
        }
    report["clean"] = (
        report["without_terminal_status"] == 0
        and not late
        and not orphans
        and held.get("all_replicas_live", False)
        and not any(v for k, v in held.items() if k not in ("all_replicas_live", "where"))
    )
    return report


if __name__ == "__main__":  # a quick look: python -m omnirail.bench.chaos_bench
    print(json.dumps(run_chaos_bench(requests=200, kill_every_s=2.0, progress=print), indent=2))
