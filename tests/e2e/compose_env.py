"""The container side of the compose e2e test: podman, the image, docker-compose.

`prepare()` runs the repository's own scripts (podman and its API socket, the debootstrap
base image, the wheelhouse, the omnirail image and the Jaeger/Prometheus stand-ins; each
skips work already done) and returns the environment for docker-compose. `Project` drives
one compose project and always tears it down, even after a failed test.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts" / "container"


class SetupError(RuntimeError):
    pass


def why_unavailable() -> str | None:
    """Why this machine cannot run the compose test at all (None: it can try)."""
    if os.geteuid() != 0:
        return "the compose test installs podman with apt and needs root"
    if shutil.which("apt-get") is None:
        return "the compose test installs podman from Debian packages (no apt-get here)"
    return None


def _run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 1800) -> str:
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        raise SetupError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout


def prepare() -> dict[str, str]:
    """Podman, the image and the stand-ins; returns os.environ plus DOCKER_HOST."""
    line = _run([str(SCRIPTS / "podman.sh")]).strip().splitlines()[-1]
    if not line.startswith("export DOCKER_HOST="):
        raise SetupError(f"podman.sh printed {line!r}, not an export line")
    env = {**os.environ, "DOCKER_HOST": line.removeprefix("export DOCKER_HOST=")}
    _run([str(SCRIPTS / "build_image.sh")], env)
    _run([str(SCRIPTS / "standin_images.sh")], env)
    return env


class Project:
    """`docker-compose -p NAME -f docker-compose.yml ...` from the repository root."""

    def __init__(self, name: str, env: dict[str, str], compose_file: Path) -> None:
        self.name = name
        self.env = env
        self.file = compose_file

    def compose(self, *args: str, timeout: float = 300, check: bool = True) -> str:
        cmd = ["docker-compose", "-p", self.name, "-f", str(self.file), *args]
        proc = subprocess.run(
            cmd, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
        return proc.stdout + proc.stderr

    def podman(self, *args: str, timeout: float = 60) -> str:
        return _run(["podman", *args], self.env, timeout)

    def containers(self) -> list[str]:
        out = self.podman(
            "ps",
            "-a",
            "--filter",
            f"label=com.docker.compose.project={self.name}",
            "--format",
            "{{.Names}}",
        )
        return [n for n in out.split() if n]

    def networks(self) -> list[str]:
        out = self.podman("network", "ls", "--format", "{{.Name}}")
        return [n for n in out.split() if n.startswith(self.name)]

    def down(self) -> None:
        """Podman removes an IPC owner only after its sharers: a first pass may fail."""
        for _ in range(3):
            self.compose("down", "-v", "--timeout", "10", check=False, timeout=180)
            if not self.containers() and not self.networks():
                return
            time.sleep(1)

    def logs(self) -> str:
        return self.compose("logs", "--no-color", "--tail", "80", check=False)


@contextmanager
def running(
    project: Project, address: str, ready_timeout: float = 300, **client: Any
) -> Iterator[Project]:
    """`docker-compose up -d` from the built image, until every stage has attached at
    `address` (`client`: the Client's TLS and token for a secured deployment); afterwards
    (or on any failure, with the logs printed) `down`, and no container or network of the
    project may be left."""
    from omnirail import Client

    try:
        project.compose("up", "-d", "--no-build", timeout=600)
        with Client(address, timeout=60, **client) as ready:
            ready.wait_ready(timeout=ready_timeout)
        yield project
    except BaseException:
        print(project.logs())
        raise
    finally:
        project.down()
        assert project.containers() == [], "containers left after docker-compose down"
        assert project.networks() == [], "networks left after docker-compose down"


def http_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return json.loads(reply.read())


def wait_for(check: Any, timeout: float, what: str, interval: float = 0.5) -> Any:
    """Polls `check()` until it returns a truthy value; raises naming `what`."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except Exception as exc:  # not up yet
            last = exc
        time.sleep(interval)
    raise TimeoutError(
        f"{what} within {timeout:.0f} s" + (f" (last error: {last})" if last else "")
    )
