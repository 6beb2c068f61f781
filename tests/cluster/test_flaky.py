"""A real flaky worker (``test_flaky_node``: it fails a share of its fragments, as a dying
device would) under readers and an inserter: at 5 % it becomes suspect and its shards move
off live while no client operation fails and no row is lost; after a clean cool-down it is
re-admitted and gets shards again. Well below the threshold, nothing moves."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pytest

import shardflow
from shardflow.errors import Error

pytestmark = pytest.mark.cluster
ROWS = 20_000
FLAKY = "node-1"
EXPECTED = (ROWS, ROWS * (ROWS - 1) // 2)


@dataclass
class Load:
    """A reader checking every answer and an inserter of unique ids, until stopped."""

    db: shardflow.Database
    stop: threading.Event = field(default_factory=threading.Event)
    failures: list[str] = field(default_factory=list)
    acked: list[int] = field(default_factory=list)
    queries: int = 0

    def __enter__(self) -> Load:
        self.threads = [threading.Thread(target=self._run, args=(w,), daemon=True)
                        for w in (self._read, self._read, self._insert)]  # fmt: skip
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)

    def _run(self, work: Callable[[int], None]) -> None:
        step = 0
        while not self.stop.is_set():
            try:
                work(step)
            except Error as error:
                self.failures.append(repr(error))
            step += 1

    def _read(self, step: int) -> None:
        got = self.db.sql(f"SELECT count(*) AS n, sum(id) AS s FROM t WHERE id < {ROWS}")
        if (got["n"][0].as_py(), got["s"][0].as_py()) != EXPECTED:
            self.failures.append(f"wrong answer {got.to_pylist()}")
        self.queries += 1

    def _insert(self, step: int) -> None:
        ids = list(range(ROWS + step * 10, ROWS + step * 10 + 10))
        self.db.insert("t", pa.table({"id": ids}))
        self.acked += ids
        time.sleep(0.05)


def connect(tmp_path: Path, share: float) -> shardflow.Database:
    db = shardflow.connect(
        workers=3, data_dir=tmp_path / "data", test_flaky_node=f"{FLAKY}={share}",
        balance_interval_s=0.5, node_failure_window_s=10.0, node_failure_min_ops=50,
        suspect_cooldown_s=4.0, shards_per_worker=3, retry_deadline_s=60.0, initial_shard_bytes=0,
        health_misses=30,  # about failing operations, not liveness: a slow ping is no death
    )  # fmt: skip
    db.create_table("t", pa.table({"id": list(range(ROWS))}), distributed_by="id")
    return db


def node(db: shardflow.Database, name: str) -> shardflow.NodeInfo:
    return next(n for n in db.cluster.nodes() if n.node_id == name)


def wait_for(
    check: Callable[[], bool], seconds: float, what: str, explain: Callable[[], object] = str
) -> float:
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < seconds, f"{what} within {seconds:g}s: {explain()}"
        time.sleep(0.25)
    return time.monotonic() - started


def test_a_node_failing_5_percent_is_evacuated_under_load_then_readmitted(tmp_path: Path) -> None:
    with connect(tmp_path, 0.05) as db:
        assert node(db, FLAKY).shards > 0
        with Load(db) as load:
            wait_for(lambda: node(db, FLAKY).health == "suspect", 60, "node-1 suspect")
            wait_for(lambda: node(db, FLAKY).shards == 0, 90, "node-1 evacuated")
            time.sleep(1.0)  # the clients keep going on the other nodes
        assert load.failures == [] and load.queries > 0 and load.acked
        moves = [m for m in db.cluster.migrations() if "evacuate" in m.reason]
        assert moves and all(m.from_nodes == (FLAKY,) and m.phase == "done" for m in moves)
        plan = db.cluster.rebalance(dry_run=True)
        assert all(a.get("to") != FLAKY for a in plan["actions"])  # no shard back while suspect
        got = db.sql(f"SELECT id FROM t WHERE id >= {ROWS}").column("id").to_pylist()
        assert sorted(got) == sorted(load.acked)  # every acknowledged row, once
        # no work, no failures: after the cool-down it is healthy and gets shards again
        wait_for(lambda: node(db, FLAKY).health == "healthy", 60, "node-1 re-admitted")
        wait_for(
            lambda: node(db, FLAKY).shards > 0,
            60,
            "node-1 given shards again",
            explain=lambda: (db.cluster.rebalance(dry_run=True), node(db, FLAKY).health),
        )
        count, total = (
            db.sql(f"SELECT count(*), sum(id) FROM t WHERE id < {ROWS}").to_pylist()[0].values()
        )
        assert (count, total) == EXPECTED


def test_a_node_failing_well_below_the_threshold_keeps_its_shards(tmp_path: Path) -> None:
    with connect(tmp_path, 0.004) as db:
        before = {s["shard"]: s["node"] for s in db.cluster.shards().to_pylist()}
        with Load(db) as load:
            wait_for(lambda: node(db, FLAKY).failure_rate > 0, 60, "a failure seen on node-1")
            time.sleep(3.0)
        info = node(db, FLAKY)
        assert info.health == "healthy" and 0 < info.failure_rate < 0.01, info
        assert load.failures == []
        after = {s["shard"]: s["node"] for s in db.cluster.shards().to_pylist()}
        assert [s for s, n in before.items() if n == FLAKY] == [
            s for s, n in after.items() if n == FLAKY
        ]
        assert not [m for m in db.cluster.migrations() if "evacuate" in m.reason]
