"""The PM QoS wake-latency request: what it writes, how it fails, when it is let go."""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path

import pytest

from omnirail.tuning import cpu_latency
from omnirail.tuning.cpu_latency import CpuLatencyError, CpuWakeLatency, check_us

_REAL = cpu_latency.available()


@pytest.mark.parametrize("us", [0, 1, cpu_latency.MAX_US])
def test_bounds_the_kernel_takes(us: int) -> None:
    assert check_us(us) == us


@pytest.mark.parametrize("bad", [-1, cpu_latency.MAX_US + 1, True, 1.5, "0", None])
def test_other_values_are_refused_by_name(bad: object) -> None:
    with pytest.raises(ValueError, match="cpu wake latency must be"):
        check_us(bad)


def test_writes_one_native_int32_and_keeps_the_file_open_until_released(tmp_path: Path) -> None:
    # A plain file stands in for the device: the request is the 4 bytes written to it.
    device = tmp_path / "cpu_dma_latency"
    device.write_bytes(b"")
    hold = CpuWakeLatency(37, device=str(device))
    assert hold.held and device.read_bytes() == struct.pack("=i", 37)
    fd = hold._fd
    assert fd is not None and os.readlink(f"/proc/self/fd/{fd}") == str(device)
    hold.release()
    assert not hold.held and not os.path.exists(f"/proc/self/fd/{fd}")
    hold.release()  # twice is harmless


def test_with_block_releases(tmp_path: Path) -> None:
    device = tmp_path / "qos"
    device.write_bytes(b"")
    with CpuWakeLatency(0, device=str(device)) as hold:
        assert hold.held
    assert not hold.held


def test_a_missing_device_is_named(tmp_path: Path) -> None:
    with pytest.raises(CpuLatencyError, match="does not exist"):
        CpuWakeLatency(0, device=str(tmp_path / "nope"))


def test_a_device_that_cannot_be_written_is_named(tmp_path: Path) -> None:
    with pytest.raises(CpuLatencyError, match="cannot open"):
        CpuWakeLatency(0, device=str(tmp_path))  # a directory


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write any file")
def test_no_permission_says_what_it_needs(tmp_path: Path) -> None:
    device = tmp_path / "qos"
    device.write_bytes(b"")
    device.chmod(0o400)
    with pytest.raises(CpuLatencyError, match="needs root"):
        CpuWakeLatency(0, device=str(device))


def test_hold_or_warn_warns_and_goes_on(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert cpu_latency.hold_or_warn(None, "stage process a") is None
    with caplog.at_level(logging.WARNING, logger="omnirail.tuning.cpu_latency"):
        assert cpu_latency.hold_or_warn(5, "stage process a", str(tmp_path / "nope")) is None
    assert "stage process a: cpu_wake_latency_us 5 not applied" in caplog.text
    assert "does not exist" in caplog.text


def test_available_tries_the_device(tmp_path: Path) -> None:
    assert not cpu_latency.available(str(tmp_path / "nope"))
    device = tmp_path / "qos"
    device.write_bytes(b"")
    assert cpu_latency.available(str(device))


def test_report_says_what_was_held(tmp_path: Path) -> None:
    assert cpu_latency.report(None) == (None, {"requested_us": None, "held": False})
    hold, wake = cpu_latency.report(0, str(tmp_path / "nope"))
    assert hold is None and wake["held"] is False and "does not exist" in wake["error"]
    device = tmp_path / "qos"
    device.write_bytes(b"")
    hold, wake = cpu_latency.report(3, str(device))
    assert hold is not None and wake == {"requested_us": 3, "held": True}
    hold.release()


@pytest.mark.skipif(not _REAL, reason=f"{cpu_latency.DEVICE} cannot be held here")
def test_the_kernel_applies_the_bound_while_held() -> None:
    with CpuWakeLatency(0):
        assert cpu_latency.current_us() == 0
    # Another process may hold a bound of its own; ours at least no longer counts.
    with CpuWakeLatency(123):
        assert cpu_latency.current_us() <= 123
