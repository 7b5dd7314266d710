"""Cross-stage rules of a pipeline config; every problem is collected before raising."""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from omnirail.config import dotted
from omnirail.config.api import api_problems
from omnirail.config.errors import ConfigError, clip, join_bounded, short
from omnirail.config.graph import StageIndex, walk_graph

if TYPE_CHECKING:
    from omnirail.config.models import PipelineConfig, StageConfig

_ENV_NAME_RE = re.compile(r"\A[A-Za-z_][A-Za-z0-9_]*\Z")  # \Z: no trailing newline


_HOOK_FIELDS = ("factory", "route_fn", "wait_for_fn", "merge_fn", "stream_done_to_fn")
# Cycles listed one by one; past these the rest are counted (each needs its own path).
_MAX_CYCLES = 10


def validate(cfg: PipelineConfig, resolve: bool = True) -> None:
    """Checks every static rule; raises ConfigError listing all problems.

    With `resolve`, every dotted path is imported and must be callable. Linear in the
    size of the config: every per-stage lookup goes through one `StageIndex`.
    """
    errors: list[str] = []
    err = errors.append
    index = cfg.index
    by_name = index.by_name
    first_at: dict[str, int] = {}
    for i, s in enumerate(cfg.stages):
        if s.name in first_at:
            first = first_at[s.name]
            err(f"stages[{s.name}].name: duplicate stage name (stages[{first}] and stages[{i}])")
        else:
            first_at[s.name] = i
    known = set(by_name)

    entry = cfg.resolved_entry_stage
    if cfg.entry_stage is not None and cfg.entry_stage not in known:
        err(f"pipeline.entry_stage: unknown stage {short(cfg.entry_stage)}")
    if not cfg.terminal_stages:
        err("pipeline.stages: no terminal stage (set terminal: true on at least one stage)")

    for s in by_name.values():
        _check_stage(s, known, by_name, index.upstream, entry, err)

    _check_graph(cfg, by_name, entry, known, err)
    _check_fused(cfg, by_name, err)
    _check_processes(cfg, by_name, err)

    for key in cfg.runtime_overrides:
        if key not in known:
            err(f"pipeline.runtime_overrides[{clip(key)}]: unknown stage {short(key)}")
    _check_env("pipeline.env_defaults", cfg.env_defaults, err)

    _check_torchdist(cfg, index, err)
    problem = _backend_problem(cfg.relay.backend)
    if problem:
        err(f"pipeline.relay.backend: {problem}")
    _check_relay_options(cfg, index, err)
    _check_relay_devices(cfg, by_name, err)
    _check_process_relays(cfg, index, err)
    _check_dotted(cfg, by_name, resolve, err)
    for problem in api_problems(cfg.api, set(cfg.terminal_stages)):
        err(problem)
    if errors:
        # One line per problem: a repeated list entry would otherwise repeat its lines.
        raise ConfigError(list(dict.fromkeys(errors)))


