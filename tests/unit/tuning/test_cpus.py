"""CPU lists, pinning and the round-robin spread behind `--pin`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from omnirail.tuning.cpus import (
    CpuError,
    available_cpus,
    format_cpus,
    parse_cpus,
    pin_process,
    spread,
)


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("0", [0]), ("2,0", [0, 2]), ("0-3,6", [0, 1, 2, 3, 6]), (" 1 , 1-2 ", [1, 2])],
)
def test_parse_cpus(text, cpus):
    assert parse_cpus(text) == cpus


@pytest.mark.parametrize("text", ["", "a", "0,,1", "3-1", "-1", "1-", "0-x"])
def test_parse_cpus_rejects_bad_lists(text):
    with pytest.raises(CpuError, match="bad CPU list"):
        parse_cpus(text)


def test_format_cpus():
    assert format_cpus([3, 1, 1]) == "1,3"


def test_spread_is_one_cpu_each_round_robin():
    assert spread(["a", "b", "c"], [4, 7]) == {"a": [4], "b": [7], "c": [4]}
    assert spread([], [0]) == {}
    with pytest.raises(CpuError):
        spread(["a"], [])


def test_pin_process_refuses_cpus_it_may_not_use():
    allowed = available_cpus()
    with pytest.raises(CpuError, match=r"CPU\(s\) 100000 not available .* may use"):
        pin_process([100000])
    with pytest.raises(CpuError, match="empty"):
        pin_process([])
    assert available_cpus() == allowed  # nothing changed


def test_pin_process_covers_threads_started_before_and_after():
    # In a child, so the test process keeps its CPUs.
    code = """
import os, threading, time
from omnirail.tuning.cpus import pin_process
cpu = min(os.sched_getaffinity(0))
stop = threading.Event()
early = threading.Thread(target=stop.wait); early.start()
pin_process([cpu])
late = threading.Thread(target=stop.wait); late.start()
masks = {int(t): os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")}
stop.set()
print(len(masks), all(m == {cpu} for m in masks.values()))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    assert out == ["3", "True"]


def test_available_cpus_is_this_process_mask():
    assert available_cpus() == sorted(os.sched_getaffinity(0))


def test_a_huge_range_is_refused_before_it_is_expanded() -> None:
    with pytest.raises(CpuError, match="CPU ids go up to 8191"):
        parse_cpus("0-20000000")
    with pytest.raises(CpuError, match="characters"):
        parse_cpus("0," * 40000)
