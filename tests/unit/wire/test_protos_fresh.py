"""The committed gRPC stubs (omnirail/v1/, omnirail/kserve/) match what scripts/gen_protos.sh
generates."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PACKAGES = ("v1", "kserve")
HINT = "generated stubs are stale; run scripts/gen_protos.sh and commit omnirail/{}/"

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
    for package in PACKAGES:
        generated = out / "omnirail" / package
        assert generated.is_dir(), f"scripts/gen_protos.sh wrote nothing under {generated}"
    return out / "omnirail"


@pytest.mark.parametrize("package", PACKAGES)
def test_generated_files_match_committed(regenerated: Path, package: str) -> None:
    committed_dir = REPO / "omnirail" / package
    hint = HINT.format(package)
    fresh = _generated_files(regenerated / package)
    assert fresh, "scripts/gen_protos.sh generated no files"
    missing = sorted(name for name in fresh if not (committed_dir / name).is_file())
    differ = sorted(
        name
        for name, data in fresh.items()
        if (committed_dir / name).is_file() and (committed_dir / name).read_bytes() != data
    )
    assert not missing, f"{hint} (not committed: {missing})"
    assert not differ, f"{hint} (differ from the committed files: {differ})"


@pytest.mark.parametrize("package", PACKAGES)
def test_no_committed_stub_is_orphaned(regenerated: Path, package: str) -> None:
    committed_dir = REPO / "omnirail" / package
    hint = HINT.format(package)
    committed = {
        p.name
        for pattern in ("*_pb2*.py", "*_pb2*.pyi")
        for p in committed_dir.glob(pattern)
        if p.is_file()
    }
    assert committed, f"no committed stubs found in {committed_dir}"
    orphaned = sorted(committed - set(_generated_files(regenerated / package)))
    assert not orphaned, (
        f"{hint} (committed but no longer generated, e.g. from a removed .proto: {orphaned})"
    )
