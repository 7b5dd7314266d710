"""CPU affinity of mesh processes: `cpus:` in the pipeline, `--cpus` and `--pin` flags.

A service's threads hand every message to each other (grpc.aio's poller thread wakes the
event loop; the loop wakes the scheduler thread and back). Across CPUs each of those
wake-ups is an inter-processor interrupt, which on small VMs costs tens of microseconds;
on one CPU it is a plain context switch. Pinning each process to its own CPU(s) keeps
those hand-offs local while the processes still run in parallel.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

__all__ = ["CpuError", "available_cpus", "format_cpus", "parse_cpus", "pin_process", "spread"]


class CpuError(ValueError):
    """A CPU list that cannot be parsed or applied."""


# Linux builds for at most 8,192 CPUs (NR_CPUS with x86-64 MAXSMP); checked before a range
# is expanded, so "0-20000000" costs nothing (omnirail.config.limits says the same).
MAX_CPU_ID = 8191


def parse_cpus(text: str) -> list[int]:
    """CPU ids from a list like `taskset -c` takes: "0", "0,2", "0-3,6"."""
    cpus: set[int] = set()
    if len(text) > 65536:
        raise CpuError(f"bad CPU list: {len(text)} characters")
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise CpuError(f"bad CPU list {text[:80]!r}: empty item")
        lo, sep, hi = part.partition("-")
        try:
            first = int(lo)
            last = int(hi) if sep else first
        except ValueError:
            raise CpuError(
                f"bad CPU list {text[:80]!r}: {part[:40]!r} is not a CPU id or range"
            ) from None
        if first < 0 or last < first:
            raise CpuError(f"bad CPU list {text[:80]!r}: {part[:40]!r} is not a CPU id or range")
        if last > MAX_CPU_ID:
            raise CpuError(f"bad CPU list {text[:80]!r}: CPU ids go up to {MAX_CPU_ID}")
        cpus.update(range(first, last + 1))
    return sorted(cpus)


def format_cpus(cpus: Iterable[int]) -> str:
    return ",".join(str(c) for c in sorted(set(cpus)))


def available_cpus() -> list[int]:
    """The CPUs this process may run on (a container or taskset may allow fewer than all)."""
    return sorted(os.sched_getaffinity(0))


def pin_process(cpus: Iterable[int]) -> list[int]:
    """Restricts every thread of this process (and threads it starts later) to `cpus`.

    Raises CpuError naming the CPUs this process may not use. Returns the CPUs pinned to.
    """
    wanted = sorted(set(cpus))
    if not wanted:
        raise CpuError("an empty CPU list would leave the process nowhere to run")
    allowed = set(available_cpus())
    missing = [c for c in wanted if c not in allowed]
    if missing:
        raise CpuError(
            f"CPU(s) {format_cpus(missing)} not available to this process "
            f"(it may use {format_cpus(allowed)})"
        )
    # Threads already running (grpc's, the metrics server's) keep their own mask unless
    # set one by one; threads started later inherit the caller's. Without /proc: the
    # calling thread (0) alone.
    for tid in _thread_ids():
        try:
            os.sched_setaffinity(tid, wanted)
        except ProcessLookupError:
            pass  # the thread ended meanwhile
    return wanted


def _thread_ids() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def spread(processes: Sequence[str], cpus: Sequence[int]) -> dict[str, list[int]]:
    """One CPU per process, round-robin over `cpus` in order (what `--pin` does)."""
    if not cpus:
        raise CpuError("no CPUs to spread the processes over")
    return {name: [cpus[i % len(cpus)]] for i, name in enumerate(processes)}
