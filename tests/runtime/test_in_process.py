"""``connect(in_process=True)``: the cluster of a data directory in this process, without
Ray (what a one-shot CLI command opens): real coordinator and workers over real files, its
answers DuckDB's, its nodes kept under their ids from one opening to the next, one owner
of the data directory at a time."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pyarrow as pa
import pytest

import shardflow

ROWS = 3000


def rows(start: int, count: int) -> pa.Table:
    ids = pa.array(range(start, start + count), pa.int64())
    return pa.table({"id": ids, "v": pa.array([i % 97 for i in range(start, start + count)])})


def oracle(table: pa.Table, query: str) -> list[tuple[object, ...]]:
    con = duckdb.connect()
    con.register("t", table)
    return sorted(con.execute(query).fetchall())


def answer(db: shardflow.Database, query: str) -> list[tuple[object, ...]]:
    table = db.sql(query)
    return sorted(zip(*(c.to_pylist() for c in table.columns), strict=True))


def open_here(data_dir: Path, **options: object) -> shardflow.Database:
    db = shardflow.connect(data_dir=data_dir, in_process=True, **options)
    assert isinstance(db, shardflow.Database)
    return db


def test_a_data_directory_opened_in_process_answers_as_duckdb_and_opens_again_as_it_was(
    tmp_path: Path,
) -> None:
    data_dir = tmp_path / "data"
    data = rows(0, ROWS)
    queries = [
        "SELECT count(*), sum(id), sum(v) FROM t",
        "SELECT v, count(*) FROM t WHERE id % 3 = 0 GROUP BY v",
    ]
    with open_here(data_dir, workers=3, initial_shard_bytes=0) as db:
        db.create_table("t", data, distributed_by="id")
        for query in queries:
            assert answer(db, query) == oracle(data, query)
        assert db.sql("DELETE FROM t WHERE id < 100")["count"].to_pylist() == [100]
        placed = {s["shard"]: s["node"] for s in db.cluster.shards().to_pylist()}
        assert len(set(placed.values())) == 3  # spread over the three nodes
    kept = data.filter(pa.compute.greater_equal(data["id"], 100))
    with open_here(data_dir) as db:  # the cluster it last had: no unit moves
        assert [n.node_id for n in db.cluster.nodes()] == ["node-0", "node-1", "node-2"]
        assert {s["shard"]: s["node"] for s in db.cluster.shards().to_pylist()} == placed
        for query in queries:
            assert answer(db, query) == oracle(kept, query)


def test_one_owner_at_a_time_and_nothing_that_needs_ray(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with open_here(data_dir, workers=2) as db:
        db.create_table("t", rows(0, 100), distributed_by="id")
        with pytest.raises(shardflow.DataDirInUseError, match=f"pid {__import__('os').getpid()}"):
            open_here(data_dir)  # a second owner of the same files is refused, said so
        with pytest.raises(shardflow.ConfigError, match="keeps running"):
            db.keep_running()  # it stops with this process
        assert db.sql("SELECT count(*) AS n FROM t")["n"].to_pylist() == [100]
    with pytest.raises(shardflow.ConfigError, match="without Ray"):
        shardflow.connect(address="127.0.0.1:6379", data_dir=data_dir, in_process=True)
    with open_here(data_dir) as db:  # the first let go of it on close
        assert db.sql("SELECT count(*) AS n FROM t")["n"].to_pylist() == [100]