def _check_stage(
    s: StageConfig,
    known: set[str],
    by_name: Mapping[str, StageConfig],
    upstream: Mapping[str, list[str]],
    entry: str,
    err: Any,
) -> None:
    at = f"stages[{s.name}]"
    nxt = s.next
    targets = set(nxt or ())  # membership tests below stay O(1) for long lists
    if nxt is not None and s.terminal:
        err(f"{at}.terminal: set exactly one of next / terminal=True (both set)")
    elif nxt is None and not s.terminal:
        err(f"{at}.next: set exactly one of next / terminal=True (neither set)")
    if nxt is not None and not nxt:
        err(f"{at}.next: must name at least one stage")
    _check_refs(at, "next", nxt or [], s.name, known, err)
    if s.route_fn is not None and not nxt:
        err(f"{at}.route_fn: only valid on a stage with next (not on terminal stages)")

    # Fan-in: wait_for is the static superset of upstream stages and must match `next`
    # edges exactly, so the runtime knows every payload that can arrive.
    ups = upstream.get(s.name, [])
    if s.wait_for is not None:
        waits, up_set = set(s.wait_for), set(ups)
        if s.merge_fn is None:
            err(f"{at}.merge_fn: required when wait_for is set")
        if not s.wait_for:
            err(f"{at}.wait_for: must name at least one stage")
        if s.name == entry:
            err(f"{at}.wait_for: the entry stage cannot wait for other stages")
        _check_refs(at, "wait_for", s.wait_for, s.name, known, err)
        for w in dict.fromkeys(s.wait_for):
            if w in known and w != s.name and w not in up_set:
                err(f"{at}.wait_for: stage {w!r} does not list {s.name!r} in its next")
        missing = [u for u in ups if u not in waits]
        if missing:
            listed = join_bounded([repr(u) for u in missing])
            err(f"{at}.wait_for: missing upstream stage(s) {listed}")
    else:
        if s.merge_fn is not None:
            err(f"{at}.merge_fn: requires wait_for")
        if s.wait_for_fn is not None:
            err(f"{at}.wait_for_fn: requires wait_for")
        if len(ups) > 1:
            err(
                f"{at}.wait_for: required: stage has {len(ups)} upstream stages "
                f"({join_bounded(ups)}) and must declare wait_for covering them"
            )

    _check_refs(at, "stream_to", s.stream_to, s.name, known, err)
    if s.stream_done_to_fn is not None and not s.stream_to:
        err(f"{at}.stream_done_to_fn: requires stream_to")
    streams = set(s.stream_to)
    for target in s.relay_to:
        if target not in targets and target not in streams:
            err(f"{at}.relay_to: {short(target)} is not in next or stream_to")
    for where, relay in [
        ("relay", s.relay),
        *((f"relay_to[{clip(t)}]", r) for t, r in s.relay_to.items()),
    ]:
        if relay is not None and "backend" in relay.model_fields_set:
            problem = _backend_problem(relay.backend)
            if problem:
                err(f"{at}.{where}.backend: {problem}")
    for target in s.project_payload:
        if target not in targets:
            err(f"{at}.project_payload: target {short(target)} is not in next")

    # TP ranks: one GPU each (a list of tp_size ids), or none at all (CPU ranks, gloo).
    if isinstance(s.gpu, list):
        if len(s.gpu) != s.tp_size:
            err(f"{at}.gpu: {len(s.gpu)} GPU id(s) listed but tp_size is {s.tp_size}")
        if len(set(s.gpu)) != len(s.gpu):
            err(f"{at}.gpu: duplicate GPU ids {short(s.gpu)}")
    elif s.gpu is not None and s.tp_size > 1:
        err(f"{at}.gpu: tp_size {s.tp_size} needs a list of {s.tp_size} GPU ids, one per rank")
    _check_env(f"{at}.env", s.env, err)


def _check_env(at: str, env: Mapping[str, str], err: Any) -> None:
    for key, value in env.items():
        if not _ENV_NAME_RE.match(key):
            err(f"{at}: invalid variable name {short(key)}")
        elif "\0" in value:
            # The OS cannot set it: os.environ refuses it when the process starts.
            err(f"{at}.{clip(key)}: a variable's value cannot contain a NUL character")


def _check_torchdist(cfg: PipelineConfig, index: StageIndex, err: Any) -> None:
    """torchdist needs an explicit rank topology: one rank per process that uses it (the
    stage's `relay.rank`), and `world_size` and `options.init_method` on its edges."""
    from omnirail.config.relays import relays_touching, use_of

    ranks: dict[int, str] = {}
    for name, s in index.by_name.items():
        try:
            touching = relays_touching(cfg, name, index)
        except KeyError:
            continue  # a dangling reference, reported elsewhere
        edges = [(e, r) for e, r in touching if r.backend == "torchdist"]
        if not edges:
            continue
        at = f"stages[{name}].relay"
        rank = use_of(cfg, name, None, index).config.rank
        if rank is None:
            err(f"{at}.rank: required: the stage sends or receives over torchdist ({edges[0][0]})")
        for edge, relay in edges:
            if relay.world_size is None:
                err(f"{at}: edge {edge} uses torchdist but sets no world_size")
            elif rank is not None and rank >= relay.world_size:
                err(f"{at}.rank: rank {rank} must be < world_size {relay.world_size} ({edge})")
            if not relay.options.get("init_method"):
                err(f"{at}: edge {edge} uses torchdist but sets no options.init_method")
        if s.replicas != 1:
            err(f"stages[{name}].replicas: torchdist ranks are static; replicas must be 1")
        group = s.process or name
        owner = ranks.get(rank) if rank is not None else None
        if owner is not None and owner != group:
            err(f"{at}.rank: rank {rank} is also used by process {owner!r}")
        if rank is not None:
            ranks.setdefault(rank, group)


