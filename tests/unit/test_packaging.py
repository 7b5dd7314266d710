"""What `pip install omnirail` installs, and the layer contracts over it.

The wheel must hold one top-level package, `omnirail` (the repository's `relay/`,
`coordinator/` and `stage_service/` folders install as its subpackages, `examples/` not at
all), and the import-linter contracts must catch an import that goes up a layer or closes a
cycle.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINT = REPO / "scripts" / "lint_layers.py"
SOURCE_FOLDERS = {
    "omnirail": "omnirail",
    "relay": "omnirail/relay",
    "coordinator": "omnirail/coordinator",
    "stage_service": "omnirail/stage_service",
}


def _run(*args: str | Path, cwd: Path = REPO, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built from a copy of what a clean checkout has: an in-tree build would leave build/
    # here, and setuptools' build/ keeps files deleted from the sources.
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for folder in SOURCE_FOLDERS:
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    proc = _run(
        sys.executable, "-m", "pip", "wheel", src, "--no-deps", "--no-build-isolation",
        "-q", "-w", out,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (built,) = out.glob("omnirail-*.whl")
    return built


@pytest.mark.slow
def test_wheel_has_omnirail_as_its_only_top_level_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"omnirail"}
    # Every module of the source folders is in it, at its omnirail path.
    for folder, installed in SOURCE_FOLDERS.items():
        for module in (REPO / folder).rglob("*.py"):
            rel = module.relative_to(REPO / folder).as_posix()
            assert f"{installed}/{rel}" in names, f"{folder}/{rel} is missing from the wheel"
    assert not [n for n in names if n.startswith("examples/") or "/tests/" in n]


@pytest.mark.slow
def test_a_fresh_venv_with_the_wheel_has_no_other_top_level_package(
    wheel: Path, tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    assert _run(sys.executable, "-m", "venv", "--without-pip", venv).returncode == 0
    python = venv / "bin" / "python"
    proc = _run(
        sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps",
        "--no-index", wheel,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    probe = (
        "import importlib.util as u\n"
        "for name in ('relay', 'coordinator', 'stage_service', 'examples', 'omnirail.relay',"
        " 'omnirail.coordinator', 'omnirail.stage_service', 'omnirail.relay.shm'):\n"
        "    print(name, u.find_spec(name) is not None)\n"
    )
    # Run from an empty folder so the checkout itself is not on the path.
    proc = _run(python, "-c", probe, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    found = dict(line.split() for line in proc.stdout.splitlines())
    assert found == {
        "relay": "False",
        "coordinator": "False",
        "stage_service": "False",
        "examples": "False",
        "omnirail.relay": "True",
        "omnirail.coordinator": "True",
        "omnirail.stage_service": "True",
        "omnirail.relay.shm": "True",
    }


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """The package laid out as installed, for the contract checks to edit."""
    assert _run(sys.executable, LINT, "--layout", tmp_path).returncode == 0
    return tmp_path


def test_contracts_hold_on_the_package(tree: Path) -> None:
    proc = _run(sys.executable, LINT, "--tree", tree)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout


def test_an_upward_import_is_caught(tree: Path) -> None:
    payload = tree / "omnirail" / "wire" / "payload.py"
    payload.write_text(payload.read_text() + "\nimport omnirail.client.sdk  # noqa\n")
    proc = _run(sys.executable, LINT, "--tree", tree)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "omnirail layers BROKEN" in proc.stdout
    assert "omnirail.wire.payload -> omnirail.client.sdk" in proc.stdout


def test_a_relay_importing_the_stage_service_is_caught(tree: Path) -> None:
    shm = tree / "omnirail" / "relay" / "shm.py"
    shm.write_text(shm.read_text() + "\nfrom omnirail.stage_service import stage  # noqa\n")
    proc = _run(sys.executable, LINT, "--tree", tree)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "omnirail.relay.shm -> omnirail.stage_service.stage" in proc.stdout


def test_an_import_cycle_inside_a_package_is_caught(tree: Path) -> None:
    groups = tree / "omnirail" / "ops" / "compose_groups.py"
    groups.write_text(groups.read_text() + "\nimport omnirail.ops.compose  # noqa\n")
    proc = _run(sys.executable, LINT, "--tree", tree)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "No cycles are allowed in omnirail.ops" in proc.stdout


def test_model_code_importing_the_stage_runtime_is_caught(tree: Path) -> None:
    """examples/ (and the installed models) import `omnirail.stage`, the public API for
    model authors, never `omnirail.stage_service`."""
    models = tree / "examples" / "streaming" / "models.py"
    models.write_text(models.read_text() + "\nfrom omnirail.stage_service import host  # noqa\n")
    proc = _run(sys.executable, LINT, "--tree", tree)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "model code imports omnirail.stage, never the stage runtime BROKEN" in proc.stdout
    assert "examples.streaming.models -> omnirail.stage_service.host" in proc.stdout
