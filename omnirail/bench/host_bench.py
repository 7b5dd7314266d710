"""`omnirail bench host`: the floors this machine sets under every mesh figure.

A request crosses processes several times, and each crossing wakes a sleeping process.
`wakeup_rtt_us` is the median round trip of one byte over a pair of pipes between two
processes: both pinned to one CPU, pinned to two, and left to the kernel. On a VM whose
idle vCPUs halt (`guest_halt_poll_ns` 0), crossing CPUs costs several times staying on one.

`python_loop_ns` is the median time of one iteration of a plain Python loop: how fast this
vCPU runs the interpreter right now. Most of a request's time is CPU spent in Python and
gRPC, so a host that runs it slower (a busy neighbour on a shared host) slows every mesh
figure with it; compare figures only between runs with similar values.

`idle_penalty_us` times one small piece of Python and numpy work (a `np.frombuffer` view,
reshaped) hot, and again right after 2 ms of sleep. On a VM whose idle vCPUs halt, the
host runs other work on the core meanwhile, and the first work after waking runs from cold
caches: every process in a sequential request wakes like that at each hop.

`memcpy_gbps` is what one copy reaches: `hot` between two warm buffers (the relay
benchmark's baseline), `rotating` into eight destinations in turn (what a relay writing
into pool extents that are still being read sees), and at 64 MiB one copy alone and two at
once on two threads (receiver-pulled relays copy twice, concurrently).

`polling_idle` repeats the cross-CPU wake-ups and the idle penalty while this process asks
that idle CPUs poll rather than halt (omnirail/cpu_latency.py; needs root).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from omnirail.bench.relay_bench import Memcpy
from omnirail.tuning import cpu_latency

MiB = 1 << 20
_HALTPOLL = Path("/sys/module/haltpoll/parameters/guest_halt_poll_ns")


def _echo(fd_in: int, fd_out: int) -> None:
    """Child side: sends back every byte it reads until the pipe closes."""
    while True:
        b = os.read(fd_in, 1)
        if not b:
            return
        os.write(fd_out, b)


def _rtt_us(parent_cpu: int, child_cpu: int, rounds: int) -> float:
    """Median pipe round trip; a cpu of -1 leaves that side where the kernel puts it."""
    child_in, to_child = os.pipe()
    from_child, child_out = os.pipe()
    echo = [str(child_in), str(child_out), str(child_cpu)]
    child = subprocess.Popen(
        [sys.executable, "-m", "omnirail.bench.host_bench", "--echo", *echo],
        pass_fds=(child_in, child_out),
    )
    os.close(child_in)
    os.close(child_out)
    before = os.sched_getaffinity(0)
    if parent_cpu >= 0:
        os.sched_setaffinity(0, {parent_cpu})
    try:
        times = []
        for _ in range(rounds + 100):  # the first hundred warm both sides up
            t0 = time.perf_counter()
            os.write(to_child, b"x")
            if os.read(from_child, 1) != b"x":
                raise RuntimeError("echo process answered wrongly")
            times.append(time.perf_counter() - t0)
        return statistics.median(times[100:]) * 1e6
    finally:
        os.sched_setaffinity(0, before)
        os.close(to_child)
        child.wait(timeout=10)
        os.close(from_child)


def _python_loop_ns(iterations: int = 200_000, runs: int = 7) -> float:
    """Median ns per iteration of `total += i` (runs of `iterations` each)."""
    times = []
    for _ in range(runs):
        total, t0 = 0, time.perf_counter()
        for i in range(iterations):
            total += i
        times.append((time.perf_counter() - t0) / iterations * 1e9)
    return statistics.median(times)


def _idle_penalty_us(rounds: int = 200, idle_s: float = 0.002) -> dict[str, float]:
    """Median µs of a small view-making step, back to back and after `idle_s` asleep."""
    buf = bytes(1 << 16)

    def step() -> float:
        t0 = time.perf_counter()
        np.frombuffer(buf, np.uint8, 1 << 12, 64).reshape(64, 64)
        return (time.perf_counter() - t0) * 1e6

    hot, cold = [], []
    for _ in range(rounds):
        step()
        hot.append(step())
        time.sleep(idle_s)
        cold.append(step())
    return {
        "hot": round(statistics.median(hot), 2),
        "after_2ms_idle": round(statistics.median(cold), 2),
    }


def _gbps(copy: Any, nbytes: int, secs: float) -> float:
    """Best GB/s of three windows of at least `secs` each."""
    best = 0.0
    for _ in range(3):
        n, t0 = 0, time.perf_counter()
        while n < 3 or time.perf_counter() - t0 < secs:
            copy(n)
            n += 1
        best = max(best, n * nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def _memcpy(secs: float) -> dict[str, Any]:
    hot = Memcpy(MiB)  # exactly the relay benchmark's baseline
    for _ in range(3):
        hot.measure(secs)
    dsts = [np.empty(MiB, np.uint8) for _ in range(8)]
    rotating = _gbps(lambda i: np.copyto(dsts[i % 8], hot.src), MiB, secs)
    big = [Memcpy(64 * MiB) for _ in range(2)]
    alone = _gbps(lambda i: np.copyto(big[0].dst, big[0].src), 64 * MiB, secs)
    results: list[float] = [0.0, 0.0]

    def copier(k: int) -> None:  # numpy releases the GIL while it copies
        results[k] = _gbps(lambda i: np.copyto(big[k].dst, big[k].src), 64 * MiB, secs)

    threads = [threading.Thread(target=copier, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {
        "1048576": {"hot": round(hot.best, 2), "rotating": round(rotating, 2)},
        "67108864": {
            "alone": round(alone, 2),
            "two_at_once_each": round(min(results), 2),
            "two_at_once_ratio": round(min(results) / alone, 3),
        },
    }


def run_host_bench(rounds: int = 2000, min_seconds: float = 0.3) -> dict[str, Any]:
    """Wake-up round trips and memcpy rates of this machine (see the module docstring)."""
    cpus = sorted(os.sched_getaffinity(0))
    rtt: dict[str, float | None] = {"same_cpu": round(_rtt_us(cpus[0], cpus[0], rounds), 1)}
    rtt["cross_cpu"] = _cross_cpu_rtt_us(cpus, rounds)
    rtt["unpinned"] = round(_rtt_us(-1, -1, rounds), 1)
    halt_poll = _HALTPOLL.read_text().strip() if _HALTPOLL.exists() else None
    report: dict[str, Any] = {
        "cpus": len(cpus),
        "guest_halt_poll_ns": None if halt_poll is None else int(halt_poll),
        "wakeup_rtt_us": rtt,
        "python_loop_ns": round(_python_loop_ns(), 1),
        "idle_penalty_us": _idle_penalty_us(),
    }
    report["polling_idle"] = _polling_idle(cpus, rounds)
    report["memcpy_gbps"] = _memcpy(min_seconds)
    return report


def _cross_cpu_rtt_us(cpus: list[int], rounds: int) -> float | None:
    return round(_rtt_us(cpus[0], cpus[1], rounds), 1) if len(cpus) > 1 else None


def _polling_idle(cpus: list[int], rounds: int) -> dict[str, Any]:
    """The same wake-up and idle figures while idle CPUs poll (a 0 µs wake-latency
    request, what `bench pipeline`/`relay` hold by default): their gap to the figures
    above is what halting idle CPUs cost on this host."""
    hold, wake = cpu_latency.report(0)
    if hold is None:
        return wake
    with hold:
        return {
            **wake,
            "wakeup_rtt_us": {
                "cross_cpu": _cross_cpu_rtt_us(cpus, rounds),
                "unpinned": round(_rtt_us(-1, -1, rounds), 1),
            },
            "idle_penalty_us": _idle_penalty_us(),
        }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--echo", nargs=3, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.echo:
        fd_in, fd_out, cpu = args.echo
        if cpu >= 0:
            os.sched_setaffinity(0, {cpu})
        _echo(fd_in, fd_out)
        return
    print(json.dumps(run_host_bench(), indent=2))


if __name__ == "__main__":
    main()
