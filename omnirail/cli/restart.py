"""`omnirail restart STAGE`: roll a stage's processes through its mesh's launcher."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from omnirail.cli.args import seconds


def cmd_restart(args: argparse.Namespace) -> int:
    """Hands the roll to the launcher (omnirail/ops/control.py) and prints its steps."""
    from omnirail.ops.control import submit
    from omnirail.ops.launcher import running_meshes

    states = running_meshes(args.name)
    if not states:
        raise ValueError("no mesh is running")
    if len(states) > 1:
        raise ValueError(f"several meshes are running ({sorted(states)}); pass --name")
    (state,) = states.values()
    answer = submit(str(state["run_dir"]), {"restart": args.stage}, args.timeout)
    if not answer.get("ok"):
        print(f"error: {answer.get('message')}", file=sys.stderr)
        return 1
    print(answer.get("message", ""))
    return 0


def add_restart_parser(sub: Any) -> None:
    rs = sub.add_parser(
        "restart",
        help="restart a stage's processes one at a time, each drained first (omnirail up)",
    )
    rs.add_argument("stage")
    rs.add_argument("--name", default=None, help="the mesh (default: the only one running)")
    rs.add_argument(
        "--timeout", type=seconds, default=900.0, help="seconds to wait for the whole roll"
    )
    rs.set_defaults(fn=cmd_restart)
