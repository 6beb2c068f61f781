"""VERIFY on a real Ray cluster: a target copy that misses a row, or holds a changed value
(the test-only fault hook ``test_fault_move_copy``), rolls its move back; the source keeps
serving every row; the history and the Prometheus counter say so and why; once the hook is
off, the same move goes through."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest

import shardflow

pytestmark = pytest.mark.cluster
ROWS = 30_000
CHECK = (
    "SELECT count(*) AS n, sum(id) AS ids, sum(length(pad)) AS pads, "
    "sum(hash(id, pad) % 1000003) AS h FROM events"
)
FAULTS = (("drop_row", "the sources handed out"), ("change_value", "checksums differ"))


def events(count: int) -> pa.Table:
    ids = pa.array(range(count), pa.int64())
    return pa.table({"id": ids, "pad": pa.array([f"row-{i}" for i in range(count)])})


def duckdb_answer(rows: pa.Table) -> list[dict[str, object]]:
    con = duckdb.connect()
    con.register("events", rows)
    try:
        return con.sql(CHECK).to_arrow_table().to_pylist()
    finally:
        con.close()


def rolled_back_counted(db: shardflow.Database) -> float:
    with urllib.request.urlopen(db.cluster.metrics_url(), timeout=10) as response:
        served = response.read().decode()
    found = re.search(
        r'^shardflow_migrations_total\{kind="move",outcome="rolled_back"\} (\S+)$',
        served,
        re.MULTILINE,
    )
    return float(found.group(1)) if found else 0.0


def test_a_corrupted_copy_rolls_back_and_a_clean_retry_succeeds(tmp_path: Path) -> None:
    data = events(ROWS)
    expected = duckdb_answer(data)
    shard = target = ""

    def prepared() -> list[Path]:  # a switch's catalog change written ahead of it
        return list((tmp_path / "data" / "catalog").glob("*.prepared"))

    for attempt, (fault, named) in enumerate(FAULTS):
        with shardflow.connect(
            workers=3, data_dir=tmp_path / "data", auto_balance=False, test_fault_move_copy=fault
        ) as db:
            if attempt == 0:
                db.create_table("events", data, distributed_by="id")
                first = next(s for s in db.cluster.shards().to_pylist() if s["table"] == "events")
                shard, owner = str(first["shard"]), str(first["node"])
                target = next(n.node_id for n in db.cluster.nodes() if n.node_id != owner)
            owner = next(s["node"] for s in db.cluster.shards().to_pylist() if s["shard"] == shard)
            with pytest.raises(shardflow.MigrationError) as caught:
                db.cluster.migrate(shard, to=target)
            record = caught.value.record
            assert isinstance(record, shardflow.MigrationRecord)
            assert record.phase == "rolled_back"
            assert "verification" in record.outcome and named in record.outcome, record.outcome
            # the source still serves every row, and still owns the shard
            assert db.sql("SELECT count(*) AS n FROM events").column("n").to_pylist() == [ROWS]
            assert db.sql(CHECK).to_pylist() == expected
            placed = {s["shard"]: s["node"] for s in db.cluster.shards().to_pylist()}
            assert placed[shard] == owner
            assert not prepared(), "the switch written ahead stayed behind its roll-back"
            assert db.cluster.migrations()[-1].outcome == record.outcome
            assert rolled_back_counted(db) == 1
    with shardflow.connect(workers=3, data_dir=tmp_path / "data", auto_balance=False) as db:
        moved = db.cluster.migrate(shard, to=target)  # the hook is off: the same move
        assert moved.phase == "done" and moved.to_nodes == (target,)
        assert not prepared()  # none left once switched
        assert db.sql(CHECK).to_pylist() == expected
        history = db.cluster.migrations()
        assert [m.phase for m in history] == ["rolled_back", "rolled_back", "done"]
        assert rolled_back_counted(db) == 0  # a new coordinator counts from zero
