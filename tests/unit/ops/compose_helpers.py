"""Helpers of the `omnirail compose` tests: generating bundles and reading them back."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import yaml

from omnirail.ops.compose import ComposeBundle, ComposeOptions, EdgeRelay, generate

REPO = Path(__file__).resolve().parents[3]
QUICKSTART = REPO / "examples/quickstart/pipeline.yaml"
STREAMING = REPO / "examples/streaming/pipeline.yaml"
QWEN3_OMNI = REPO / "omnirail/models/qwen3_omni/pipeline.yaml"
FIXED = ["coordinator", "jaeger", "prometheus"]
# After the coordinator in pipelines with api.openai (the OpenAI gateway).
GATEWAY = "gateway"
OTLP = "http://jaeger:4317"


def gen(pipeline: Path, out: Path | None, *edges: str, **options: Any) -> ComposeBundle:
    relays = tuple(EdgeRelay.parse(e) for e in edges)
    return generate(pipeline, out, ComposeOptions(edge_relays=relays, **options))


def services(bundle: ComposeBundle) -> dict[str, dict[str, Any]]:
    return bundle.compose["services"]


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def ipc_of(bundle: ComposeBundle) -> dict[str, str]:
    return {n: s["ipc"] for n, s in services(bundle).items() if "ipc" in s}


def side_file(bundle: ComposeBundle, suffix: str) -> tuple[Path, str]:
    [(path, text)] = [(p, t) for p, t in bundle.side_files.items() if p.name.endswith(suffix)]
    return path, text


def prometheus_targets(bundle: ComposeBundle) -> list[str]:
    _, text = side_file(bundle, ".prometheus.yml")
    [job] = yaml.safe_load(text)["scrape_configs"]
    return [t for sc in job["static_configs"] for t in sc["targets"]]


# -- pipelines written to tmp_path ------------------------------------------------------


def split_pipeline(tmp_path: Path, **stage_extra: dict[str, Any]) -> Path:
    """a,b share process front_end; b fans out to c_x (shm) and d (ucx); both feed e, d
    over nixl. Every dotted path names a module next to the YAML."""
    mod = f"compose_stages_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{mod}.py").write_text(
        "def make(**kw):\n    return kw\n\n\ndef merge(p):\n    return p\n"
    )
    stages: list[dict[str, Any]] = [
        {"name": "a", "process": "front_end", "next": "b"},
        {"name": "b", "process": "front_end", "next": ["c_x", "d"]},
        {"name": "c_x", "next": "e"},
        {"name": "d", "next": "e", "relay_to": {"e": {"backend": "nixl"}}},
        {"name": "e", "wait_for": ["c_x", "d"], "merge_fn": f"{mod}:merge", "terminal": True},
    ]
    stages[1]["relay_to"] = {"d": {"backend": "ucx", "options": {"progress": "polling"}}}
    for s in stages:
        s["factory"] = f"{mod}:make"
        s.update(stage_extra.get(s["name"], {}))
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump({"name": "split", "stages": stages}, sort_keys=False))
    return path


def small_pipeline(
    tmp_path: Path, stages: list[dict[str, Any]], factory: str = "make", **top: Any
) -> Path:
    """`factory`: make, or make_model (which takes the pipeline's model_path)."""
    mod = f"compose_small_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{mod}.py").write_text(
        "def make(**kw):\n    return kw\n\n\ndef make_model(model_path, **kw):\n    return kw\n"
    )
    for s in stages:
        s.setdefault("factory", f"{mod}:{factory}")
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump({"name": "small", "stages": stages, **top}, sort_keys=False))
    return path


def chain(*names: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"name": n, "next": m} for n, m in itertools.pairwise(names)]
    return [*out, {"name": names[-1], "terminal": True}]


# -- the examples --------------------------------------------------------------------------


def omnirail(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "omnirail", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