def _check_relay_options(cfg: PipelineConfig, index: StageIndex, err: Any) -> None:
    """Options set at each level, against the backend the level's merged config selects
    (`pipeline.relay`, `stages[x].relay`, `stages[x].relay_to[t]`): unknown keys, types
    and ranges, as the backend's options model (`omnirail.relay.options`) checks them,
    and no NaN or infinity (no option is meant to be one)."""
    from omnirail.config.relays import use_of

    levels: list[tuple[str, str, dict[str, Any]]] = [
        ("pipeline.relay", cfg.relay.backend, cfg.relay.options)
    ]
    for name, s in index.by_name.items():
        if s.relay is not None and "options" in s.relay.model_fields_set:
            backend = use_of(cfg, name, None, index).config.backend
            levels.append((f"stages[{name}].relay", backend, s.relay.options))
        for target, relay in s.relay_to.items():
            if "options" in relay.model_fields_set:
                backend = use_of(cfg, name, target, index).config.backend
                levels.append((f"stages[{name}].relay_to[{clip(target)}]", backend, relay.options))
    for where, backend, options in levels:
        problems = dict(_option_problems(backend, options))
        for key, value in options.items():
            if key not in problems and isinstance(value, float) and not math.isfinite(value):
                problems[key] = f"must be a finite number, not {value}"
        for key, problem in problems.items():
            err(f"{where}.options.{clip(str(key))}: {problem}")


# What `relay.device` can say today: every backend holds its pool in host memory, and a
# CUDA tensor crosses any edge staged through it (the payload records its device; the
# receiver puts it on its own stage's device). Pools in device memory (NIXL VRAM, NCCL
# through torchdist) are not built: a setting asking for one is refused, not ignored.
_RELAY_DEVICES = ("cpu",)


def _check_relay_devices(cfg: PipelineConfig, by_name: Mapping[str, StageConfig], err: Any) -> None:
    levels: list[tuple[str, Any]] = [("pipeline.relay", cfg.relay)]
    for name, s in by_name.items():
        levels.append((f"stages[{name}].relay", s.relay))
        levels += [(f"stages[{name}].relay_to[{t}]", r) for t, r in s.relay_to.items()]
    for where, relay in levels:
        if relay is not None and relay.device not in _RELAY_DEVICES:
            err(
                f"{where}.device: {short(relay.device)} is not supported; relay pools are in host "
                "memory, and CUDA tensors cross every edge through them (the receiver gets "
                "them on its own stage's device). Leave device unset"
            )


def _option_problems(backend: str, options: dict[str, Any]) -> list[tuple[str, str]]:
    from omnirail.relay import registry
    from omnirail.relay.options import option_problems

    model = registry.options_model(backend)
    if model is None:
        return []  # an unknown backend: reported where it is set
    return option_problems(backend, model, options)


def _check_process_relays(cfg: PipelineConfig, index: StageIndex, err: Any) -> None:
    """Per-process relay fields one process could not apply (see omnirail.config.relays)."""
    from omnirail.config.relays import process_relays

    for group, members in cfg.process_groups().items():
        try:
            _, problems = process_relays(cfg, list(dict.fromkeys(members)), group, index)
        except KeyError:
            continue  # a dangling reference, reported elsewhere
        for problem in problems:
            err(problem)


def _backend_problem(backend: str) -> str | None:
    from omnirail.relay.registry import BACKENDS

    if backend in BACKENDS:
        return None
    return f"unknown relay backend {short(backend)}; known: {', '.join(sorted(BACKENDS))}"


def _check_refs(
    at: str, field: str, refs: list[str], self_name: str, known: set[str], err: Any
) -> None:
    seen: set[str] = set()
    for r in refs:
        if r in seen:
            err(f"{at}.{field}: duplicate entry {short(r)}")
            continue
        seen.add(r)
        if r == self_name:
            err(f"{at}.{field}: a stage cannot name itself ({r!r})")
        elif r not in known:
            err(f"{at}.{field}: unknown stage {short(r)}")


def _check_graph(
    cfg: PipelineConfig, by_name: Mapping[str, StageConfig], entry: str, known: set[str], err: Any
) -> None:
    # Each edge once (duplicates are reported by _check_refs): every back edge found
    # below then closes a different cycle.
    nxt = {
        n: list(dict.fromkeys(d for d in s.next_stages if d in known and d != n))
        for n, s in by_name.items()
    }
    # Iterative DFS colouring; each back edge closes one cycle, reported once. Listing a
    # cycle costs its length, so past _MAX_CYCLES of them the rest are only counted.
    state: dict[str, int] = {}
    reported: set[frozenset[str]] = set()
    unlisted = 0
    for root in by_name:
        if root in state:
            continue
        path: list[str] = [root]
        at: dict[str, int] = {root: 0}  # position on `path` of each stage on it
        iters = [iter(nxt[root])]
        state[root] = 1
        while iters:
            child = next(iters[-1], None)
            if child is None:
                done = path.pop()
                del at[done]
                state[done] = 2
                iters.pop()
            elif state.get(child) == 1:
                if len(reported) >= _MAX_CYCLES:
                    unlisted += 1
                    continue
                cycle = [*path[at[child] :], child]
                if frozenset(cycle) not in reported:
                    reported.add(frozenset(cycle))
                    err(f"stages[{child}].next: cycle in next graph: {join_bounded(cycle, ' -> ')}")
            elif child not in state:
                state[child] = 1
                at[child] = len(path)
                path.append(child)
                iters.append(iter(nxt[child]))
    if unlisted:
        err(f"pipeline.stages: {unlisted} more cycle(s) in the next graph not listed")

    if entry in known:
        reach = walk_graph(
            {entry}, {n: set(s.next_stages) | set(s.stream_to) for n, s in by_name.items()}
        )
        for n in by_name:
            if n not in reach:
                err(f"stages[{n}]: not reachable from entry stage {entry!r} via next or stream_to")

    terminals = {n for n, s in by_name.items() if s.terminal}
    if terminals:
        reverse: dict[str, set[str]] = {}
        for n, ds in nxt.items():
            for d in ds:
                reverse.setdefault(d, set()).add(n)
        reaches_terminal = walk_graph(terminals, reverse)
        for n, s in by_name.items():
            if s.next and n not in reaches_terminal:
                err(f"stages[{n}].next: no terminal stage is reachable from this stage")


