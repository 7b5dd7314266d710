"""The `omnirail` command line: the console script and `python -m omnirail`.

`main` picks gRPC's I/O path (see `omnirail.tuning.grpc_env`) before the commands import
grpc, so this module imports nothing else at load time.
"""

from __future__ import annotations

from omnirail.tuning.grpc_env import prefer_posix_io


def main(argv: list[str] | None = None) -> int:
    prefer_posix_io()
    from omnirail.cli.commands import main as run_commands

    return run_commands(argv)
