"""Reachability over the stage graph (validation and planning)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def walk_graph(start: set[str], edges: Mapping[str, Iterable[str]]) -> set[str]:
    seen = set(start)
    todo = list(start)
    while todo:
        for n in edges.get(todo.pop(), ()):
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen
