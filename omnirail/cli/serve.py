"""`omnirail serve MODEL_DIR`: a checkpoint directory served by the installed pipeline of
its architecture (`omnirail.models.registry`), run as `omnirail up` runs a pipeline file.

The pipeline is the model's installed `pipeline.yaml` with `model_path` set to MODEL_DIR
and every `--set` applied, validated before anything starts. It is written beside the
detached meshes' state (`<state dir>/<name>.pipeline.yaml`): stage processes read it when
they start and restart. `--print-pipeline` prints it instead, for a user who wants to edit
it and run it with `omnirail up`.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import yaml

from omnirail.cli.lifecycle import cmd_up
from omnirail.config import PipelineConfig
from omnirail.config.overrides import apply_sets
from omnirail.config.yaml_loader import read_yaml


def resolved_pipeline(model_dir: str, sets: list[str]) -> tuple[dict[str, Any], str]:
    """The pipeline data that serves `model_dir` (validated) and its YAML text."""
    from omnirail.models.registry import pipeline_for

    folder = Path(model_dir).resolve()
    model = pipeline_for(folder)
    data = dict(read_yaml(model.pipeline_file))
    data["model_path"] = str(folder)
    data = apply_sets(data, sets)
    # Validated (hooks and factories resolved) before anything is written or started.
    PipelineConfig.from_dict(data, source_dir=str(model.pipeline_file.parent))
    header = (
        f"# {model.name}: the installed pipeline {model.package} for {folder}\n"
        f"# (omnirail serve {folder}{''.join(f' --set {s}' for s in sets)})\n"
    )
    return data, header + yaml.safe_dump(data, sort_keys=False)


def cmd_serve(args: argparse.Namespace) -> int:
    data, text = resolved_pipeline(args.model_dir, args.set)
    if args.print_pipeline:
        print(text, end="")
        return 0
    from omnirail.ops.launcher import state_dir

    name = args.name or data.get("name") or "pipeline"
    path = state_dir() / f"{name}.pipeline.yaml"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    args.file = str(path)
    args.name = name
    return cmd_up(args)
