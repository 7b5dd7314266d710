"""CPU seconds per process, as `omnirail bench omni` reports them (`cpu_s_per_request`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from omnirail.bench import cpu_seconds
from omnirail.bench.omni_bench import _CpuMeter

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")


def spin(seconds: float) -> None:
    """Uses about `seconds` of this process's CPU time."""
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_cpu_seconds_follows_this_process() -> None:
    before, clock = cpu_seconds(os.getpid()), time.process_time()
    spin(0.3)
    used, measured = cpu_seconds(os.getpid()) - before, time.process_time() - clock
    # /proc counts in clock ticks (10 ms here): within two of the precise clock.
    assert used == pytest.approx(measured, abs=2.5 / os.sysconf("SC_CLK_TCK"))


def test_cpu_seconds_of_a_gone_process_is_none() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert cpu_seconds(child.pid) is None


def test_meter_sums_measured_spans_per_process() -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.2)  # past the interpreter's start, which costs CPU
        meter = _CpuMeter({"sleeper": sleeper.pid})
        for _ in range(2):
            with meter.measure():
                spin(0.15)
        spin(0.2)  # outside any span: not counted
        assert meter.used["client"] == pytest.approx(0.3, abs=0.05)
        assert meter.used["sleeper"] < 0.03
        per = meter.per_request(3)
        assert list(per) == ["client", "sleeper"]
        assert per["client"] == pytest.approx(meter.used["client"] / 3, abs=1e-4)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_meter_skips_a_process_that_is_gone() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    meter = _CpuMeter({"gone": child.pid})
    with meter.measure():
        spin(0.01)
    assert list(meter.used) == ["client"]
