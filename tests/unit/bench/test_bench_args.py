"""`omnirail bench`'s counts and durations are checked as they are parsed: a zero count or
a negative time is a usage error naming the flag, not a failure deep in a run."""

from __future__ import annotations

import argparse

import pytest

from omnirail.cli.bench import add_bench_parser


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_bench_parser(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (("pipeline", "--payload-bytes", "-5"), "must be at least 0, got -5"),
        (("pipeline", "--requests", "0"), "must be at least 1, got 0"),
        (("pipeline", "--throughput-requests", "x"), "not an integer: 'x'"),
        (("pipeline", "--stage-ms", "-1"), "must be a finite number of at least 0, got -1"),
        (("pipeline", "--replicas", "0"), "must be at least 1, got 0"),
        (("streaming", "--chunks", "0"), "must be at least 1, got 0"),
        (("streaming", "--interval-ms", "nan"), "must be a finite number of at least 0, got nan"),
        (("streaming", "--runs", "0"), "must be at least 1, got 0"),
        (("chaos", "--kill-every", "inf"), "must be a finite number of at least 0, got inf"),
    ],
)
def test_bad_counts_and_durations_are_usage_errors(
    argv: tuple[str, ...], problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Subparsers exit on their own errors whatever the top parser says.
    with pytest.raises(SystemExit) as ei:
        parse(*argv)
    assert ei.value.code == 2
    flag = next(a for a in argv if a.startswith("--"))
    assert f"argument {flag}: {problem}" in capsys.readouterr().err


def test_bounds_themselves_are_taken() -> None:
    args = parse(
        *("pipeline", "--payload-bytes", "0", "--requests", "1", "--stage-ms", "0"),
        *("--chunks", "1", "--interval-ms", "0", "--runs", "1", "--kill-every", "0"),
    )
    assert (args.payload_bytes, args.requests, args.stage_ms) == (0, 1, 0.0)
    assert (args.chunks, args.interval_ms, args.runs, args.kill_every) == (1, 0.0, 1, 0.0)
