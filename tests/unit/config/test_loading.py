"""load_pipeline: YAML and Python files, file errors, import without torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from omnirail.config import (
    ConfigError,
    PipelineConfig,
    dotted,
    load_pipeline,
)
from tests.unit.config.helpers import (
    CONFIGS,
    F,
    pipe,
    st,
)

# -- loading ------------------------------------------------------------------------------


def test_load_yaml_fixture() -> None:
    cfg = load_pipeline(CONFIGS / "demo.yaml")
    assert cfg.name == "demo"
    assert cfg.source_dir == str(CONFIGS.resolve())
    assert cfg.relay.backend == "shm"
    assert cfg.stage("image_encoder").next == ["mm_aggregate"]
    assert cfg.relay_for("thinker").pool_mb == 64
    assert cfg.factory_args_for("thinker") == {"size": 3, "model_path": "/models/demo"}


def test_load_yaml_resolves_relative_to_source_dir() -> None:
    cfg = load_pipeline(str(CONFIGS / "local_helpers.yaml"))
    assert str(CONFIGS.resolve()) in sys.path
    made = dotted.resolve(cfg.stage("only").factory, cfg.source_dir)
    assert made() == {"model_path": None}


def test_load_py_fixture() -> None:
    cfg = load_pipeline(CONFIGS / "demo_pipeline.py")
    assert cfg.name == "py-demo"
    assert cfg.stage_names == ["a", "b"]
    assert cfg.source_dir == str(CONFIGS.resolve())


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_load_py_dict_and_builder(tmp_path: Path) -> None:
    p = _write(
        tmp_path,
        "as_dict.py",
        f"""
        pipeline = {{"name": "d", "stages": [{{"name": "a", "factory": "{F}", "terminal": True}}]}}
        """,
    )
    assert load_pipeline(p).name == "d"
    p = _write(
        tmp_path,
        "builder.py",
        f"""
        from omnirail.config import PipelineConfig, StageConfig

        def build_pipeline():
            stage = StageConfig(name="a", factory="{F}", terminal=True)
            return PipelineConfig(name="b", stages=[stage])
        """,
    )
    assert load_pipeline(p).name == "b"


def test_load_py_runs_semantic_validation(tmp_path: Path) -> None:
    p = _write(
        tmp_path,
        "bad.py",
        f"""
        pipeline = {{"stages": [{{"name": "a", "factory": "{F}", "next": "ghost"}}]}}
        """,
    )
    with pytest.raises(ConfigError) as ei:
        load_pipeline(p)
    assert "stages[a].next: unknown stage 'ghost'" in str(ei.value)
    assert ei.value.source == str(p)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("x = 1\n", "defines neither `pipeline` nor `build_pipeline()`"),
        ("pipeline = 3\n", "must be a PipelineConfig or a dict, got int"),
        ("raise RuntimeError('boom')\n", "error while loading: RuntimeError: boom"),
        ("import sys\nsys.exit(3)\n", "called exit(3) while loading"),
        ("raise SystemExit('usage: x')\n", "called exit('usage: x') while loading"),
        (
            "from omnirail.config import StageConfig\n"
            "pipeline = StageConfig(name='a', factory='x.y', replicas=0)\n",
            "StageConfig.replicas",
        ),
    ],
)
def test_load_py_errors(tmp_path: Path, body: str, expected: str) -> None:
    p = _write(tmp_path, "cfg.py", body)
    with pytest.raises(ConfigError) as ei:
        load_pipeline(p)
    assert expected in str(ei.value)


def test_load_missing_file(tmp_path: Path) -> None:
    p = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as ei:
        load_pipeline(p)
    assert str(p) in str(ei.value)
    assert "no such file" in str(ei.value)


def test_load_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    p = _write(tmp_path, "bad.yaml", "stages:\n  - name: a\n    next: [b\n  - name: b\n")
    with pytest.raises(ConfigError) as ei:
        load_pipeline(p)
    msg = str(ei.value)
    assert msg.startswith(f"{p}:")
    assert "YAML syntax error" in msg
    line = int(msg[len(str(p)) + 1 :].split(":", 1)[0])
    assert 3 <= line <= 4


@pytest.mark.parametrize("text", ["", "- a\n- b\n", "just a string\n"])
def test_load_yaml_must_be_mapping(tmp_path: Path, text: str) -> None:
    p = _write(tmp_path, "x.yml", text)
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_pipeline(p)


def test_load_unsupported_suffix(tmp_path: Path) -> None:
    p = _write(tmp_path, "x.json", "{}")
    with pytest.raises(ConfigError, match="unsupported config type"):
        load_pipeline(p)


def test_load_yaml_validation_error_sets_source(tmp_path: Path) -> None:
    p = _write(tmp_path, "x.yaml", f"stages:\n  - name: a\n    factory: {F}\n    bogus: 1\n")
    with pytest.raises(ConfigError) as ei:
        load_pipeline(p)
    assert "stages[a].bogus: unknown field" in ei.value.errors
    assert ei.value.source == str(p)


def test_source_dir_is_private() -> None:
    cfg = PipelineConfig.from_dict(pipe(st("a", terminal=True)), source_dir="/tmp/x")
    assert cfg.source_dir == "/tmp/x"
    assert "source_dir" not in cfg.model_dump()
    assert "source_dir" not in PipelineConfig.model_json_schema()["properties"]
    assert cfg.model_copy().source_dir == "/tmp/x"


def test_import_without_torch() -> None:
    code = "import sys, omnirail.config; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def test_load_py_with_dataclass(tmp_path: Path) -> None:
    # Dataclasses look their module up in sys.modules while the file executes.
    p = _write(
        tmp_path,
        "with_dc.py",
        f"""
        from dataclasses import dataclass

        @dataclass
        class Opts:
            size: int = 1

        pipeline = {{"stages": [{{"name": "a", "factory": "{F}", "terminal": True,
                                  "factory_args": {{"size": Opts().size}}}}]}}
        """,
    )
    assert load_pipeline(p).stage("a").factory_args == {"size": 1}
