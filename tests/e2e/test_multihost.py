"""Stages on different hosts (network namespaces), tensors over nixl and ucx between them.

Host 0 runs the coordinator and the client, host 1 the `source` and `sink` stages, host 2
the `middle` stage; every process binds to its host's own address. Edge source->middle
uses nixl, middle->sink ucx (per-edge `relay_to`), and payloads are far above the inline
bound, so every tensor crosses hosts through a relay.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.e2e.multihost_stages import expected
from tests.e2e.netns import Host, NetnsUnavailable, Network

ROOT = Path(__file__).resolve().parents[2]
NBYTES = 3 << 20
START_TIMEOUT = 180.0
GENERATE_TIMEOUT = 90.0
# The test's own deadlines (start-up, each generate) fire first and print every process's
# log; pytest's limit is only the backstop.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _missing(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None


@pytest.fixture(scope="module")
def network() -> Iterator[Network]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CAP_SYS_ADMIN and CAP_NET_ADMIN)")
    try:
        net = Network.create(3)
    except NetnsUnavailable as e:
        pytest.skip(f"network namespaces cannot be made here: {e}")
    try:
        yield net
    finally:
        net.destroy()


def _pipeline(path: Path, hosts: list[Host], error_mode: str) -> None:
    cross = {"ucx_error_handling_mode": error_mode}
    cfg = {
        "name": "multihost",
        "relay": {"backend": "shm", "inline_bytes": 4096},
        "metrics": {"enabled": False},
        "endpoints": {"transport": "tcp"},
        "stages": [
            {
                "name": "source",
                "factory": "tests.e2e.multihost_stages:make_source",
                "factory_args": {"nbytes": NBYTES},
                "next": "middle",
                "relay_to": {"middle": {"backend": "nixl", "options": cross}},
            },
            {
                "name": "middle",
                "factory": "tests.e2e.multihost_stages:make_middle",
                "next": "sink",
                # UCX sees one machine and would pick shared-memory transports, whose
                # signalling does not cross network namespaces (docs/guides/relays.md): use TCP, as
                # between real hosts. (ucx has no ucx_error_handling_mode: its endpoints
                # always use peer error handling.)
                "relay_to": {"sink": {"backend": "ucx", "options": {"ucx_config": {"TLS": "tcp"}}}},
            },
            {
                "name": "sink",
                "factory": "tests.e2e.multihost_stages:make_sink",
                "terminal": True,
            },
        ],
    }
    path.write_text(yaml.safe_dump(cfg))


class _Processes:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.env = dict(os.environ, PYTHONPATH=str(ROOT), OTEL_TRACES_EXPORTER="none")

    def start(self, name: str, host: Host, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / f"{name}.log", "wb")
        proc = subprocess.Popen(
            [*host.wrap(), sys.executable, "-m", "omnirail", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=self.env,
        )
        log.close()
        self.procs.append((name, proc))
        return proc

    def logs(self) -> str:
        return "\n".join(
            f"--- {name}\n" + (self.log_dir / f"{name}.log").read_text(errors="replace")[-3000:]
            for name, _ in self.procs
        )

    def stop(self) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for _, proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("error_mode", ["peer"])
def test_tensors_cross_hosts_over_nixl_and_ucx(
    network: Network, tmp_path: Path, error_mode: str
) -> None:
    for module in ("nixl_cu12", "ucxx"):
        if _missing(module) and not (module == "nixl_cu12" and not _missing("nixl")):
            pytest.skip(f"{module} is not installed (pip install 'omnirail[nixl,ucx]')")
    h0, h1, h2 = network.hosts
    pipeline = tmp_path / "pipeline.yaml"
    _pipeline(pipeline, network.hosts, error_mode)
    ready = tmp_path / "coordinator.addr"
    procs = _Processes(tmp_path)
    prefix = f"mh{uuid.uuid4().hex[:8]}"
    try:
        coordinator = procs.start(
            "coordinator",
            h0,
            [
                *("coordinator", "--pipeline", str(pipeline)),
                *("--listen", f"{h0.address}:0", "--ready-file", str(ready)),
            ],
        )
        deadline = time.monotonic() + START_TIMEOUT
        while not (ready.exists() and ready.read_text().strip()):
            assert coordinator.poll() is None, procs.logs()
            assert time.monotonic() < deadline, "coordinator did not start\n" + procs.logs()
            time.sleep(0.1)
        address = ready.read_text().strip()
        assert address.startswith(h0.address), address
        for stage, host in (("source", h1), ("sink", h1), ("middle", h2)):
            procs.start(
                f"stage-{stage}",
                host,
                [
                    *("stage", "--pipeline", str(pipeline), "--stage", stage),
                    *("--coordinator", address, "--listen", f"{host.address}:0"),
                    *("--shm-prefix", f"{prefix}{stage}"),
                ],
            )
        for seed in (1, 2, 3):
            out = _generate(h0, address, seed, procs, deadline)
            assert out == {"sink": expected(seed, NBYTES)}, procs.logs()
        for name, proc in procs.procs:
            assert proc.poll() is None, f"{name} exited\n" + procs.logs()
    finally:
        procs.stop()


def _generate(
    host: Host, address: str, seed: int, procs: _Processes, deadline: float
) -> dict[str, object]:
    """Runs `omnirail generate` on `host`; retries while the stages are still starting."""
    while True:
        try:
            proc = subprocess.run(
                [
                    *(*host.wrap(), sys.executable, "-m", "omnirail", "generate"),
                    *("--address", address, "--input", json.dumps({"seed": seed})),
                    *("--timeout", "60"),
                ],
                capture_output=True,
                text=True,
                cwd=ROOT,
                env=procs.env,
                timeout=GENERATE_TIMEOUT,
            )
        except subprocess.TimeoutExpired as exc:
            # The client gives up after 60 s: one still running later is hung. Say where.
            raise AssertionError(
                f"generate hung for {GENERATE_TIMEOUT}s; its stderr: {exc.stderr!r}\n"
                + procs.logs()
            ) from None
        if proc.returncode == 0:
            return json.loads(proc.stdout)
        exited = [name for name, p in procs.procs if p.poll() is not None]
        starting = "no live replica" in proc.stderr and not exited
        if not starting or time.monotonic() > deadline:
            raise AssertionError(f"generate failed: {proc.stderr}\n{procs.logs()}")
        time.sleep(0.5)
