"""`--set PATH=VALUE`: changing a pipeline's settings without editing its YAML.

PATH is dotted; `stages.NAME` selects the stage called NAME (`stages.thinker.gpu=0`,
`stages.talker.replicas=2`), anything else walks mappings (`max_live_requests=64`,
`relay.pool_mb=512`). VALUE is read as one YAML value, with the same loader as pipeline
files (`0` an int, `true` a bool, `[0, 1]` a list, `"0"` a string). A PATH that names no
stage or no field of a stage or of the pipeline is refused here, naming it; the value is
checked with the rest of the pipeline when it is validated. Errors are `SetError`, one
line each.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

from omnirail.config.errors import ConfigError
from omnirail.config.models import PipelineConfig, StageConfig
from omnirail.config.yaml_loader import read_yaml_text


class SetError(ValueError):
    """A `--set` that names nothing, or a value that is not YAML: one line naming it."""


def apply_sets(data: Mapping[str, Any], sets: Iterable[str]) -> dict[str, Any]:
    """`data` (a pipeline's YAML data) with every `PATH=VALUE` of `sets` applied."""
    out = copy.deepcopy(dict(data))
    for item in sets:
        path, sep, raw = item.partition("=")
        keys = path.strip().split(".")
        if not sep or not all(keys):
            raise SetError(
                f"--set {item!r}: expected PATH=VALUE, e.g. stages.thinker.gpu=0 or "
                "max_live_requests=64"
            )
        try:
            value = read_yaml_text(raw, f"--set {path}") if raw.strip() else ""
        except ConfigError as exc:
            raise SetError(str(exc).splitlines()[0]) from None
        _set(out, keys, value, item)
    return out


def _set(data: dict[str, Any], keys: list[str], value: Any, item: str) -> None:
    if keys[0] == "stages" and len(keys) > 1:
        if len(keys) < 3:
            raise SetError(f"--set {item!r}: name a field of the stage, e.g. stages.{keys[1]}.gpu")
        stages = data.get("stages") or []
        names = [s.get("name") for s in stages if isinstance(s, Mapping)]
        if keys[1] not in names:
            raise SetError(f"--set {item!r}: no stage {keys[1]!r}; the stages are {names}")
        node = stages[names.index(keys[1])]
        fields, owner, rest = StageConfig.model_fields, f"stage {keys[1]!r}", keys[2:]
    else:
        node, fields, owner, rest = data, PipelineConfig.model_fields, "the pipeline", keys
    if rest[0] not in fields:
        raise SetError(f"--set {item!r}: {owner} has no field {rest[0]!r}")
    for key in rest[:-1]:
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise SetError(
                f"--set {item!r}: {'.'.join(keys[: keys.index(key) + 1])} is not a mapping"
            )
        node = child
    node[rest[-1]] = value
