"""Shards kept in the engine's memory, on the CPU twin of the GPU path: workers that run
Polars keep each shard as a Polars frame, built once, extended by its appends, never older
than the shard when a fragment reads it. Queries race appends, splits, merges and moves,
and every answer holds every row acknowledged before it began (DuckDB over the same rows is
the oracle at the end); a frame that takes appends without their rows (the test-only fault)
is caught by the same checks."""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from shardflow.errors import MoveRefusedError
from tests.support.local_cluster import ROWS, LocalCluster, assert_serves, events

COUNT = "SELECT count(*) AS n, sum(id) AS s FROM events"


def kept(cluster: LocalCluster) -> dict[str, Any]:
    """The kept frames of every worker, summed."""
    totals: dict[str, Any] = {"hits": 0, "extended": 0, "misses": 0, "shards": 0, "bytes": 0}
    for node in cluster.catalog.nodes:
        resident = cluster.workers.get(node).node.resident
        assert resident is not None, f"{node} keeps no frames"
        stats = resident.stats()
        for name in totals:
            totals[name] += getattr(stats, name)
    return totals


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    local = LocalCluster(tmp_path / "data", engine="polars")
    local.create_table("events", events(0, ROWS), "id")
    yield local
    local.close()


def test_frames_are_built_once_and_extended_by_appends(cluster: LocalCluster) -> None:
    assert_serves(cluster, events(0, ROWS))
    first = kept(cluster)
    assert first["misses"] == len(cluster.units("events")) and first["bytes"] > 0
    assert_serves(cluster, events(0, ROWS))
    again = kept(cluster)
    assert again["hits"] - first["hits"] == len(cluster.units("events"))  # read as kept
    assert again["misses"] == first["misses"]
    cluster.insert("events", events(ROWS, 300))
    assert_serves(cluster, events(0, ROWS + 300))
    after = kept(cluster)
    assert after["extended"] > again["extended"] and after["misses"] == first["misses"]
    nodes = cluster.session.worker_infos()
    assert all(i is not None and i.device_cache and i.device_cache.shards for i in nodes.values())


def test_moved_split_and_dropped_shards_are_read_anew(cluster: LocalCluster) -> None:
    assert_serves(cluster, events(0, ROWS))
    unit = cluster.units("events")[0]
    target = next(n for n in cluster.catalog.nodes if n != unit.node)
    assert cluster.migrate(unit.unit_id, target)["phase"] == "done"
    target_node = cluster.workers.get(target).node
    assert target_node.resident is not None
    built = target_node.resident.stats().misses
    assert built >= 1, "the move's target built the moved shard's frame before the switch"
    assert_serves(cluster, events(0, ROWS))
    assert target_node.resident.stats().misses == built, "the first query found it built"
    assert cluster.split(cluster.units("events")[0].unit_id)["phase"] == "done"
    cluster.insert("events", events(ROWS, 500))
    assert_serves(cluster, events(0, ROWS + 500))
    cluster.session.drop_table("events")
    assert all(
        cluster.workers.get(n).node.resident.stats().shards == 0  # type: ignore[union-attr]
        for n in cluster.catalog.nodes
    ), "a dropped table's frames stay"


def race(cluster: LocalCluster, seconds: float, seed: int = 7) -> list[str]:
    """An inserter, a mover (moves, splits, merges) and two readers for ``seconds``; the
    readers' answers that miss rows acknowledged before they began, then the last answer
    against DuckDB's over every acknowledged row."""
    stop = threading.Event()
    acked = [events(0, ROWS)]
    rows_acked = [ROWS]
    ids = itertools.count(ROWS, 40)
    problems: list[str] = []
    errors: list[BaseException] = []
    rng = random.Random(seed)

    def insert() -> None:
        while not stop.is_set():
            start = next(ids)
            batch = events(start, 40)
            cluster.insert("events", batch)
            acked.append(batch)
            rows_acked[0] += 40

    def move() -> None:
        while not stop.is_set():
            units = list(cluster.units("events"))
            unit = rng.choice(units)
            try:
                choice = rng.random()
                if choice < 0.3 and len(units) < 12:
                    cluster.split(unit.unit_id)
                elif choice < 0.5 and len(units) > 3:
                    low, high = sorted(units, key=lambda u: u.lo)[:2]
                    cluster.merge(low.unit_id, high.unit_id)
                else:
                    others = [n for n in cluster.catalog.nodes if n != unit.node]
                    cluster.migrate(unit.unit_id, rng.choice(others))
            except MoveRefusedError:
                continue

    def read() -> None:
        while not stop.is_set():
            before = rows_acked[0]
            [answer] = cluster.sql(COUNT).to_pylist()
            if answer["n"] < before:
                problems.append(f"{answer['n']} rows seen, {before} acknowledged before")

    def guarded(work: Any) -> Any:
        def run() -> None:
            try:
                work()
            except BaseException as error:
                errors.append(error)
                stop.set()

        return run

    threads = [threading.Thread(target=guarded(w)) for w in (insert, move, read, read)]
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    everything = pa.concat_tables(acked)
    [final] = cluster.sql(COUNT).to_pylist()
    expected = {"n": everything.num_rows, "s": sum(everything.column("id").to_pylist())}
    if final != expected:
        problems.append(f"at the end {final}, DuckDB over the acknowledged rows {expected}")
    return problems


def test_queries_racing_appends_splits_and_moves_see_every_acknowledged_row(
    cluster: LocalCluster,
) -> None:
    problems = race(cluster, seconds=6)
    assert not problems, problems[:5]
    totals = kept(cluster)
    assert totals["hits"] + totals["extended"] > 0, "the readers never read a kept frame"
    assert totals["extended"] > 0, "no appends were added to a kept frame"
    assert len(cluster.units("events")) != 4 or cluster.controller.migrator.history


def test_a_frame_that_skips_appends_is_caught(tmp_path: Path) -> None:
    """The test-only fault: kept frames take new appends without their rows. The racing
    checks must see rows missing."""
    local = LocalCluster(tmp_path / "data", engine="polars", test_fault_resident="skip_append")
    try:
        local.create_table("events", events(0, ROWS), "id")
        problems = race(local, seconds=3)
    finally:
        local.close()
    assert problems, "frames that miss appended rows went unnoticed"


def test_the_balancer_knows_what_each_device_cache_keeps(tmp_path: Path) -> None:
    """Each worker reports its cache's budget with its load; a node holding more shard
    bytes than that is said on every decision (``rebalance()``'s reason)."""
    local = LocalCluster(tmp_path / "data", engine="polars", device_cache_mb=1)
    try:
        local.create_table("events", events(0, 20 * ROWS), "id")
        assert_serves(local, events(0, 20 * ROWS))
        node = local.catalog.nodes[0]
        report = local.workers.get(node).node.load_report()
        assert report.memory_budget == 1 << 20
        assert sum(report.unit_bytes.values()) > 1 << 20
        reason = local.session.rebalance(True)["reason"]
        assert f"{node} holds" in reason and "device cache keeps 1 MiB" in reason, reason
    finally:
        local.close()
