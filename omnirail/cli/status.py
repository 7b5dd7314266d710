"""`omnirail status`: the stage processes of running meshes, their restarts and last exits."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def mesh_status(name: str | None = None) -> dict[str, dict[str, Any]]:
    """Per running mesh (or the one named): its address and each stage process's pid,
    state (running, restarting, stopped), restarts and last exit, as its launcher wrote
    them (`Mesh.status_file`)."""
    from omnirail.ops.launcher import running_meshes

    states = running_meshes(name)
    out: dict[str, dict[str, Any]] = {}
    for mesh, state in sorted(states.items()):
        path = Path(str(state.get("run_dir", ""))) / "processes.json"
        try:
            processes = json.loads(path.read_text())
        except (OSError, ValueError):
            processes = {}
        out[mesh] = {"address": state.get("address"), "processes": processes}
    return out


def _exit_text(last: dict[str, Any] | None) -> str:
    if not last:
        return "-"
    ago = time.time() - float(last.get("at", time.time()))
    hung = " (killed: not answering)" if last.get("hung") else ""
    return f"{last.get('process')} code {last.get('code')}{hung}, {ago:.0f}s ago"


def cmd_status(args: argparse.Namespace) -> int:
    found = mesh_status(args.name)
    if args.json:
        print(json.dumps(found))
        return 0
    if not found:
        print("no mesh is running")
        return 0
    for mesh, info in found.items():
        print(f"{mesh}  {info['address']}")
        rows = [("PROCESS", "PID", "STATE", "RESTARTS", "LAST EXIT")]
        for proc, p in sorted(info["processes"].items()):
            rows.append(
                (proc, str(p["pid"]), p["state"], str(p["restarts"]), _exit_text(p["last_exit"]))
            )
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        for row in rows:
            cells = "  ".join(c.ljust(w) for c, w in zip(row[:4], widths, strict=True))
            print(f"  {cells}  {row[4]}")
    return 0


def add_status_parser(sub: Any) -> None:
    st = sub.add_parser("status", help="stage processes of running meshes: restarts, last exits")
    st.add_argument("--name", default=None, help="one mesh (default: every running mesh)")
    st.add_argument("--json", action="store_true", help="one JSON object")
    st.set_defaults(fn=cmd_status)