def _check_fused(cfg: PipelineConfig, by_name: Mapping[str, StageConfig], err: Any) -> None:
    owner: dict[str, int] = {}
    for gi, group in enumerate(cfg.fused_stages):
        at = f"pipeline.fused_stages[{gi}]"
        if len(group) < 2:
            err(f"{at}: a fused group needs at least 2 stages, got {short(group)}")
        if len(set(group)) != len(group):
            err(f"{at}: duplicate stage in {short(group)}")
        for n in group:
            if n not in by_name:
                err(f"{at}: unknown stage {short(n)}")
                continue
            if n in owner and owner[n] != gi:
                err(f"{at}: stage {n!r} is already in fused_stages[{owner[n]}]")
            owner.setdefault(n, gi)
            if by_name[n].tp_size > 1:
                err(f"{at}: stage {n!r} has tp_size {by_name[n].tp_size}; TP stages cannot fuse")
        for a, b in itertools.pairwise(group):
            if a not in by_name or b not in by_name:
                continue
            a_next = by_name[a].next_stages
            if b not in a_next:
                err(f"{at}: {a!r} -> {b!r} is not a next edge (fused stages must be linear)")
            elif len(a_next) != 1:
                err(f"{at}: {a!r} must route only to {b!r} (its next has {len(a_next)} stages)")


def _check_processes(cfg: PipelineConfig, by_name: Mapping[str, StageConfig], err: Any) -> None:
    for group, members in cfg.process_groups().items():
        stages = [by_name[m] for m in dict.fromkeys(members) if m in by_name]
        if len(stages) < 2:
            continue
        for s in stages:
            if s.tp_size > 1:
                others = join_bounded([o.name for o in stages if o is not s])
                err(
                    f"stages[{s.name}].process: TP stage cannot share process {group!r} "
                    f"with {others}"
                )
        gpus = sorted({g for s in stages if s.tp_size == 1 for g in s.gpus})
        if len(gpus) > 1:
            err(
                f"stages[{stages[0].name}].process: process {group!r} spans GPUs "
                f"{short(gpus)}; "
                "a process may use at most one GPU"
            )
        replicas = {s.replicas for s in stages}
        if len(replicas) > 1:
            detail = join_bounded([f"{s.name}={s.replicas}" for s in stages])
            err(
                f"stages[{stages[0].name}].replicas: stages sharing process {group!r} "
                f"must have equal replicas ({detail})"
            )


def _check_dotted(
    cfg: PipelineConfig, by_name: Mapping[str, StageConfig], resolve: bool, err: Any
) -> None:
    paths: list[tuple[str, str]] = []
    for n, s in by_name.items():
        for field in _HOOK_FIELDS:
            value = getattr(s, field)
            if value is not None:
                paths.append((f"stages[{n}].{field}", value))
        for target, fn in s.project_payload.items():
            paths.append((f"stages[{n}].project_payload[{clip(target)}]", fn))
    if cfg.terminal_stages_fn is not None:
        paths.append(("pipeline.terminal_stages_fn", cfg.terminal_stages_fn))
    for where, path in paths:
        problem = dotted.syntax_error(path)
        if problem is None and resolve:
            problem = _resolve_problem(path, cfg.source_dir)
        if problem is not None:
            err(f"{where}: {problem}")


def _resolve_problem(path: str, base_dir: str | None) -> str | None:
    try:
        obj = dotted.resolve(path, base_dir)
    except (ImportError, AttributeError, ValueError) as exc:
        return str(exc)
    if not callable(obj):
        return f"{short(path)} is not callable (got {type(obj).__name__})"
    return None
