"""omnirail from its wheel, outside the checkout, as a user installs it: the tiny Qwen3-Omni
checkpoint written with `python -m omnirail.testing.tiny`, `omnirail serve DIR --detach
--http` answering the official `openai` SDK with what transformers' `generate()` gives, and
`omnirail bench omni` running there.

The venv gets the wheel alone (`--no-deps`); its dependencies come from this test's own
environment through a .pth file, which adds that site-packages folder to the path without
running its .pth files (so the checkout's editable install of omnirail stays out of it).
Every command runs from an empty folder, never from the checkout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("openai")

from omnirail.ops.launcher import read_states
from tests.integration.conftest import REPO
from tests.integration.test_serve import check_openai_answer, reference_of

pytestmark = pytest.mark.slow

NAME = "installed-it"
SOURCES = ("pyproject.toml", "README.md", "omnirail", "coordinator", "stage_service", "relay")
TOKENS = ["--set", "stages.preprocessing.factory_args.max_new_tokens=12"]
TOKENS += ["--set", "stages.talker.factory_args.max_new_tokens=48"]


class Venv:
    def __init__(self, root: Path, work: Path) -> None:
        self.root = root
        self.work = work  # an empty folder: the checkout is not on the path
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        self.env.pop("PYTHONPATH", None)

    def run(self, *argv: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv,
            cwd=self.work,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )

    def bin(self, name: str) -> str:
        return str(self.root / "bin" / name)


def _ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, f"{proc.args}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Venv:
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, src / name)
    wheels = tmp_path_factory.mktemp("wheel")
    _ok(subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
         "-q", "-w", str(wheels)],
        capture_output=True, text=True, timeout=600,
    ))  # fmt: skip
    (wheel,) = wheels.glob("omnirail-*.whl")
    root = tmp_path_factory.mktemp("venv")
    _ok(subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)],
                       capture_output=True, text=True, timeout=120))  # fmt: skip
    _ok(subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(root / "bin" / "python"), "install",
         "-q", "--no-deps", "--no-index", str(wheel)],
        capture_output=True, text=True, timeout=600,
    ))  # fmt: skip
    site = next((root / "lib").glob("python3*/site-packages"))
    (site / "omnirail-test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    venv = Venv(root, tmp_path_factory.mktemp("work"))
    where = venv.run(venv.bin("python"), "-c", "import omnirail; print(omnirail.__file__)")
    assert _ok(where).strip().startswith(str(site)), where.stdout
    return venv


@pytest.fixture(scope="module")
def tiny(venv: Venv) -> Path:
    folder = venv.work / "tiny"
    _ok(venv.run(venv.bin("python"), "-m", "omnirail.testing.tiny", "qwen3-omni", str(folder)))
    return folder


@pytest.fixture(scope="module")
def served(venv: Venv, tiny: Path) -> Iterator[tuple[Path, dict[str, Any]]]:
    argv = ["serve", str(tiny), "--detach", "--name", NAME, "--http", "127.0.0.1:0", *TOKENS]
    _ok(venv.run(venv.bin("omnirail"), *argv))
    try:
        yield tiny, read_states()[NAME]
    finally:
        _ok(venv.run(venv.bin("omnirail"), "down", "--name", NAME))


def test_the_installed_wheel_serves_a_checkpoint_to_the_openai_sdk(
    venv: Venv, served: tuple[Path, dict[str, Any]]
) -> None:
    tiny, state = served
    # The mesh runs the venv's interpreter, so the wheel's code (checked in `venv`).
    launcher = Path(f"/proc/{state['pid']}/cmdline").read_bytes().split(b"\0")
    assert launcher[0].decode() == venv.bin("python"), launcher
    check_openai_answer(str(state["http"]), *reference_of(tiny, 12, 48))


def test_bench_omni_runs_from_the_wheel(venv: Venv) -> None:
    out = _ok(
        venv.run(
            venv.bin("omnirail"), "bench", "omni", "--requests", "4", "--concurrency", "1",
            "--max-new-tokens", "4", "--talker-max-new-tokens", "16", "--json",
            timeout=900,
        )
    )  # fmt: skip
    report = json.loads(out)
    assert report["pipeline"] == "omnirail.models.qwen3_omni (installed)"
    (level,) = report["levels"]
    assert level["concurrency"] == 1 and level["mesh"]["cpu_s_per_request_total"] > 0


def test_the_omni_demo_pipelines_are_installed_and_resolve(venv: Venv) -> None:
    """The omni demo's pipeline files ship as package data, and every factory and hook
    they name imports from the wheel (what `bench demo`, `bench stop` and `bench chaos
    --shape omni` run)."""
    where = _ok(
        venv.run(
            venv.bin("python"), "-c",
            "from omnirail.models.omni_demo import pipeline_file as f; "
            "print(f()); print(f('pipeline_hf.yaml'))",
        )
    ).split()  # fmt: skip
    for path in where:
        assert Path(path).is_file() and "site-packages" in path, where
        assert "pipeline: omni-demo" in _ok(venv.run(venv.bin("omnirail"), "validate", path))


def test_compose_and_k8s_of_a_checkpoint_from_the_wheel(venv: Venv, tiny: Path) -> None:
    """`omnirail compose DIR` and `omnirail k8s DIR` from the wheel: the installed pipeline,
    pointed at the checkpoint mounted at /model (no build context: there is no checkout)."""
    import yaml

    _ok(venv.run(venv.bin("omnirail"), "compose", str(tiny), "-o", "dc.yml",
                 "--no-check-model-dir"))  # fmt: skip
    services = yaml.safe_load((venv.work / "dc.yml").read_text())["services"]
    assert "build" not in services["coordinator"]
    assert {"source": str(tiny), "target": "/model"}.items() <= (
        next(v for v in services["thinker"]["volumes"] if v["target"] == "/model").items()
    )
    derived = yaml.safe_load((venv.work / "qwen3-omni" / "pipeline.compose.yaml").read_text())
    assert derived["model_path"] == "/model"
    _ok(venv.run(venv.bin("omnirail"), "k8s", str(tiny), "-o", "k8s", "--model-claim", "ckpt"))
    assert "claimName: ckpt" in (venv.work / "k8s" / "omnirail.yaml").read_text()
