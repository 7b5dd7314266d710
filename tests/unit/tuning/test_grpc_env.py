"""gRPC's I/O path is chosen before grpc loads (fresh interpreters, so nothing leaks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from omnirail.tuning.grpc_env import EXPERIMENTS_ENV, POSIX_IO

REPO = Path(__file__).resolve().parents[3]

PROBE = """
import json, os, sys
import omnirail.cli
before = "grpc" in sys.modules
applied = omnirail.cli.prefer_posix_io()
import grpc
print(json.dumps({"grpc_before": before, "applied": applied,
                  "value": os.environ.get("GRPC_EXPERIMENTS")}))
"""


def _probe(env: dict[str, str]) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _env_without_setting() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != EXPERIMENTS_ENV}


def test_entry_sets_posix_io_before_grpc_is_imported() -> None:
    report = _probe(_env_without_setting())
    # If anything on the entry's import path pulled grpc in, the setting would be ignored.
    assert report == {"grpc_before": False, "applied": True, "value": POSIX_IO}


def test_a_value_the_user_set_is_kept() -> None:
    for value in ("", "event_engine_client"):
        report = _probe({**_env_without_setting(), EXPERIMENTS_ENV: value})
        assert report["value"] == value


def test_too_late_once_grpc_is_loaded(monkeypatch) -> None:
    import grpc  # noqa: F401  (this process has it loaded, as a library user might)

    from omnirail.tuning.grpc_env import prefer_posix_io

    monkeypatch.delenv(EXPERIMENTS_ENV, raising=False)
    assert prefer_posix_io() is False
    assert os.environ[EXPERIMENTS_ENV] == POSIX_IO  # still passed on to child processes
