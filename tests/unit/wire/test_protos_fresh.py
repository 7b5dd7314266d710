"""The committed gRPC stubs in omnirail/v1/ match what scripts/gen_protos.sh generates."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
COMMITTED = REPO / "omnirail" / "v1"
HINT = "generated stubs are stale; run scripts/gen_protos.sh and commit omnirail/v1/"

# Probed, not imported: grpc_tools' bundled protobuf/abseil clash with nixl's native
# libraries when both load into one process (nixl then aborts the test run on import).
if importlib.util.find_spec("grpc_tools") is None:
    pytest.skip(
        "grpc_tools is not importable (install the dev extra: grpcio-tools)",
        allow_module_level=True,
    )


def _generated_files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("bash") is None:
        pytest.skip("bash is needed to run scripts/gen_protos.sh")
    out = tmp_path_factory.mktemp("protos") / "out"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "gen_protos.sh"), str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"scripts/gen_protos.sh failed:\n{proc.stdout}\n{proc.stderr}"
    generated = out / "omnirail" / "v1"
    assert generated.is_dir(), f"scripts/gen_protos.sh wrote nothing under {generated}"
    return generated


def test_generated_files_match_committed(regenerated: Path) -> None:
    fresh = _generated_files(regenerated)
    assert fresh, "scripts/gen_protos.sh generated no files"
    missing = sorted(name for name in fresh if not (COMMITTED / name).is_file())
    differ = sorted(
        name
        for name, data in fresh.items()
        if (COMMITTED / name).is_file() and (COMMITTED / name).read_bytes() != data
    )
    assert not missing, f"{HINT} (not committed: {missing})"
    assert not differ, f"{HINT} (differ from the committed files: {differ})"


def test_no_committed_stub_is_orphaned(regenerated: Path) -> None:
    committed = {
        p.name
        for pattern in ("*_pb2*.py", "*_pb2*.pyi")
        for p in COMMITTED.glob(pattern)
        if p.is_file()
    }
    assert committed, f"no committed stubs found in {COMMITTED}"
    orphaned = sorted(committed - set(_generated_files(regenerated)))
    assert not orphaned, (
        f"{HINT} (committed but no longer generated, e.g. from a removed .proto: {orphaned})"
    )
