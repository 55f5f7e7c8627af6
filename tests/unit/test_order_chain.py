"""The start order's sorts (workflows/lifecycle/order.py) walk without recursion: a chain of
hosts longer than Python's recursion limit sorts like a short one (issue 37 item 9)."""

from __future__ import annotations

import sys

from workflows.lifecycle.order import dependents_first, find_cycle, in_order

N = sys.getrecursionlimit() + 500  # deeper than any recursive walk could go


def chain(n: int) -> dict[str, list[str]]:
    """h1 starts after h0, h2 after h1, ..."""
    return {f"h{i}": [f"h{i - 1}"] if i else [] for i in range(n)}


def test_a_chain_deeper_than_the_recursion_limit_sorts() -> None:
    names = [f"h{i}" for i in range(N)]
    graph = chain(N)
    assert in_order(reversed(names), graph) == names
    assert dependents_first(names, graph) == names[::-1]
    assert find_cycle(graph) is None


def test_order_keeps_the_given_order_where_none_is_named() -> None:
    graph = {"a": ["c"], "b": [], "c": [], "d": ["a", "b"]}
    assert in_order(["d", "b", "c", "a"], graph) == ["c", "a", "b", "d"]  # depth first
    assert in_order(["b", "a"], graph) == ["b", "a"]  # c not given: not placed
    assert dependents_first(["c", "a", "d"], graph) == ["d", "a", "c"]


def test_a_cycle_is_cut_not_looped() -> None:
    graph = {"a": ["b"], "b": ["a"], "c": ["c"]}
    assert sorted(in_order(["a", "b", "c"], graph)) == ["a", "b", "c"]
