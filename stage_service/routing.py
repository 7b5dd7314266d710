"""Where a stage's outputs go: `next` and `route_fn` for results, `stream_to` and
`stream_done_to_fn` for streams, narrowed to the branches that can still reach a terminal
stage the request waits for. Pure decisions; the stage does the sending.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from omnirail.config import StageConfig, dotted
from omnirail.relay.base import RelayHandle
from omnirail.stage.scheduler import CLIENT
from omnirail.v1 import mesh_pb2
from omnirail.wire.errors import internal


class Router(Protocol):
    """Process-level delivery: picks a replica of `to_stage` and queues the item."""

    def deliver(self, item: mesh_pb2.DeliverItem, handle: RelayHandle | None) -> None: ...

    def possible_stages(self, terminals: tuple[str, ...]) -> frozenset[str]: ...


class Routes:
    """One stage's outgoing edges and its routing hooks."""

    __slots__ = (
        "_next",
        "_route_fn",
        "_router",
        "_stage",
        "_stream_done_to_fn",
        "_terminal",
        "project",
        "stream_to",
    )

    def __init__(self, stage: str, cfg: StageConfig, base: str | None, router: Router) -> None:
        self._stage = stage
        self._router = router
        self._next = tuple(cfg.next_stages)
        self.stream_to = tuple(cfg.stream_to)
        self._terminal = cfg.terminal
        # Hooks, resolved from the config's dotted paths.
        self._route_fn = dotted.resolve(cfg.route_fn, base) if cfg.route_fn else None
        # Per target: makes the payload that target gets from the stage's output.
        self.project: dict[str, Callable[[Any], Any]] = {
            t: dotted.resolve(p, base) for t, p in cfg.project_payload.items()
        }
        done_to = cfg.stream_done_to_fn
        self._stream_done_to_fn = dotted.resolve(done_to, base) if done_to else None

    def targets(self, rid: str, output: Any, meta: mesh_pb2.RequestMeta) -> list[str]:
        """The stages a result goes to."""
        if self._route_fn is not None:
            chosen = check_subset(
                self._route_fn(rid, output), self._next, "route_fn", "next", self._stage
            )
            targets = [t for t in self._next if t in chosen]
        else:
            targets = list(self._next)
        if meta.terminal_stages:
            # Skip branches that cannot reach a terminal this request waits for.
            possible = self._router.possible_stages(tuple(meta.terminal_stages))
            targets = [t for t in targets if t in possible]
            if not targets:
                raise internal(
                    f"no route from {self._stage!r} to the request's terminal stages "
                    f"{list(meta.terminal_stages)}",
                    self._stage,
                )
        return targets

    def chunk_destinations(
        self, target: str | None, meta: mesh_pb2.RequestMeta
    ) -> tuple[bool, list[str]]:
        """Where a stream chunk the scheduler emitted for `target` goes: (to the client,
        the stages). The client is `CLIENT`'s, or a terminal stage's without stream_to."""
        to_client = target == CLIENT or (target is None and not self.stream_to and self._terminal)
        if to_client and not self._terminal:
            raise internal("only terminal stages stream to the client", self._stage)
        if target is None and not self.stream_to and not to_client:
            raise internal(
                "the scheduler emitted a stream chunk, but the stage has no stream_to "
                "and is not terminal",
                self._stage,
            )
        return to_client, [] if to_client else self.stream_targets(target, meta)

    def stream_targets(self, target: str | None, meta: mesh_pb2.RequestMeta) -> list[str]:
        """The stages a stream chunk for `target` (None: every `stream_to`) goes to."""
        if target is not None and target not in self.stream_to:
            raise internal(
                f"the scheduler streamed to {target!r}, which is not in stream_to "
                f"{list(self.stream_to)}",
                self._stage,
            )
        targets = list(self.stream_to) if target is None else [target]
        if meta.terminal_stages:
            possible = self._router.possible_stages(tuple(meta.terminal_stages))
            targets = [t for t in targets if t in possible]
        return targets

    def stream_done_targets(self, rid: str, output: Any, meta: mesh_pb2.RequestMeta) -> list[str]:
        """The stream edges that get a done signal once the request's result is out."""
        if self._stream_done_to_fn is not None:
            chosen = check_subset(
                self._stream_done_to_fn(rid, output),
                self.stream_to,
                "stream_done_to_fn",
                "stream_to",
                self._stage,
            )
            return [t for t in self.stream_to if t in chosen]
        return self.stream_targets(None, meta)


def check_subset(
    chosen: Any, allowed: frozenset[str] | tuple[str, ...], hook: str, field_: str, stage: str
) -> frozenset[str]:
    """What a stage-choosing hook returned (a name or non-empty list of names within
    `allowed`) as a set; raises INTERNAL otherwise."""
    names = [chosen] if isinstance(chosen, str) else chosen
    if not isinstance(names, (list, tuple, set, frozenset)) or not names:
        raise internal(
            f"{hook} returned {chosen!r}; expected a non-empty list of stage names", stage
        )
    result = frozenset(names)
    extra = result - frozenset(allowed)
    if extra:
        raise internal(
            f"{hook} returned {sorted(extra)}, which is not in {field_} {sorted(allowed)}",
            stage,
        )
    return result
