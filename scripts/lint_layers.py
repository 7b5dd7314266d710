#!/usr/bin/env python3
"""Checks the import-linter contracts in pyproject.toml against the package as installed.

The repository keeps `coordinator/`, `stage_service/` and `relay/` at the top level and
installs them as `omnirail.coordinator`, ... (pyproject's `package-dir`). import-linter
finds a package's modules by walking its folder, so it cannot see that mapping; this
script lays the package out in a temporary folder exactly as the wheel does (one
`omnirail/` tree, from the same `packages` and `package-dir` tables) and lints that.

    scripts/lint_layers.py                 lay out the package and lint it
    scripts/lint_layers.py --layout DIR    only lay it out in DIR (tests edit it, then...)
    scripts/lint_layers.py --tree DIR      lint the tree already in DIR
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = REPO / "pyproject.toml"


def layout(dest: Path) -> Path:
    """Copies every package pyproject lists into `dest` at its import path, and examples/;
    returns dest."""
    setuptools = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]
    package_dir: dict[str, str] = setuptools.get("package-dir", {})
    for package in setuptools["packages"]:
        source = _source_of(package, package_dir)
        target = dest.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for module in source.glob("*.py"):
            shutil.copy2(module, target / module.name)
    # examples/ (not installed) is linted too: model code must not import the runtime.
    shutil.copytree(
        REPO / "examples",
        dest / "examples",
        ignore=lambda folder, names: (
            [n for n in names if not n.endswith(".py") and not (Path(folder) / n).is_dir()]
            + ["__pycache__"]
        ),
        dirs_exist_ok=True,
    )
    return dest


def _source_of(package: str, package_dir: dict[str, str]) -> Path:
    # The longest mapped prefix wins, as in setuptools.
    parts = package.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in package_dir:
            return REPO / package_dir[prefix] / Path(*parts[i:])
    return REPO / Path(*parts)


def lint(tree: Path) -> int:
    """Runs lint-imports on `tree` with this repository's contracts; its exit status."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    code = (
        "import sys; from importlinter.cli import lint_imports; "
        f"sys.exit(lint_imports(config_filename={str(PYPROJECT)!r}, no_cache=True, "
        "no_logo=True))"
    )
    # cwd=tree so the checkout's own omnirail/ folder is not found first.
    return subprocess.run([sys.executable, "-c", code], cwd=tree, env=env).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", type=Path, help="only lay the package out in this folder")
    parser.add_argument("--tree", type=Path, help="lint a tree laid out before")
    args = parser.parse_args(argv)
    if args.layout:
        layout(args.layout)
        return 0
    if args.tree:
        return lint(args.tree)
    with tempfile.TemporaryDirectory(prefix="omnirail-layers-") as tmp:
        return lint(layout(Path(tmp)))


if __name__ == "__main__":
    sys.exit(main())
