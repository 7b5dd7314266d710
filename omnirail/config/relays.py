"""What one process opens each relay backend with, decided once and checked.

Relay fields split in two (see `RelayConfig`):

- per edge: `backend`, `inline_bytes`, `credits`, `credit_mb`: every edge gets the value
  of its own merged config (`PipelineConfig.relay_for(stage, target)`);
- per process: `pool_mb`, `device`, `rank`, `world_size` and `options`: a process opens
  each backend once (`omnirail.stage_service.relays`), so one value serves all its edges.

The rule for the per-process fields of backend B in process P (`process_relays`):

1. P sends with B when one of its stages selects B for its own relay (its stage-level
   config, `relay_for(stage)`, which the process opens whether or not an edge uses it) or
   for an outgoing edge (`relay_for(stage, target)`). Then P opens B with the per-process
   fields of these sending configs, which must agree: the stage-level ones come first
   (what the process "already opens" B with), so a `relay_to` (or another stage's
   `relay`) that sets a different value is refused rather than dropped. The configs of
   the edges P receives over are the senders' (they configure the upstream process) and
   do not change what P opens.
2. P only receives over B: it opens B with the per-process fields of the edges it
   receives over (the senders' configs, e.g. nixl's `ucx_error_handling_mode` of a
   cross-host edge), which must then agree.

`rank` is the process's, for every backend: its stages' stage-level `rank` (the first one
set); a sending config that sets another rank is refused, and the ranks in the configs of
edges P receives over are the senders'.

"Agree": `pool_mb`, `device` and `world_size` always have a value (defaults included),
which must be the same. `options` is a mapping whose levels each name only the keys they
set: P opens B with every key any of those configs sets, and two configs that set one key
to different values (compared typed: 30 equals 30.0) conflict.
Importable without the relay backends (the options models need pydantic only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omnirail.config.errors import clip, short
from omnirail.config.graph import StageIndex

if TYPE_CHECKING:
    from omnirail.config.models import PipelineConfig, RelayConfig

PER_EDGE_FIELDS = ("backend", "inline_bytes", "credits", "credit_mb")
PER_PROCESS_FIELDS = ("pool_mb", "device", "rank", "world_size", "options")
DEFAULT = "the default"


@dataclass
class Use:
    """One config a process opens a backend for: an edge (or a stage's own relay)."""

    edge: str  # "a->b"; "a->*" is stage a's own relay (targets outside its static edges)
    stage: str  # the sending stage (the config is its `relay_for(stage, target)`)
    target: str | None
    config: RelayConfig
    # Field -> the level that set it ("pipeline.relay", "stages[a].relay", ...).
    origins: dict[str, str]

    def origin(self, name: str) -> str:
        return self.origins.get(name, DEFAULT)

    def place(self, name: str) -> str:
        """Where to report a problem with field `name` of this config."""
        where = self.origins.get(name)
        if where is not None:
            return where
        if self.target is not None:
            return f"stages[{self.stage}].relay_to[{clip(self.target)}]"
        return f"stages[{self.stage}].relay"


@dataclass
class ProcessRelay:
    """Backend `backend` as one process opens it."""

    backend: str
    # The per-process fields are what the process opens the backend with; the per-edge
    # ones are those of `source`, the default of an edge that gets no credits of its own.
    config: RelayConfig
    edges: list[str] = field(default_factory=list)
    source: str = ""  # the edge whose config decided the per-process fields
    receive_only: bool = False


def use_of(
    cfg: PipelineConfig, stage: str, target: str | None = None, index: StageIndex | None = None
) -> Use:
    """`relay_for(stage, target)` with where each field was set (same merge). `index`
    (of `cfg.stages`) makes the stage lookup O(1) for callers that ask for every stage."""
    s = index.stage(stage) if index is not None else cfg.stage(stage)
    merged = cfg.relay
    origins = dict.fromkeys(cfg.relay.model_fields_set, "pipeline.relay")
    # Levels that set nothing are skipped: validation asks this for every edge, and most
    # edges have no overrides.
    if s.relay is not None:
        merged, changed = merged.updated_by(s.relay)
        origins.update(dict.fromkeys(changed, f"stages[{stage}].relay"))
    edge_relay = s.relay_to.get(target) if target is not None else None
    if edge_relay is not None:
        merged, changed = merged.updated_by(edge_relay)
        origins.update(dict.fromkeys(changed, f"stages[{stage}].relay_to[{clip(target)}]"))
    # A target may be a dangling reference (reported elsewhere): shown clipped.
    edge = f"{stage}->{clip(target) if target is not None else '*'}"
    return Use(edge, stage, target, merged, origins)


def relays_touching(
    cfg: PipelineConfig, stage: str, index: StageIndex
) -> list[tuple[str, RelayConfig]]:
    """`PipelineConfig.relays_touching` through `index` (linear over all stages)."""
    found = [(f"{stage}->*", use_of(cfg, stage, None, index).config)]
    found += [(f"{stage}->{t}", use_of(cfg, stage, t, index).config) for t in index.edges_of(stage)]
    for up in index.upstream_of(stage) + index.stream_sources_of(stage):
        found.append((f"{up}->{stage}", use_of(cfg, up, stage, index).config))
    return found


def process_relays(
    cfg: PipelineConfig,
    stage_names: list[str],
    process: str | None = None,
    index: StageIndex | None = None,
) -> tuple[dict[str, ProcessRelay], list[str]]:
    """The backends a process hosting `stage_names` opens, each with the config it opens
    it with (see the module docstring), and the problems that keep a per-process field
    from applying, each naming where it was set. `index` (of `cfg.stages`) is built when
    not given; validation passes one for every process."""
    process = process or (stage_names[0] if stage_names else "")
    index = index if index is not None else StageIndex.of(cfg.stages)
    sending = [use_of(cfg, s, None, index) for s in stage_names]
    sending += [use_of(cfg, s, t, index) for s in stage_names for t in index.edges_of(s)]
    sent = {u.edge for u in sending}
    receiving = [
        use_of(cfg, up, s, index)
        for s in stage_names
        for up in dict.fromkeys(index.upstream_of(s) + index.stream_sources_of(s))
        if f"{up}->{s}" not in sent
    ]
    problems: list[str] = []
    # The process's rank: its stages' own (stage-level); any other rank a sending config
    # sets could not apply. Receivers' ranks in the senders' configs are theirs.
    ranked = [u for u in sending if u.config.rank is not None]
    own_rank = ranked[0].config.rank if ranked else None
    for use in ranked[1:]:
        if use.config.rank != own_rank:
            problems.append(_conflict(process, "", "rank", ranked[0], use, True))
    # Uses grouped by backend in one pass: a process may name as many backends as it has
    # edges (unknown ones included), and a scan per backend would be quadratic.
    sends_of: dict[str, list[Use]] = {}
    receives_of: dict[str, list[Use]] = {}
    edges_of: dict[str, list[str]] = {}
    for group, found in ((sends_of, sending), (receives_of, receiving)):
        for u in found:
            group.setdefault(u.config.backend, []).append(u)
            edges_of.setdefault(u.config.backend, []).append(u.edge)
    opened: dict[str, ProcessRelay] = {}
    for backend, edges in edges_of.items():
        sends = sends_of.get(backend, [])
        uses = sends or receives_of[backend]
        base = uses[0]
        scalars = [f for f in PER_PROCESS_FIELDS if f not in ("options", "rank")]
        options: dict[str, tuple[Any, Use]] = {}  # key -> (value, the first use setting it)
        for use in uses:
            for name in scalars:
                if getattr(use.config, name) != getattr(base.config, name):
                    problems.append(_conflict(process, backend, name, base, use, bool(sends)))
            for key, value in use.config.options.items():
                first = options.setdefault(key, (value, use))
                if not _same_option(backend, key, first[0], value):
                    label = f"options.{key}"
                    problems.append(_conflict(process, backend, label, first[1], use, bool(sends)))
        merged = {k: v for k, (v, _) in options.items()}
        config = base.config.model_copy(update={"options": merged, "rank": own_rank})
        real = [e for e in edges if not e.endswith("->*")]
        opened[backend] = ProcessRelay(backend, config, real or edges, base.edge, not sends)
    return opened, list(dict.fromkeys(problems))


def _same_option(backend: str, key: str, a: Any, b: Any) -> bool:
    """Whether two values of option `key` are the same once typed (30 and 30.0 are); as
    given when the backend refuses one (that is reported where it is set)."""
    if a == b:
        return True
    from omnirail.relay import registry
    from omnirail.relay.options import OptionsError, parse_options

    model = registry.options_model(backend)
    if model is None:
        return False
    try:
        x, y = (getattr(parse_options(backend, model, {key: v}), key) for v in (a, b))
    except OptionsError:
        return False
    return x == y


def _value(config: RelayConfig, label: str) -> Any:
    if label.startswith("options."):
        return config.options.get(label.removeprefix("options."))
    return getattr(config, label)


def _conflict(process: str, backend: str, label: str, base: Use, use: Use, sends: bool) -> str:
    name = label.split(".", 1)[0]  # the field: "options" for "options.KEY"
    value, first = _value(use.config, label), _value(base.config, label)
    mine = "" if name in use.origins else f" ({DEFAULT})"
    if not backend:
        how = f"process {process!r} has one rank for all its relays"
    elif sends:
        how = f"process {process!r} opens one {short(backend)} relay for all its edges"
    else:
        how = (
            f"process {process!r} only receives over {short(backend)} and opens one relay for "
            f"all those edges (the senders' configs, here {base.edge} and {use.edge})"
        )
    what = "options are" if name == "options" else f"{name} is"
    origin = base.origin(name)
    source = origin if origin == DEFAULT else f"from {origin}"
    shown = clip(label)  # an option key is input
    return (
        f"{use.place(name)}.{shown}: {what} per process: {how}, with {shown} {short(first)} "
        f"({source}), not {short(value)}{mine}"
    )
