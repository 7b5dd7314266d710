"""`omnirail serve MODEL_DIR`: a checkpoint directory served by the installed pipeline of
its architecture (`omnirail.models.registry`), run as `omnirail up` runs a pipeline file.

The pipeline is the model's installed `pipeline.yaml` with `model_path` set to MODEL_DIR
and every `--set` applied, validated before anything starts (`omnirail.cli.model_dir`,
shared with `compose` and `k8s`). It is written beside the detached meshes' state
(`<state dir>/<name>.pipeline.yaml`): stage processes read it when they start and restart.
`--print-pipeline` prints it instead, for a user who wants to edit it and run it with
`omnirail up`.
"""

from __future__ import annotations

import argparse

from omnirail.cli.lifecycle import cmd_up
from omnirail.cli.model_dir import resolve


def cmd_serve(args: argparse.Namespace) -> int:
    resolved = resolve(args.model_dir, args.set)
    if args.print_pipeline:
        print(resolved.text, end="")
        return 0
    from omnirail.ops.launcher import state_dir

    name = args.name or resolved.data.get("name") or "pipeline"
    args.file = str(resolved.write(state_dir() / f"{name}.pipeline.yaml"))
    args.name = name
    return cmd_up(args)
