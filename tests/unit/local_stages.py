"""Stages for tests on `LocalMesh`: the mesh runs in the test's process, so a test holds a
request at a stage with a `threading.Event` and sees what each stage did.

A request's inputs may say `{"hold": {"b": "key"}}`: stage `b` then waits, inside its
compute, until the test releases gate "key" (`gate(key)` makes one).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Gate:
    entered: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    # How many computes passed the gate (a request that runs again passes twice).
    passed: int = 0


GATES: dict[str, Gate] = {}
# (stage, request tag) of every compute that ran, for requests whose inputs carry a "tag".
CALLS: list[tuple[str, str]] = []
HOLD_LIMIT_S = 30.0  # a test that forgets to release does not hang the suite


def gate(key: str) -> Gate:
    GATES[key] = found = Gate()
    return found


def make_stage(name: str) -> Any:
    """A stage that appends its name to the payload's `path` (the entry stage starts the
    path from the request's inputs), holding at a gate when the request asks."""

    def fn(payload: dict[str, Any]) -> dict[str, Any]:
        if "tag" in payload:
            CALLS.append((name, payload["tag"]))
        key = payload.get("hold", {}).get(name)
        if key is not None:
            held = GATES[key]
            held.passed += 1
            held.entered.set()
            held.release.wait(HOLD_LIMIT_S)
        if payload.get("fail") == name:
            raise ValueError(f"{name} was asked to fail")
        return {**payload, "path": [*payload.get("path", []), name]}

    return fn


def merge_paths(arrived: dict[str, Any]) -> dict[str, Any]:
    """Fan-in: one payload whose path lists each branch's path, in source order."""
    first = next(iter(arrived.values()))
    return {**first, "path": [list(p["path"]) for p in arrived.values()], "from": list(arrived)}


def stage(name: str, **settings: Any) -> dict[str, Any]:
    """A pipeline entry for `make_stage(name)`."""
    return {
        "name": name,
        "factory": "tests.unit.local_stages:make_stage",
        "factory_args": {"name": name},
        **settings,
    }


def make_broken(why: str) -> Any:
    """A factory that fails, as one whose weights are missing does."""
    raise RuntimeError(why)
