"""`omnirail health` (the container HEALTHCHECK) against a real coordinator process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from omnirail.ops.health import HealthCheckError, check_health

REPO = Path(__file__).resolve().parents[2]
PIPELINE = "examples/quickstart/pipeline.yaml"
PIPELINE_SERVICE = "omnirail.v1.Omnirail"  # as written on the wire, not imported


def health(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "omnirail", "health", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A lone coordinator (no stages): the server serves, the pipeline does not."""
    ready = tmp_path_factory.mktemp("health") / "coordinator.addr"
    log = ready.with_name("coordinator.log")
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "omnirail",
                "coordinator",
                "--pipeline",
                PIPELINE,
                "--listen",
                "127.0.0.1:0",
                "--ready-file",
                str(ready),
                "--metrics-port",
                "-1",
            ],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        deadline = time.monotonic() + 120
        while not (ready.exists() and ready.read_text()):
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "coordinator not ready:\n" + log.read_text()
            time.sleep(0.05)
        yield ready.read_text().strip()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_healthy_address_exits_0(coordinator: str) -> None:
    proc = health("--address", coordinator)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    check_health(coordinator)  # the function returns quietly too


def test_address_from_env(coordinator: str) -> None:
    # The image's HEALTHCHECK runs `omnirail health` with no flags.
    proc = health(env={"OMNIRAIL_HEALTH_ADDRESS": coordinator})
    assert proc.returncode == 0, proc.stderr


def test_unreachable_exits_1_with_one_line() -> None:
    address = f"127.0.0.1:{free_port()}"
    proc = health("--address", address, "--timeout", "3")
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert address in lines[0] and "unreachable" in lines[0], lines[0]
    with pytest.raises(HealthCheckError) as info:
        check_health(address, timeout=3)
    assert info.value.reason == "unreachable"


def test_unreachable_unix_socket(tmp_path: Path) -> None:
    proc = health("--address", f"unix://{tmp_path}/none.sock", "--timeout", "3")
    assert proc.returncode == 1
    assert "unreachable" in proc.stderr


def test_not_serving_service(coordinator: str) -> None:
    # No stage registered: the coordinator reports the pipeline service NOT_SERVING.
    proc = health("--address", coordinator, "--service", PIPELINE_SERVICE)
    assert proc.returncode == 1
    assert proc.stderr.strip().endswith("NOT_SERVING"), proc.stderr
    with pytest.raises(HealthCheckError) as info:
        check_health(coordinator, PIPELINE_SERVICE)
    assert info.value.reason == "not_serving"


def test_unknown_service(coordinator: str) -> None:
    proc = health("--address", coordinator, "--service", "no.such.Service")
    assert proc.returncode == 1
    assert "unknown service" in proc.stderr, proc.stderr
    with pytest.raises(HealthCheckError) as info:
        check_health(coordinator, "no.such.Service")
    assert info.value.reason == "unknown_service"
