"""The live story's bookkeeping and screen, with plain data: what counts as lost, wrong or
slow, and what the live screen shows (the story itself runs in tests/test_cli.py)."""

from __future__ import annotations

import io

import pyarrow as pa
from rich.console import Console

from shardflow.records import MigrationRecord, NodeInfo
from shardflow.tools.demo import DemoResult, same_rows
from shardflow.tools.story import (
    Clients,
    Snapshot,
    Story,
    StorySummary,
    missing_and_extra,
    percentile,
)


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 50.0
    assert percentile(values, 0.99) == 99.0
    assert percentile([3.0], 0.99) == 3.0
    assert percentile([], 0.5) == 0.0


def test_missing_and_extra_count_lost_and_duplicated_rows() -> None:
    assert missing_and_extra([1, 2, 3], [3, 2, 1]) == (0, 0)
    assert missing_and_extra([1, 2, 3], [1, 3]) == (1, 0)  # an acknowledged row lost
    assert missing_and_extra([1, 2, 3], [1, 2, 2, 3]) == (0, 1)  # kept twice
    assert missing_and_extra([1, 2], [1, 9]) == (1, 1)  # lost, and one never acknowledged


def test_a_wrong_answer_is_named() -> None:
    clients = Clients(None, {}, {}, same_rows)  # type: ignore[arg-type]  # check() reads no db
    expected = pa.table({"k": [1, 2], "v": [1.5, 2.5]})
    assert clients.check("Q01", pa.table({"k": [2, 1], "v": [2.5, 1.5]}), expected) is None
    wrong = clients.check("Q01", pa.table({"k": [1, 2], "v": [1.5, 2.6]}), expected)
    assert wrong is not None and wrong.startswith("Q01")
    assert clients.check("Q01", expected.slice(0, 1), expected) is not None


def summary(**changes: object) -> StorySummary:
    values: dict[str, object] = dict(
        seconds=30.0, queries=500, failed=0, wrong=0, qps=16.7, p50_ms=40.0, p99_ms=300.0,
        rows_acked=10_000, rows_lost=0, rows_duplicated=0, moves_done=9, moves_rolled_back=0,
        slowest_fence_ms=120.0, recovery_s=0.4, nodes_before=4, nodes_after=5, failures=(),
    )  # fmt: skip
    values.update(changes)
    return StorySummary(**values)  # type: ignore[arg-type]


def test_any_failure_wrong_answer_or_lost_row_fails_the_demo() -> None:
    assert summary().ok and DemoResult([], summary()).ok
    for bad in ({"failed": 1}, {"wrong": 1}, {"rows_lost": 1}, {"rows_duplicated": 2}):
        assert not summary(**bad).ok, bad
        assert not DemoResult([], summary(**bad)).ok
    assert "failed=0 wrong=0" in summary().line()
    assert "rows_lost=3" in summary(rows_lost=3).line()


def node(node_id: str, *, capacity: float = 1.0, alive: bool = True) -> NodeInfo:
    return NodeInfo(
        node_id=node_id, alive=alive, vendor="cpu", model="test cpu", engine="duckdb",
        memory_bytes=1 << 30, cores=2, capacity=capacity, simulated=capacity < 1, shards=2,
        rows=100, bytes=1 << 20, queries_running=0, utilization=None, busy_fraction=0.0,
        memory_used_bytes=0, memory_free_bytes=1 << 30, device_utilization=None,
        device_memory_used_bytes=None, device_memory_free_bytes=None, engine_note="",
        calibration={},
    )  # fmt: skip


def move(move_id: str, phase: str, fence_s: float = 0.01) -> MigrationRecord:
    return MigrationRecord(
        move_id=move_id, kind="move", reason="drain node-1", shards=("orders#3", "lineitem#3"),
        new_shards=(), from_nodes=("node-1",), to_nodes=("node-2",), phase=phase,
        outcome="done" if phase == "done" else "", started_at=0.0, seconds=0.5,
        phase_seconds={}, rows=1000, bytes=1 << 16, catch_up_rounds=1, fence_seconds=fence_s,
    )  # fmt: skip


def test_the_live_screen_shows_steps_map_moves_and_events() -> None:
    clients = Clients(None, {}, {}, same_rows)  # type: ignore[arg-type]
    clients.tally.queries, clients.tally.failed = 42, 0
    story = Story(None, clients, Console(), live=True)  # type: ignore[arg-type]
    story.snapshot = Snapshot(
        nodes=(node("node-1"), node("node-2"), node("node-6", capacity=0.25, alive=False)),
        shards=tuple(
            {"table": t, "shard": f"{t}#{i}", "node": n, "kind": "distributed", "bytes": 10}
            for i, (t, n) in enumerate(
                [("orders", "node-1"), ("lineitem", "node-1"), ("orders", "node-2")]
            )
        ),
        moves=(move("a", "done", 0.123), move("b", "copy")),
    )
    story.current = 2
    story.results = ["100 queries", "node-5 and node-6 joined"]
    story.say("SIGKILL node-3 (pid 1)")
    screen = Console(file=io.StringIO(), width=140, record=True)
    screen.print(story.render())
    text = screen.export_text()
    assert "✓ add two nodes" in text and "▶ the balancer moves shards onto them" in text
    assert "node-5 and node-6 joined" in text
    map_rows = {
        cells[2].strip(): line
        for line in text.splitlines()
        if len(cells := line.split("│")) > 3 and cells[2].strip().startswith("node-")
    }
    assert map_rows["node-1"].count("■") == 2 and map_rows["node-2"].count("■") == 1
    assert "not answering" in map_rows["node-6"]
    assert "■ lineitem" in text and "■ orders" in text  # the legend
    assert "copy" in text and "123" in text  # a move in flight, and a done one's fence
    assert "SIGKILL node-3" in text and "queries 42" in text
