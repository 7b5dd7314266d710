"""omnirail.config.graph: reachability and the one union-find (process and IPC groups)."""

from __future__ import annotations

from omnirail.config.graph import join_groups, walk_graph


def test_walk_graph_follows_edges_transitively() -> None:
    edges = {"a": ["b"], "b": ["c"], "x": ["y"]}
    assert walk_graph({"a"}, edges) == {"a", "b", "c"}


def test_join_groups_keeps_order_and_names_groups_by_their_first_item() -> None:
    items = ["a", "b", "c", "d", "e"]
    assert join_groups(items, [["d", "b"], ["e", "d"]]) == [["a"], ["b", "d", "e"], ["c"]]


def test_join_groups_merges_transitively_and_ignores_unknown_members() -> None:
    items = ["a", "b", "c", "d"]
    assert join_groups(items, [["c", "d"], ["ghost", "a"], ["d", "a"]]) == [
        ["a", "c", "d"],
        ["b"],
    ]
    assert join_groups(items, []) == [["a"], ["b"], ["c"], ["d"]]
