"""`omnirail serve MODEL_DIR` refuses what it cannot serve at once, in one line naming the
file or the flag, before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omnirail.cli.commands import main
from tests.unit.models.test_registry import QWEN, checkpoint


def _serve(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(["serve", *argv])
    return code, capsys.readouterr().err


def test_an_unknown_architecture_is_one_line(tmp_path: Path, capsys) -> None:
    folder = checkpoint(tmp_path, {"architectures": ["GPT2LMHeadModel"]})
    code, err = _serve(capsys, str(folder), "--print-pipeline")
    assert code == 2
    assert err.count("\n") == 1 and err.startswith(f"error: {folder / 'config.json'}: ")
    assert "supported: qwen3-omni" in err


def test_no_config_json_is_one_line(tmp_path: Path, capsys) -> None:
    code, err = _serve(capsys, str(tmp_path))
    assert code == 2 and err.count("\n") == 1 and "config.json: not found" in err


def test_a_missing_shard_is_one_line(tmp_path: Path, capsys) -> None:
    folder = checkpoint(tmp_path, {"architectures": [QWEN]})
    (folder / "model-00001-of-00002.safetensors").unlink()
    code, err = _serve(capsys, str(folder), "--detach")
    assert code == 2 and err.count("\n") == 1
    assert "model-00001-of-00002.safetensors: missing" in err


@pytest.mark.parametrize(
    ("item", "problem"),
    [
        ("stages.vocoder.gpu=0", "no stage 'vocoder'"),
        ("stages.thinker.gpux=0", "stage 'thinker' has no field 'gpux'"),
    ],
)
def test_a_set_naming_nothing_is_one_line(tmp_path: Path, capsys, item, problem) -> None:
    folder = checkpoint(tmp_path, {"architectures": [QWEN]})
    code, err = _serve(capsys, str(folder), "--set", item, "--print-pipeline")
    assert code == 2 and err.count("\n") == 1 and problem in err, err


def test_config_json_is_read_not_trusted(tmp_path: Path, capsys) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": 5}))
    code, err = _serve(capsys, str(tmp_path))
    assert code == 2 and "have no installed pipeline" in err
