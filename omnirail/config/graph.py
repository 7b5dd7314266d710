"""Reachability over the stage graph (validation and planning)."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import TypeVar

T = TypeVar("T", bound=Hashable)


def walk_graph(start: set[str], edges: Mapping[str, Iterable[str]]) -> set[str]:
    seen = set(start)
    todo = list(start)
    while todo:
        for n in edges.get(todo.pop(), ()):
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def join_groups(items: Sequence[T], links: Iterable[Iterable[T]]) -> list[list[T]]:
    """Partitions `items`: every link puts its members (and, transitively, their groups)
    in one group. Groups come in the order of their first item, members in `items` order;
    members of a link that are not in `items` are ignored."""
    index = {item: i for i, item in enumerate(items)}
    parent = list(range(len(items)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for link in links:
        roots = sorted({find(index[m]) for m in link if m in index})
        for r in roots[1:]:
            parent[r] = roots[0]  # the earliest item stays the root: it names the group
    groups: dict[int, list[T]] = {}
    for i, item in enumerate(items):
        groups.setdefault(find(i), []).append(item)
    return list(groups.values())
