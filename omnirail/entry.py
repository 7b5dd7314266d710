"""The `omnirail` console script and `python -m omnirail`: picks gRPC's I/O path (see
`omnirail.grpc_env`) before the CLI imports grpc."""

from __future__ import annotations

from omnirail.grpc_env import prefer_posix_io


def main() -> int:
    prefer_posix_io()
    from omnirail.cli import main as cli_main

    return cli_main()
