"""Loading pipeline files (YAML or Python) and printing their topology."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from omnirail.config import dotted
from omnirail.config.errors import clip, short
from omnirail.config.models import ConfigError, PipelineConfig, validation_error_lines
from omnirail.config.validation import validate
from omnirail.config.yaml_loader import read_yaml
from omnirail.tuning.cpus import format_cpus


def load_pipeline(path: str | os.PathLike[str], *, resolve: bool = True) -> PipelineConfig:
    """Loads and validates a `.yaml`/`.yml` or `.py` pipeline file.

    A `.py` file defines `pipeline` (a PipelineConfig or a dict) or `build_pipeline()`
    returning one. The file's directory becomes `source_dir` and is put on sys.path.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: no such file", source=str(p))
    source_dir = str(p.resolve().parent)
    suffix = p.suffix.lower()
    try:
        if suffix in (".yaml", ".yml"):
            # The YAML loader bounds size, depth and recursion as it composes.
            data = _read_yaml(p)
            cfg = PipelineConfig._from_bounded(data, source_dir=source_dir, resolve=resolve)
        elif suffix == ".py":
            cfg = _load_py(p, source_dir, resolve)
        else:
            raise ConfigError(f"{p}: unsupported config type {suffix!r} (use .yaml, .yml or .py)")
    except ConfigError as exc:
        exc.source = str(p)
        raise
    return cfg


def _read_yaml(p: Path) -> Mapping[str, Any]:
    data = read_yaml(p)
    if not isinstance(data, Mapping):
        raise ConfigError(f"{p}: top level must be a mapping, got {type(data).__name__}")
    return data


def _load_py(p: Path, source_dir: str, resolve: bool) -> PipelineConfig:
    dotted.add_sys_path(source_dir)
    digest = hashlib.sha1(str(p.resolve()).encode(), usedforsecurity=False).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(f"_omnirail_pipeline_{digest}", p)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{p}: cannot load as a Python module")
    module = importlib.util.module_from_spec(spec)
    # Registered like a normal import: dataclasses and other introspection in the
    # file look the module up by name while it executes.
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        if hasattr(module, "pipeline"):
            obj = module.pipeline
        elif callable(getattr(module, "build_pipeline", None)):
            obj = module.build_pipeline()
        else:
            raise ConfigError(f"{p}: defines neither `pipeline` nor `build_pipeline()`")
        if isinstance(obj, PipelineConfig):
            # Copying runs inside the try: a config built in Python may hold anything in
            # factory_args (a structure too deep to copy fails like the module would).
            cfg = obj.model_copy(deep=True)
            cfg.source_dir = source_dir
            validate(cfg, resolve=resolve)
            return cfg
        if isinstance(obj, Mapping):
            return PipelineConfig.from_dict(obj, source_dir=source_dir, resolve=resolve)
    except ConfigError:
        raise
    except ValidationError as exc:
        raise ConfigError(validation_error_lines(exc)) from None
    except SystemExit as exc:
        # sys.exit() (or argparse's exit on unknown arguments) in the file would end the
        # coordinator or `omnirail validate` with no word on why.
        raise ConfigError(
            f"{p}: called exit({short(exc.code)}) while loading; a pipeline file defines "
            "`pipeline` or `build_pipeline()` and returns"
        ) from None
    except Exception as exc:
        raise ConfigError(
            f"{p}: error while loading: {type(exc).__name__}: {clip(str(exc), 500)}"
        ) from exc
    raise ConfigError(
        f"{p}: `pipeline` must be a PipelineConfig or a dict, got {type(obj).__name__}"
    )


# -- reporting -------------------------------------------------------------------------


def format_topology(cfg: PipelineConfig) -> str:
    """Human-readable summary printed by `omnirail validate`."""
    r = cfg.relay
    lines = [
        f"pipeline: {cfg.name}",
        f"entry: {cfg.resolved_entry_stage}",
        f"terminals: {', '.join(cfg.terminal_stages)}",
    ]
    if cfg.terminal_stages_fn:
        lines.append(f"terminal_stages_fn: {cfg.terminal_stages_fn}")
    lines.append(
        f"relay: {r.backend} (inline <= {r.inline_bytes} B, pool {r.pool_mb} MiB, "
        f"{r.credits} credits / {r.credit_mb} MiB per edge)"
    )
    if cfg.cpu_wake_latency_us is not None:
        lines.append(
            f"cpu wake latency: idle CPUs held to wake within {cfg.cpu_wake_latency_us} µs"
        )
    lines.append("processes:")
    if cfg.coordinator_cpus:
        lines.append(f"  coordinator [cpus={format_cpus(cfg.coordinator_cpus)}]")
    for group, members in cfg.process_groups().items():
        cpus = cfg.process_cpus(members)
        pinned = f" [cpus={format_cpus(cpus)}]" if cpus else ""
        lines.append(f"  {group}: {', '.join(members)}{pinned}")
    lines.append("stages:")
    for s in cfg.stages:
        extras = []
        if s.gpu is not None:
            extras.append(f"gpu={s.gpu}")
        if s.tp_size > 1:
            extras.append(f"tp={s.tp_size}")
        if s.replicas > 1:
            extras.append(f"replicas={s.replicas}")
        if s.relay is not None:
            extras.append(f"relay={cfg.relay_for(s.name).backend}")
        suffix = f" [{', '.join(extras)}]" if extras else ""
        lines.append(f"  {s.name}{suffix}")
        lines.append(f"    factory: {s.factory}")
        if s.terminal:
            lines.append("    terminal: yes")
        if s.next:
            lines.append(f"    next: {', '.join(s.next)}")
        if s.route_fn:
            lines.append(f"    route_fn: {s.route_fn}")
        if s.wait_for:
            how = f" (merge_fn: {s.merge_fn}" + (
                f", wait_for_fn: {s.wait_for_fn})" if s.wait_for_fn else ")"
            )
            lines.append(f"    wait_for: {', '.join(s.wait_for)}{how}")
        if s.stream_to:
            done = f" (stream_done_to_fn: {s.stream_done_to_fn})" if s.stream_done_to_fn else ""
            lines.append(f"    stream_to: {', '.join(s.stream_to)}{done}")
        for target, fn in s.project_payload.items():
            lines.append(f"    project {target}: {fn}")
    return "\n".join(lines)
