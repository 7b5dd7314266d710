"""Argument helpers every `omnirail` subcommand shares (the bench commands too)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

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


def seconds(text: str) -> float:
    """A `--timeout`: a finite number of seconds above 0 (at most a year)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value <= 365 * 86400:  # also refuses nan and inf
        raise argparse.ArgumentTypeError(f"must be above 0 and at most a year, got {text}")
    return value


def port_number(text: str) -> int:
    """A TCP port: 0 (any free one) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0-65535 (0: any free one), got {value}")
    return value
