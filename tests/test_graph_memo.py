"""Tables derived from a frozen Graph are declared: cached properties of Graph, or a `GraphMemo` owned
by the module that needs the table. No module writes into a graph's `__dict__` by a string key."""

from __future__ import annotations

import random
import re
from pathlib import Path

from slackswap.graph import GraphMemo
from slackswap.planners.support.analysis import walk_table
from slackswap.schedule.copies import graph_tables
from slackswap.testing import random_graph

ROOT = Path(__file__).resolve().parents[1]


def test_a_memo_builds_once_per_graph_and_keeps_graphs_apart() -> None:
    calls = []

    def count_ops(graph) -> int:
        calls.append(graph.name)
        return len(graph.ops)

    memo = GraphMemo(count_ops)
    a, b = random_graph(random.Random(1)), random_graph(random.Random(2))
    assert memo(a) == len(a.ops) and memo(a) == len(a.ops)
    assert memo(b) == len(b.ops)
    assert len(calls) == 2  # once per graph
    other = GraphMemo(count_ops)  # another memo is another table, even of the same function
    assert other(a) == len(a.ops) and len(calls) == 3


def test_op_durations_are_one_table_and_memos_are_computed_once() -> None:
    graph = random_graph(random.Random(3))
    assert dict(graph.op_duration_s) == {op.name: op.duration_s for op in graph.ops}
    assert graph.op_duration_s is graph.op_duration_s
    assert graph_tables(graph) is graph_tables(graph) and walk_table(graph) is walk_table(graph)
    assert set(graph._memos) == {graph_tables, walk_table}


def test_no_module_writes_a_graph_table_by_string_key() -> None:
    pattern = re.compile(r"\.__dict__\[\s*[\"']_")
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for top in ("slackswap", "pipelines", "benchmarks", "tools")
        for path in sorted((ROOT / top).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not offenders, "declare the table as a Graph cached property or a GraphMemo:\n" + "\n".join(offenders)
