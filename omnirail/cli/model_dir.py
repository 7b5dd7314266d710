"""A checkpoint directory where a command takes a pipeline: `omnirail serve MODEL_DIR`,
`omnirail compose MODEL_DIR` and `omnirail k8s MODEL_DIR`.

The pipeline is the installed one of the checkpoint's architecture (`omnirail.models.
registry`) with `model_path` set to the directory and every `--set PATH=VALUE` applied
(`omnirail.config.overrides`), validated before anything is written or started. What cannot
be served (not a directory, no or unreadable `config.json`, an architecture no installed
pipeline serves, a missing weight shard, a `--set` naming no stage or field) fails at once
in one line naming the file or flag (`CheckpointError`, `SetError`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from omnirail.config import PipelineConfig
from omnirail.config.overrides import apply_sets
from omnirail.config.yaml_loader import read_yaml


def add_set_flag(parser: Any, note: str = "") -> None:
    """`--set PATH=VALUE`, repeatable, on a command that takes a checkpoint directory."""
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="change a setting, e.g. stages.thinker.gpu=0 or stages.talker.replicas=2 "
        f"(repeatable){note}",
    )


@dataclass(frozen=True)
class ResolvedPipeline:
    """The installed pipeline that serves a checkpoint, pointed at it."""

    model: str  # the installed model's name ("qwen3-omni")
    model_dir: Path  # absolute
    data: dict[str, Any]  # the pipeline's YAML data, validated
    text: str  # that YAML, with a header saying where it comes from

    def write(self, path: Path) -> Path:
        """Writes `text` to `path` (replacing it whole); returns it."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(self.text)
        os.replace(tmp, path)
        return path


def resolve(
    model_dir: str | os.PathLike[str], sets: Sequence[str] = (), *, imports: bool = True
) -> ResolvedPipeline:
    """The installed pipeline for the checkpoint in `model_dir`, with `model_path` set to it
    and `sets` applied, validated (its hooks and factories imported, unless `imports` is
    off: `--no-resolve`, where the models' dependencies are not installed)."""
    from omnirail.models.registry import pipeline_for

    folder = Path(model_dir).resolve()
    model = pipeline_for(folder)
    data = dict(read_yaml(model.pipeline_file))
    data["model_path"] = str(folder)
    data = apply_sets(data, sets)
    PipelineConfig.from_dict(data, source_dir=str(model.pipeline_file.parent), resolve=imports)
    header = (
        f"# {model.name}: the installed pipeline {model.package} for {folder}\n"
        f"# (what `omnirail serve {folder}{''.join(f' --set {s}' for s in sets)}` runs)\n"
    )
    text = header + yaml.safe_dump(data, sort_keys=False)
    return ResolvedPipeline(model.name, folder, data, text)


def is_model_dir(arg: str | os.PathLike[str]) -> bool:
    """A directory is taken for a checkpoint (the registry says what is wrong with it if it
    is not one); anything else for a pipeline file."""
    return Path(arg).is_dir()


def source_args(arg: str, sets: Sequence[str], base: Path) -> tuple[str, ...]:
    """What names a checkpoint in a generated file's command: the directory (relative paths
    from `base`, where the command is to be run) and its `--set` flags."""
    where = arg if os.path.isabs(arg) else os.path.relpath(Path(arg).resolve(), base)
    return (where, *(a for s in sets for a in ("--set", s)))


@contextmanager
def pipeline_source(
    arg: str, sets: Sequence[str], folder: Path | None, *, imports: bool = True
) -> Iterator[tuple[Path, ResolvedPipeline | None]]:
    """`arg` as a pipeline file to generate a deployment from, and the checkpoint's
    resolution when `arg` is a checkpoint directory (None for a pipeline file).

    A checkpoint's pipeline is written to `folder/<model>/pipeline.yaml`, which stays when
    the block succeeds (a deployment mounts and reads it) and goes when it fails unless it
    was there before; `folder` None: into a temporary folder, removed afterwards."""
    if not is_model_dir(arg):
        if sets:
            raise ValueError(
                f"--set goes with a checkpoint directory; {arg} is a pipeline file: edit it"
            )
        yield Path(arg), None
        return
    resolved = resolve(arg, sets, imports=imports)
    if folder is None:
        with tempfile.TemporaryDirectory(prefix="omnirail-model-") as tmp:
            yield resolved.write(Path(tmp) / "pipeline.yaml"), resolved
        return
    where = folder / resolved.model
    made = not where.exists()
    path = where / "pipeline.yaml"
    existed = path.exists()
    if not folder.is_dir():
        raise ValueError(f"{folder}: no such directory (for {where.name}/pipeline.yaml)")
    try:
        where.mkdir(exist_ok=True)
        yield resolved.write(path), resolved
    except BaseException:
        if made:
            shutil.rmtree(where, ignore_errors=True)
        elif not existed:
            path.unlink(missing_ok=True)
        raise
