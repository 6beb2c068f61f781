"""A worker that stops answering but still runs (SIGSTOP: as a machine starved of CPU, or
a process stuck in the kernel) is declared dead after ``health_misses`` pings, its shards are
rebuilt elsewhere, and its process is stopped for good: left running, it would hold its old
catalog and could serve a stale session's query or take its insert after the new owners
rebuilt those shards."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pyarrow as pa
import pytest

import shardflow
from shardflow.catalog.lease import process_running

pytestmark = pytest.mark.cluster
ROWS = 10_000


def test_a_worker_that_stops_answering_is_failed_over_and_stopped(tmp_path: Path) -> None:
    with shardflow.connect(
        workers=3, data_dir=tmp_path / "data", auto_balance=False,
        health_interval_s=0.5, health_misses=3,
    ) as db:  # fmt: skip
        db.create_table("t", pa.table({"id": list(range(ROWS))}), distributed_by="id")
        pid = int(db._backend.handle.workers.get("node-1").pid().get())
        os.kill(pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 60
            while not db.cluster.failovers():
                assert time.monotonic() < deadline, "the silent worker was not declared dead"
                time.sleep(0.2)
            assert db.cluster.failovers()[0]["node"] == "node-1"
            while process_running(pid):
                assert time.monotonic() < deadline, "the worker declared dead still runs"
                time.sleep(0.2)
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        assert "node-1" not in {n.node_id for n in db.cluster.nodes()}
        db.insert("t", pa.table({"id": list(range(ROWS, ROWS + 10))}))
        count, total = db.sql("SELECT count(*), sum(id) FROM t").to_pylist()[0].values()
        assert (count, total) == (ROWS + 10, (ROWS + 10) * (ROWS + 9) // 2)
