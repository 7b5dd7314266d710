"""`python -m omnirail.testing.tiny`: tiny checkpoints for users and tests."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from omnirail.testing.tiny import BUILDERS, make
from omnirail.testing.tiny.__main__ import main


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "omnirail.testing.tiny", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.slow
def test_the_command_writes_a_qwen3_omni_checkpoint_make_would(tmp_path: Path) -> None:
    proc = _run("qwen3-omni", str(tmp_path / "cli"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tmp_path / "cli")
    config = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3OmniMoeForConditionalGeneration"]
    index = json.loads((tmp_path / "cli" / "model.safetensors.index.json").read_text())
    for shard in set(index["weight_map"].values()):
        assert (tmp_path / "cli" / shard).is_file(), shard
    # The same seed gives the same files, from the command or from Python.
    make("qwen3-omni", tmp_path / "py", seed=0)
    assert _digests(tmp_path / "cli") == _digests(tmp_path / "py")


def test_an_unknown_kind_is_refused_with_the_known_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["llama-9000", str(tmp_path)])
    assert exit_.value.code == 2
    assert "invalid choice: 'llama-9000'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown tiny checkpoint 'x'; known: qwen3, qwen3-omni"):
        make("x", tmp_path)
    assert sorted(BUILDERS) == ["qwen3", "qwen3-omni"]


def test_a_file_in_the_way_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(SystemExit):
        main(["qwen3-omni", str(tmp_path / "f")])
    assert "exists and is not a directory" in capsys.readouterr().err
