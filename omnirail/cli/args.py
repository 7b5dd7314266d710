"""Argument helpers every `omnirail` subcommand shares (the bench commands too)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omnirail.tuning.cpu_latency import check_us


def progress(quiet: bool) -> Callable[[str], None]:
    def show(msg: str) -> None:
        if not quiet:
            print(f"[omnirail] {msg}", file=sys.stderr, flush=True)

    return show


def read_inputs(args: argparse.Namespace) -> dict:
    from omnirail.client.jsonio import parse_inputs

    if args.input_file:
        try:
            text = Path(args.input_file).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise ValueError(f"--input-file {args.input_file}: {why}") from None
        return parse_inputs(text, source=args.input_file)
    if args.input is None:
        raise ValueError("--input or --input-file is required")
    return parse_inputs(args.input)


def wake_us(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer of µs: {text!r}") from None
    try:
        return check_us(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def checked(kind: type[Any], ok: Callable[[Any], bool], rule: str) -> Callable[[str], Any]:
    """An argparse type: the text as `kind` (int or float) for which `ok` holds; otherwise a
    usage error naming the flag and `rule` (comparisons refuse nan by themselves)."""
    noun = "an integer" if kind is int else "a number"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {noun}: {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    return parse


# A `--timeout`: seconds above 0, finite (at most a year).
seconds = checked(float, lambda v: 0 < v <= 365 * 86400, "above 0 and at most a year")
# A TCP port to listen on.
port_number = checked(int, lambda v: 0 <= v <= 65535, "0-65535 (0: any free one)")
