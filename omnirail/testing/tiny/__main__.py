"""`python -m omnirail.testing.tiny KIND DIR [--seed N]`: writes a tiny checkpoint."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from omnirail.testing.tiny import BUILDERS, make


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m omnirail.testing.tiny",
        description="Write a tiny checkpoint with random weights (nothing is downloaded).",
    )
    parser.add_argument("kind", choices=sorted(BUILDERS), help="which model")
    parser.add_argument("dir", type=Path, help="where to write it (made if missing)")
    parser.add_argument("--seed", type=int, default=0, help="same seed, same files")
    args = parser.parse_args(argv)
    if args.dir.exists() and not args.dir.is_dir():
        parser.error(f"dir: {args.dir} exists and is not a directory")
    try:
        path = make(args.kind, args.dir, seed=args.seed)
    except OSError as exc:
        print(f"error: cannot write {args.dir}: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
