"""Acknowledged rows survive: closing and reconnecting, fewer workers after a restart,
checkpoints, and a worker process killed with SIGKILL while queries run."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pyarrow as pa
import pytest

import shardflow
from tests.cluster.conftest import sigkill_worker, wait_for_failover

pytestmark = pytest.mark.cluster


def batch(start: int, count: int) -> pa.Table:
    ids = pa.array(range(start, start + count), pa.int64())
    return pa.table(
        {"id": ids, "bucket": pa.compute.cast(ids, pa.int32()), "tag": [f"t{start}"] * count}
    )


def summary(db: shardflow.Database, table: str) -> tuple[int, int, int]:
    row = db.sql(f"SELECT count(*), sum(id), count(DISTINCT id) FROM {table}").to_pylist()[0]
    return tuple(int(v) for v in row.values())  # type: ignore[return-value]


def expected_summary(ids: list[int]) -> tuple[int, int, int]:
    return (len(ids), sum(ids), len(set(ids)))


def test_restart_recovers_every_acknowledged_row(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    ids: list[int] = []
    with shardflow.connect(
        workers=3,
        initial_shard_bytes=0,
        data_dir=data_dir,
        wal_checkpoint_entries=4,
        shards_per_worker=2,
    ) as db:
        db.create_table("events", batch(0, 1000), distributed_by="id")
        db.create_table("tags", pa.table({"tag": ["a", "b"], "weight": [1, 2]}), replicated=True)
        ids += range(1000)
        for i in range(1, 11):  # 10 inserts: logged, some folded into new bases
            db.insert("events", batch(i * 10_000, 50))
            ids += range(i * 10_000, i * 10_000 + 50)
        db.insert("tags", pa.table({"tag": ["c"], "weight": [3]}))
        assert summary(db, "events") == expected_summary(ids)
    # every acknowledged row is back, on a cluster of a different size
    with shardflow.connect(workers=2, data_dir=data_dir) as db:
        assert summary(db, "events") == expected_summary(ids)
        assert db.sql("SELECT sum(weight) FROM tags")[0][0].as_py() == 6
        assert sorted(db.tables().column("name").to_pylist()) == ["events", "tags"]
        assert sum(n.shards for n in db.cluster.nodes()) == 6  # 6 units on 2 nodes now
        db.insert("events", batch(999_000, 5))
        ids += range(999_000, 999_005)
    with shardflow.connect(workers=4, data_dir=data_dir) as db:
        assert summary(db, "events") == expected_summary(ids)


def test_failed_load_leaves_nothing_behind(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with shardflow.connect(workers=2, data_dir=data_dir) as db:
        with pytest.raises(shardflow.TableError):
            db.create_table("t", tmp_path / "missing", distributed_by="id")
        with pytest.raises(shardflow.TableError):
            db.create_table("t", pa.table({"id": [[1], [2]]}), distributed_by="id")
        assert db.tables().num_rows == 0
    assert not (data_dir / "tables").exists() or not any((data_dir / "tables").iterdir())


def test_a_load_whose_worker_dies_fails_whole_and_can_be_done_again(tmp_path: Path) -> None:
    """A worker SIGKILLed while a load sends it rows (over its fast lane): the load fails
    (the rows it took are gone with it) and leaves no table; once the dead worker's shards
    are served again the same load succeeds."""
    with shardflow.connect(
        workers=2, initial_shard_bytes=0, data_dir=tmp_path / "data", load_batch_rows=2_000
    ) as db:
        killed: list[int] = []

        def kill_once(loaded: int, total: int) -> None:
            if not killed:
                killed.append(loaded)
                sigkill_worker(db, "node-1")

        session = db._session_or_raise()  # its loads report each batch sent
        with pytest.raises(shardflow.ClusterError, match="node-1"):  # the worker, not a lane
            session.create_table("events", batch(0, 200_000), "id", False, None, kill_once)
        assert killed and "events" not in db.tables().column("name").to_pylist()
        wait_for_failover(db)
        db.create_table("events", batch(0, 200_000), distributed_by="id")
        assert summary(db, "events") == expected_summary(list(range(200_000)))


def test_sigkill_of_a_worker_fails_no_query_and_loses_no_row(tmp_path: Path) -> None:
    """The coordinator notices the dead worker, gives its shards to the others, which rebuild
    them from storage; the queries that ran meanwhile were retried, none failed."""
    with shardflow.connect(
        workers=3, initial_shard_bytes=0, data_dir=tmp_path / "data", shards_per_worker=2
    ) as db:
        db.create_table("events", batch(0, 20_000), distributed_by="id")
        ids = list(range(20_000))
        failures: list[BaseException] = []
        answers: list[tuple[int, int, int]] = []
        stop = threading.Event()

        def query_loop() -> None:
            while not stop.is_set():
                try:
                    answers.append(summary(db, "events"))
                except BaseException as error:  # the assertion below reports it
                    failures.append(error)

        reader = threading.Thread(target=query_loop)
        reader.start()
        try:
            time.sleep(0.5)
            sigkill_worker(db, "node-1")
            # as after a drain: the session must look the worker up, and finds none
            db._backend.handle.workers.forget("node-1")
            answered_before_kill = len(answers)
            db.insert("events", batch(40_000, 100))  # before the failover: retried, lands once
            ids += range(40_000, 40_100)
            wait_for_failover(db)
            time.sleep(1)
        finally:
            stop.set()
            reader.join(timeout=120)
        assert not failures, failures[:3]
        assert len(answers) > answered_before_kill, "no query ran across the kill"
        # an insert is not atomic across shards: a reader may see part of it, never more
        assert all(20_000 <= a[0] <= 20_100 and a[0] == a[2] for a in answers)
        assert answers[-1] == expected_summary(ids)
        [failover] = db.cluster.failovers()
        assert failover["node"] == "node-1" and failover["units"] == 2
        assert sorted(n.node_id for n in db.cluster.nodes()) == ["node-0", "node-2"]
        assert sum(n.shards for n in db.cluster.nodes()) == 6  # every shard served again
        db.insert("events", batch(50_000, 100))
        assert summary(db, "events") == expected_summary(ids + list(range(50_000, 50_100)))
