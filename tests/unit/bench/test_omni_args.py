"""`omnirail bench omni`'s flags, and that its module imports neither torch nor `examples`."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from omnirail.cli.bench import _one_level, add_bench_parser

REPO = Path(__file__).resolve().parents[3]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


def test_omni_flags() -> None:
    args = parse(
        "omni", "--concurrency", "1,8", "--baseline", "transformers", "--kind", "image", "--json"
    )
    assert args.concurrency == [1, 8] and args.baseline == "transformers"
    assert args.kind == "image" and args.model_path is None and args.requests is None
    assert (args.max_new_tokens, args.talker_max_new_tokens, args.torch_threads) == (32, 128, 1)


def test_concurrency_levels_are_checked() -> None:
    with pytest.raises(SystemExit):
        parse("omni", "--concurrency", "1,0")
    with pytest.raises(SystemExit):
        parse("omni", "--concurrency", "one")
    # The other benches take one level, as before.
    assert _one_level(parse("pipeline", "--concurrency", "8"), 64) == 8
    assert _one_level(parse("pipeline"), 64) == 64
    with pytest.raises(SystemExit, match="one level"):
        _one_level(parse("pipeline", "--concurrency", "1,8"), 64)


PROBE = """
import json, sys
import omnirail.bench.omni_bench
print(json.dumps(sorted(m for m in sys.modules
                        if m.split(".")[0] in ("torch", "transformers", "examples"))))
"""


def test_the_module_imports_no_torch_and_no_examples_package() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
