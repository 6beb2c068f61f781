"""Proof under load: TPC-H readers and an inserter keep running while the cluster grows from
3 to 5 workers, drains one, loses one to SIGKILL and goes through more than 20 forced
migrations, splits and merges. No query or insert may fail, every acknowledged row must be
there exactly once, every answer must equal DuckDB's, and no reader's count may go down."""

from __future__ import annotations

import itertools
import random
import threading
import time
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest

import shardflow
from shardflow import tpch
from tests.cluster.conftest import sigkill_worker, wait_for_failover
from tests.support.oracle import assert_same_result, query_is_ordered, sort_key_indexes

pytestmark = pytest.mark.cluster
QUERIES = (1, 3, 4, 5, 6, 10, 12, 13, 14, 18, 19, 21)


class Workload:
    def __init__(self, db: shardflow.Database, expected: dict[int, pa.Table]) -> None:
        self.db = db
        self.expected = expected
        self.stop = threading.Event()
        self.failures: list[str] = []
        self.acked: list[int] = []
        self.answers = 0
        self.counts: dict[int, list[int]] = {0: [], 1: []}
        self.threads = [
            threading.Thread(target=self._tpch, args=(i,), daemon=True) for i in (0, 1)
        ] + [threading.Thread(target=self._insert, daemon=True)]

    def _tpch(self, reader: int) -> None:
        rng = random.Random(reader)
        while not self.stop.is_set():
            number = rng.choice(QUERIES)
            sql = tpch.query(number)
            try:
                result = self.db.sql(sql)
                expected = self.expected[number]
                assert_same_result(
                    result,
                    expected,
                    ordered=query_is_ordered(sql),
                    sort_keys=sort_key_indexes(sql, expected.column_names),
                    context=f"Q{number}",
                )
                self.answers += 1
                count = self.db.sql("SELECT count(*) FROM events")[0][0].as_py()
                self.counts[reader].append(count)
            except Exception as error:  # every failure is reported by the checks
                self.failures.append(f"reader {reader} Q{number}: {error!r}"[:2000])

    def _insert(self) -> None:
        next_id = 0
        while not self.stop.is_set():
            batch = pa.table({"id": pa.array(range(next_id, next_id + 50), pa.int64())})
            try:
                self.db.insert("events", batch)
                self.acked.extend(range(next_id, next_id + 50))
            except Exception as error:  # every failure is reported by the checks
                self.failures.append(f"insert: {error!r}"[:2000])
            next_id += 50
            time.sleep(0.01)


def units(db: shardflow.Database) -> list[dict[str, object]]:
    """One entry per unit (the shards of a unit share its bucket range and node)."""
    seen: dict[tuple[object, object, object], dict[str, object]] = {}
    for shard in db.cluster.shards().to_pylist():
        if shard["kind"] == "distributed" and shard["table"] in ("lineitem", "events"):
            seen[(shard["table"], shard["bucket_lo"], shard["node"])] = shard
    return list(seen.values())


def forced_operation(db: shardflow.Database, rng: random.Random, step: int) -> str:
    live = [n.node_id for n in db.cluster.nodes()]
    candidates = units(db)
    unit = rng.choice(candidates)
    kind = ("migrate", "split", "merge")[step % 3]
    if kind == "migrate":
        to = rng.choice([n for n in live if n != unit["node"]])
        db.cluster.migrate(str(unit["shard"]), to=to)
    elif kind == "split":
        db.cluster.split(str(unit["shard"]))
    else:
        table = unit["table"]
        same = sorted(
            (u for u in candidates if u["table"] == table), key=lambda u: int(str(u["bucket_lo"]))
        )
        pairs = [
            (a, b)
            for a, b in itertools.pairwise(same)
            if a["node"] == b["node"] and a["bucket_hi"] == b["bucket_lo"]
        ]
        if not pairs:  # no adjacent pair on one node: bring a neighbour over first
            a, b = same[0], same[1]
            db.cluster.migrate(str(b["shard"]), to=str(a["node"]))
            return "migrate"
        a, b = rng.choice(pairs)
        db.cluster.merge(str(a["shard"]), str(b["shard"]))
    return kind


def test_zero_downtime_under_load(tpch_tiny: Path, tmp_path: Path) -> None:
    oracle = duckdb.connect()
    for name, path in tpch.table_paths(tpch_tiny).items():
        oracle.execute(f"CREATE TABLE {name} AS SELECT * FROM read_parquet('{path}')")
    expected = {n: oracle.sql(tpch.query(n)).to_arrow_table() for n in QUERIES}

    with shardflow.connect(
        workers=3,
        initial_shard_bytes=0,
        data_dir=tmp_path / "data",
        auto_balance=False,
        migration_share=1.0,  # the churn is what it checks: moves back to back, unpaced
    ) as db:
        tpch.load(db, tpch_tiny)
        db.create_table("events", pa.table({"id": pa.array([], pa.int64())}), distributed_by="id")
        work = Workload(db, expected)
        rng = random.Random(42)
        done: list[str] = []
        for thread in work.threads:
            thread.start()
        try:
            time.sleep(1)
            db.cluster.add_node()
            db.cluster.add_node()
            assert len(db.cluster.nodes()) == 5
            db.cluster.rebalance(dry_run=False)
            for step in range(12):
                done.append(forced_operation(db, rng, step))
            db.cluster.drain("node-1", deadline=180)
            sigkill_worker(db, "node-3")
            wait_for_failover(db)
            for step in range(12, 24):
                done.append(forced_operation(db, rng, step))
            time.sleep(1)
        finally:
            work.stop.set()
            for thread in work.threads:
                thread.join(timeout=120)

        assert not work.failures, work.failures[:5]
        assert len(done) >= 20 and {"migrate", "split", "merge"} <= set(done)
        assert db.cluster.failovers() and len(db.cluster.nodes()) == 3
        assert work.answers > 20, work.answers  # the readers really ran through it all
        for reader, seen in work.counts.items():
            drops = [(a, b) for a, b in itertools.pairwise(seen) if a > b]
            assert not drops, f"reader {reader} saw its count go down: {drops[:3]}"
        ids = db.sql("SELECT id FROM events ORDER BY id").column("id").to_pylist()
        assert ids == sorted(work.acked), "every acknowledged id exactly once"
        moves = db.cluster.migrations()
        assert sum(m.phase == "done" for m in moves) >= 20
        for number in QUERIES:  # and the data is intact after it all
            sql = tpch.query(number)
            assert_same_result(
                db.sql(sql),
                expected[number],
                ordered=query_is_ordered(sql),
                sort_keys=sort_key_indexes(sql, expected[number].column_names),
            )
