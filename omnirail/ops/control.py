"""Commands to a running `omnirail up` from other processes (`omnirail restart`).

A command is a JSON file in the mesh's run directory, `control/<id>.json`; the launcher
polls that folder, takes a file by renaming it (so it runs once), runs the command on a
thread and writes its answer to `control/<id>.done` (written whole, then renamed). Files
only: the run directory is the launcher's and its user's, so whoever can write there may
command the mesh, and nobody else.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any]], dict[str, Any]]


def control_dir(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / "control"


def submit(
    run_dir: str | os.PathLike[str], command: dict[str, Any], timeout: float
) -> dict[str, Any]:
    """Hands `command` to the launcher of the mesh in `run_dir` and waits for its answer
    (a dict with "ok" and "message"); raises TimeoutError when none comes."""
    folder = control_dir(run_dir)
    folder.mkdir(exist_ok=True)
    cid = uuid.uuid4().hex
    _write_whole(folder / f"{cid}.json", command)
    done = folder / f"{cid}.done"
    deadline = time.monotonic() + timeout
    while not done.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the mesh's launcher did not answer within {timeout:g}s")
        time.sleep(0.1)
    answer = json.loads(done.read_text())
    done.unlink(missing_ok=True)
    return answer


def serve_pending(run_dir: str | os.PathLike[str], handler: Handler) -> list[threading.Thread]:
    """Starts a thread for each command waiting in `run_dir` (called from the launcher's
    loop); each writes `handler(command)`'s answer, or the error it raised."""
    folder = control_dir(run_dir)
    if not folder.is_dir():
        return []
    started = []
    for path in sorted(folder.glob("*.json")):
        taken = path.with_suffix(".taken")
        try:
            path.rename(taken)
        except FileNotFoundError:
            continue
        thread = threading.Thread(target=_run, args=(taken, handler), daemon=True)
        thread.start()
        started.append(thread)
    return started


def _run(taken: Path, handler: Handler) -> None:
    try:
        command = json.loads(taken.read_text())
        if not isinstance(command, dict):
            raise ValueError("a command is a JSON object")
        answer = handler(command)
    except Exception as exc:  # the answer says what went wrong; the launcher goes on
        log.warning("control command %s failed: %s", taken.name, exc)
        answer = {"ok": False, "message": f"{type(exc).__name__}: {exc}"}
    _write_whole(taken.with_suffix(".done"), answer)
    taken.unlink(missing_ok=True)


def _write_whole(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
