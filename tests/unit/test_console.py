"""The console's pure parts: the nodes x buckets layout, the JSON it serves, and the
queries-per-second window."""

from __future__ import annotations

import json

from shardflow.telemetry.console import (
    ConsoleState,
    FailoverView,
    MapRow,
    MoveView,
    NodeView,
    ShardView,
    bucket_columns,
    shard_map,
    state_json,
)
from shardflow.telemetry.metrics import RateWindow


def shard(table: str, unit: int, node: str, lo: int, hi: int) -> ShardView:
    return ShardView(f"{table}#{unit}", table, unit, node, lo, hi)


def node(name: str, alive: bool = True) -> NodeView:
    return NodeView(name, alive, "cpu", "x86", "duckdb", False, 1.0, None, None, 2, 10, 100, 0)


def cells(row: MapRow) -> list[tuple[int, int, int, tuple[str, ...]]]:
    return [(c.lo, c.hi, c.span, c.shards) for c in row.cells]


def test_columns_are_cut_at_every_shard_bound() -> None:
    assert bucket_columns([], 16) == ((0, 16),)
    shards = [shard("t", 0, "a", 0, 8), shard("t", 1, "b", 8, 16), shard("u", 2, "a", 0, 4)]
    assert bucket_columns(shards, 16) == ((0, 4), (4, 8), (8, 16))


def test_a_shard_spans_its_columns_as_one_cell() -> None:
    """Co-located tables share their units' ranges: one cell lists both tables' shards."""
    shards = [
        shard("t", 0, "a", 0, 4),
        shard("t", 1, "a", 4, 8),
        shard("t", 2, "b", 8, 16),
        shard("o", 0, "a", 0, 4),
        shard("o", 1, "a", 4, 8),
        shard("o", 2, "b", 8, 16),
        shard("w", 3, "b", 0, 16),  # another group: one unit over every bucket
    ]
    layout = shard_map(["a", "b", "c"], shards, 16)
    assert layout.columns == ((0, 4), (4, 8), (8, 16))
    a, b, c = layout.rows
    assert (a.node, b.node, c.node) == ("a", "b", "c")
    assert cells(a) == [
        (0, 4, 1, ("o#0", "t#0")),
        (4, 8, 1, ("o#1", "t#1")),
        (8, 16, 1, ()),
    ]
    assert cells(b) == [(0, 8, 2, ("w#3",)), (8, 16, 1, ("o#2", "t#2", "w#3"))]
    assert cells(c) == [(0, 16, 3, ())]  # a node that holds nothing yet
    for row in layout.rows:  # every row covers every column once
        assert sum(cell.span for cell in row.cells) == len(layout.columns)


def test_a_node_only_a_shard_names_gets_a_row() -> None:
    layout = shard_map(["a"], [shard("t", 0, "a", 0, 4), shard("t", 1, "gone", 4, 8)], 8)
    assert [row.node for row in layout.rows] == ["a", "gone"]


def test_the_snapshot_serves_as_json_with_its_map() -> None:
    move = MoveView("m1", "move", ("t#1",), ("a",), ("b",), "copy", "", 100.0, 1.5)
    state = ConsoleState(
        at=123.0,
        buckets=8,
        epoch=4,
        nodes=(node("a"), node("b", alive=False)),
        shards=(shard("t", 0, "a", 0, 4), shard("t", 1, "a", 4, 8)),
        moves=(move,),
        rollbacks=(),
        failovers=(FailoverView("c", 99.0, 2, 0.4),),
        qps=2.5,
        queries=40,
    )
    data = json.loads(json.dumps(state_json(state)))
    assert data["nodes"][1]["name"] == "b" and data["nodes"][1]["alive"] is False
    assert data["shards"][0] == {
        "shard": "t#0",
        "table": "t",
        "unit": 0,
        "node": "a",
        "lo": 0,
        "hi": 4,
    }
    assert data["moves"][0]["phase"] == "copy" and data["moves"][0]["shards"] == ["t#1"]
    assert data["failovers"] == [{"node": "c", "detected_at": 99.0, "units": 2, "seconds": 0.4}]
    assert data["qps"] == 2.5 and data["queries"] == 40 and data["buckets"] == 8
    assert data["map"]["columns"] == [[0, 4], [4, 8]]
    assert [r["node"] for r in data["map"]["rows"]] == ["a", "b"]
    assert data["map"]["rows"][0]["cells"][0]["shards"] == ["t#0"]
    assert data["map"]["rows"][1]["cells"] == [{"lo": 0, "hi": 8, "span": 2, "shards": []}]


def test_the_query_rate_counts_the_last_seconds_only() -> None:
    now = [1000.0]
    window = RateWindow(5, lambda: now[0])
    assert window.rate() == 0.0
    for _ in range(10):
        window.add()
    now[0] = 1002.5
    window.add(5)
    assert window.rate() == 15 / 5
    now[0] = 1005.0  # second 1000 left the window; 1002 is still in it
    assert window.rate() == 5 / 5
    now[0] = 1010.0
    assert window.rate() == 0.0
    assert window.total == 15
