"""Benchmarks (`omnirail bench ...`)."""

from __future__ import annotations

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
