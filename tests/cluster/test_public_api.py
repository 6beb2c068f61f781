"""What the service and the tools ask of a database through the public API, not its
internals: the tables' names and schemas, the workers' processes, a count at a service's
door, and whether a cluster keeps running after its database closes."""

from __future__ import annotations

import os
import time
import urllib.request
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import shardflow


def test_names_schemas_and_processes_come_from_the_public_api(
    db: shardflow.Database, tpch_small: Path
) -> None:
    listed = db.tables()
    assert db.table_names() == sorted(listed.column("name").to_pylist())
    assert "lineitem" in db.table_names()
    on_disk = pq.read_schema(next(tpch_small.glob("orders*.parquet"))).names
    assert db.schema("ORDERS").names == on_disk  # names match as DuckDB matches them
    with pytest.raises(shardflow.UnknownTableError):
        db.schema("no_such_table")
    nodes = db.cluster.nodes()
    pids = {n.pid for n in nodes}
    assert len(pids) == len(nodes) and os.getpid() not in pids
    for pid in pids:
        assert Path(f"/proc/{pid}").exists(), pid  # a worker process of this machine


def test_calls_refused_at_a_service_door_are_counted(db: shardflow.Database) -> None:
    def denied() -> float:
        with urllib.request.urlopen(db.cluster.metrics_url(), timeout=10) as answer:
            text = answer.read().decode()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("shardflow_denied_total") and 'action="drop_table"' in line
        )

    before = denied()
    db.cluster.record_access("drop_table")  # not waited for: it shows soon after
    deadline = time.monotonic() + 10
    while denied() == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert denied() == before + 1


def test_an_embedded_cluster_cannot_be_left_running(db: shardflow.Database) -> None:
    with pytest.raises(shardflow.ConfigError, match="embedded"):
        db.keep_running()
    assert db.settings.retry_deadline_s > 0  # the settings it runs with
    assert db.sql("SELECT 1 AS one").to_pylist() == [{"one": 1}]  # and it still serves
