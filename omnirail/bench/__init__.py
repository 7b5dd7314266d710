"""Benchmarks (`omnirail bench ...`)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def pipeline_file(config: dict[str, Any]) -> Iterator[Path]:
    """A generated pipeline written to a temporary YAML file, removed afterwards."""
    import yaml

    with tempfile.TemporaryDirectory(prefix="omnirail-bench-") as tmp:
        path = Path(tmp) / "pipeline.yaml"
        path.write_text(yaml.safe_dump(config))
        yield path


def rss_kib(pid: int) -> int | None:
    """A process's resident memory (KiB), None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def cpu_seconds(pid: int) -> float | None:
    """CPU seconds a process has used so far (user + system, all its threads; not its
    children), None once it is gone or where there is no /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # After the command's closing parenthesis: state is field 0, utime 11 and stime 12.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
