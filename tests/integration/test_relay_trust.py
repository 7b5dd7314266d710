"""Relay descriptors bound to their sender, against a hostile mesh member (issue 37).

A real mesh (processes, TLS and a mesh secret from `tls="auto"`, shm relays) and a real
process that holds everything a member holds (the mesh secret and certificate, the same
user id) and joins through Attach (tests/integration/hostile_member.py). What it Delivers
to a stage, naming another edge's extent, another sender's segment (even with a grant
forged into that sender's marks), a guessed or stale transfer id, or another member's
identity, fails with a typed error and reads nothing, and the mesh keeps serving.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

from omnirail.client.sdk import Client
from omnirail.ops.launcher import Mesh
from omnirail.relay.shm import sweep_segments
from omnirail.wire.errors import Code
from tests.integration.conftest import PIPELINES, REPO

LINEAR = PIPELINES / "linear.yaml"


@pytest.fixture(scope="module")
def mesh() -> Iterator[Mesh]:
    mesh = Mesh(LINEAR, transport="tcp", tls="auto")
    mesh.start(timeout=240)
    yield mesh
    mesh.stop()


def client(mesh: Mesh) -> Client:
    return Client(mesh.address or "", timeout=60, **mesh.client_options())


def test_a_hostile_member_reads_nothing_and_the_mesh_serves_on(mesh: Mesh) -> None:
    with client(mesh) as c:
        assert c.generate({"n": 100_000}).output["n"] == 100_000  # relayed: segments exist
    prefix = f"omnirail-hostile-{uuid.uuid4().hex[:6]}"
    env = {**mesh._child_env(), "PYTHONPATH": str(REPO)}
    try:
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "tests.integration.hostile_member",
                "--pipeline",
                str(LINEAR),
                "--coordinator",
                mesh.address or "",
                "--as-stage",
                "source",
                "--victim",
                "double",
                "--prefix",
                prefix,
            ],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=180,
        )
    finally:
        sweep_segments(prefix)
    assert run.returncode == 0, run.stderr[-4000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    bad = Code.INVALID_ARGUMENT
    # a: its own transfer id over another of its edges' extents.
    assert results["a"]["code"] == bad, results
    assert "not the extent its transfer_id was granted" in results["a"]["message"]
    # b: another sender's segment; a grant forged into that sender's marks does not help.
    assert results["b"]["code"] == bad, results
    assert "did not announce, and the sender did not hand" in results["b"]["message"]
    assert not results["b_marked"]
    # c: a guessed id, and a stale one of its own.
    assert results["c"]["code"] == bad, results
    assert "not a live transfer" in results["c"]["message"]
    assert not results["c_marked"]
    assert "not a live transfer" in results["c_stale"]["message"], results
    # d: another member's name with a token of its own making, and a name nobody has.
    assert results["d"]["status"] == "UNAUTHENTICATED", results
    assert "wrong member token" in results["d"]["details"]
    assert results["d_unknown"]["status"] == "UNAUTHENTICATED", results
    assert "not a member" in results["d_unknown"]["details"]
    for case in ("a", "b", "c", "c_stale"):
        assert results[case]["message"].startswith("bad payload from source: "), results[case]
    # The mesh serves on, relayed payloads included; no token reached a log.
    with client(mesh) as c:
        for n in (3, 100_000):
            assert c.generate({"n": n}).output["n"] == n
    logs = "".join(p.read_text(errors="replace") for p in (mesh.run_dir / "logs").glob("*.log"))
    assert "member_token" not in logs
