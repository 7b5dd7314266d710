"""Bounds on what a pipeline config may hold, so that checking any input, however made,
takes bounded time and memory and ends in a `ConfigError` (issue 20 fuzz findings).

Size and shape (what the loader and `PipelineConfig.from_dict` refuse before anything
else looks at the data):

- `MAX_FILE_BYTES`: a pipeline file is a few KiB; 1 MiB holds the largest real one many
  times over. The pure-Python YAML parser reads plain text at about a MB/s and dense
  syntax (many tiny nodes) several times slower, where `MAX_VALUES` stops it first.
- `MAX_DEPTH`: containers nested this deep. A pipeline is 4 levels deep plus whatever
  `factory_args` nest; YAML composing and pydantic recurse once per level, and the bound
  keeps them far from Python's recursion limit whatever the caller's stack.
- `MAX_VALUES`: values (scalars, lists, mappings, and mapping keys) in the expanded data.
  A YAML alias counts every time it is used, which is what makes an alias bomb ("billion
  laughs") expensive: 460 bytes expand to millions of values. 100,000 is 100 values for
  each of `MAX_STAGES` stages.
- `MAX_STAGES`: every stage is at least a process's worth of work on a host; 1,024 is
  past any real pipeline while validation of that many stays well under a second.

Ranges of numeric fields (used by `omnirail.config.models`); values past them would be
accepted and then fail (or overflow) where they are used:

- `MAX_CPU_ID`: Linux builds for at most 8,192 CPUs (NR_CPUS with x86-64 MAXSMP), so
  ids 0..8191: a range like "0-20000000" is refused before it is expanded, and so is a
  list whose ranges add up to more than twice that many ids.
- `MAX_GPU_ID`: a host's CUDA device ordinals; 1,024 GPUs in one host is far past any.
- `MAX_MESSAGE_MB`: gRPC's max message length options are C ints (< 2 GiB) and protobuf
  refuses messages of 2 GiB; 1 GiB leaves room for the framing and fields around a
  payload. Also bounds `max_input_mb` and `inline_bytes` (inline data travels in a message).
- `MAX_MB`: relay pools and credit windows, 1 TiB (in MiB).
- `MAX_COUNT`: queue lengths, credits and restarts: 2^20 is far past what memory could
  hold in flight, and stays a C int wherever a count reaches one.
- `MAX_RANKS`: tensor-parallel ranks, replicas and torch threads of one stage (each is a
  process or a thread).
- `MAX_SECONDS`: durations (timeouts, drain, restart windows): a week. Floats past it are
  never meant, and huge ones overflow `threading` waits and deadlines (`.inf` is refused
  everywhere by the models' `allow_inf_nan=False`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omnirail.config.errors import ConfigError, clip, short, stage_label

MAX_FILE_BYTES = 1 << 20
MAX_DEPTH = 64
MAX_VALUES = 100_000
MAX_STAGES = 1024

MAX_CPU_ID = 8191
MAX_GPU_ID = 1023
MAX_MESSAGE_MB = 1024
MAX_MB = 1 << 20
MAX_COUNT = 1 << 20
MAX_RANKS = 1024
MAX_SECONDS = 7 * 24 * 3600.0


# Values that hold no others: counted by their container, never walked.
_LEAVES = (str, int, float, type(None), bytes)


def check_shape(data: Any, root: str = "pipeline") -> None:
    """Refuses data nested deeper than `MAX_DEPTH`, holding more than `MAX_VALUES` values
    (shared containers count every time they occur) or containing itself.

    Walks iteratively and stops at the first bound it passes, so the cost is at most
    `MAX_VALUES` steps whatever `data` is (a Python config may build any object graph).
    """
    count = 1
    on_path: list[int] = []  # ids of the containers being walked, root first
    path: list[Any] = []  # the key or index of each of them in its parent (root: None)
    # (depth, key in its parent, value); depth -1 marks leaving the container on_path[-1].
    todo: list[tuple[int, Any, Any]] = [(0, None, data)]
    while todo:
        depth, key, value = todo.pop()
        if depth < 0:
            on_path.pop()
            path.pop()
            continue
        if isinstance(value, Mapping):
            children = list(value.items())
            added = 2 * len(children)  # keys count as values
        elif isinstance(value, list | tuple):
            children = list(enumerate(value))
            added = len(children)
        else:
            continue
        count += added
        if count > MAX_VALUES:
            raise ConfigError(
                f"{_where(root, path, key, data)}: the config holds more than {MAX_VALUES} values "
                "(a YAML alias counts each time it is used); refusing to expand it"
            )
        if id(value) in on_path:  # at most MAX_DEPTH long
            raise ConfigError(
                f"{_where(root, path, key, data)}: contains itself (a recursive alias or reference)"
            )
        if depth >= MAX_DEPTH:
            raise ConfigError(
                f"{_where(root, path, key, data)}: nested deeper than {MAX_DEPTH} levels"
            )
        on_path.append(id(value))
        path.append(key)
        todo.append((-1, None, None))
        # Only containers are walked; scalars were counted above.
        todo.extend((depth + 1, k, v) for k, v in reversed(children) if not isinstance(v, _LEAVES))


def _where(root: str, path: list[Any], key: Any, data: Any) -> str:
    """Where a value is, in the terms of the other config errors: `stages[a].env.X` (an
    int key of a mapping reads like a list index; both say where to look)."""
    keys = [*path[1:], key] if path else []
    head = root
    if root == "pipeline" and len(keys) >= 2 and keys[0] == "stages" and isinstance(keys[1], int):
        stages = data.get("stages") if isinstance(data, Mapping) else None
        head, keys = f"stages[{stage_label(stages, keys[1])}]", keys[2:]
    parts = [head]
    for k in keys:
        parts.append(f".{clip(k, 40)}" if isinstance(k, str) else f"[{short(k, 40)}]")
    return clip("".join(parts), 400)
