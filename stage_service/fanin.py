"""Fan-in at a stage: waiting for every active producer, then merging their outputs.

A stage with `wait_for` gets one payload from each producer it waits for; `wait_for_fn`
may narrow that set (per request, on the first arrival) and `merge_fn` combines the
arrived payloads once all of the active set is in. A stage without `wait_for` takes
exactly one payload per request.
"""

from __future__ import annotations

from typing import Any

from omnirail.config import StageConfig, dotted
from omnirail.stage_service.request_state import PENDING, RequestState
from omnirail.stage_service.routing import check_subset
from omnirail.wire.errors import invalid


class FanIn:
    """One stage's `wait_for` and its hooks (resolved from the config's dotted paths)."""

    __slots__ = ("_merge_fn", "_stage", "_wait_for_fn", "wait_for")

    def __init__(self, stage: str, cfg: StageConfig, base: str | None) -> None:
        self._stage = stage
        self.wait_for = frozenset(cfg.wait_for or ())
        self._wait_for_fn = dotted.resolve(cfg.wait_for_fn, base) if cfg.wait_for_fn else None
        self._merge_fn = dotted.resolve(cfg.merge_fn, base) if cfg.merge_fn else None

    def add(self, rid: str, req: RequestState, source: str, value: Any) -> Any:
        """The request's input once complete (merged, with `wait_for`); else `PENDING`.

        Records `value` from `source` in `req`; raises OmniError on a delivery that does
        not fit (unknown source, duplicate). User hooks' exceptions propagate.
        """
        wait_for = self.wait_for
        if not wait_for:
            if req.submitted or len(req.holds) > 1:
                raise invalid(f"duplicate delivery from {source or 'coordinator'}", self._stage)
            return value
        if source not in wait_for:
            raise invalid(
                f"received from {source or 'coordinator'!r}, which is not in wait_for "
                f"{sorted(wait_for)}",
                self._stage,
            )
        if source in req.arrived:
            raise invalid(f"duplicate delivery from {source!r}", self._stage)
        req.arrived[source] = value
        if req.active is None:
            if self._wait_for_fn is None:
                req.active = wait_for
            else:
                chosen = self._wait_for_fn(rid, source, value)
                if chosen is not None:
                    req.active = check_subset(
                        chosen, wait_for, "wait_for_fn", "wait_for", self._stage
                    )
        if req.active is None or not req.active <= req.arrived.keys():
            return PENDING
        assert self._merge_fn is not None  # config validation guarantees it
        return self._merge_fn({s: req.arrived[s] for s in sorted(req.active)})
