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
