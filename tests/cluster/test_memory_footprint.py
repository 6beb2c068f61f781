"""A loaded worker holds its shards at DuckDB's compressed size, not the load's Arrow
batches: the rows come over the fast lane (not through Ray's object store, whose pages stay
mapped), the load's last rows are compressed when it ends, and the memory Arrow allocated on
the way is handed back to the system (the worker processes allocate from jemalloc, which the
embedded cluster's Ray node puts in their environment). Its process lets a waiting thread
have the GIL sooner than Python's default, the driver's is left as it was."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest
import ray

import shardflow
from shardflow.runtime.ray.names import SWITCH_INTERVAL_S
from shardflow.runtime.ray.node import PROCESS_ENVIRONMENT

pytestmark = pytest.mark.cluster

ROWS = 1_200_000
TABLES = ("t", "u")


def rows() -> pa.Table:
    ids = pa.array(range(ROWS), pa.int64())
    text = pc.binary_join_element_wise(pc.cast(ids, pa.string()), "-" + "padding" * 8, "")
    return pa.table({"id": ids, "g": pc.bit_wise_and(ids, 7), "pad": text})


def resident(pid: int, kind: str) -> int:
    """Resident bytes of a kind (``RssAnon``: private, ``RssShmem``: shared memory, as Ray's
    object store is)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split(f"{kind}:")[1].split()[0]) << 10


def test_a_loaded_worker_holds_its_rows_compressed_and_no_more(tmp_path: Path) -> None:
    table = rows()
    ours = {key: os.environ.get(key) for key in PROCESS_ENVIRONMENT}
    driver_switch = sys.getswitchinterval()
    # no balancer: a unit it splits is compressed by the split; two units of each table,
    # each below the compactor's threshold
    with shardflow.connect(
        workers=1,
        initial_shard_bytes=0,
        data_dir=tmp_path / "data",
        auto_balance=False,
        shards_per_worker=2,
    ) as db:
        assert {key: os.environ.get(key) for key in PROCESS_ENVIRONMENT} == ours  # as it was
        workers = db._backend.handle.workers
        (node,) = workers.known
        pid = workers.get(node).pid().get()
        spawned = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        for key, value in PROCESS_ENVIRONMENT.items():
            assert f"{key}={os.environ.get(key, value)}".encode() in spawned
        asked = workers.get(node).handle.__ray_call__  # runs a function in the actor
        switch = ray.get(asked.remote(lambda _: __import__("sys").getswitchinterval()))
        assert switch == SWITCH_INTERVAL_S and sys.getswitchinterval() == driver_switch
        before = resident(pid, "RssAnon")

        for name in TABLES:
            db.create_table(name, table, distributed_by="id")
        loaded = len(TABLES) * table.nbytes

        # no unit took in enough rows for the compactor: the loads' ends compress them
        assert max(db.cluster.shards().column("bytes").to_pylist()) < 64 << 20
        deadline = time.monotonic() + 30
        while (engine := db.cluster.nodes()[0].engine_memory_bytes) > loaded // 4:
            assert time.monotonic() < deadline, f"DuckDB holds {engine} of {loaded} bytes"
            time.sleep(0.2)
        time.sleep(2)  # the allocator returns freed pages within a second
        grown = resident(pid, "RssAnon") - before
        # the rows came over the fast lane: none of them stays mapped from the object store
        assert resident(pid, "RssShmem") < loaded // 20
        assert grown < loaded // 4, f"{grown} bytes more after {loaded} loaded ({engine} DuckDB)"
        for name in TABLES:
            assert db.sql(f"SELECT count(*) AS n, sum(id) AS s FROM {name}").to_pylist() == [
                {"n": ROWS, "s": ROWS * (ROWS - 1) // 2}
            ]


def test_a_moves_rows_reach_its_target_without_the_object_store(tmp_path: Path) -> None:
    """The target pulls the snapshot over its source's fast lane: none of the rows stays
    mapped in the target from Ray's object store once the move is done."""
    table = rows()
    with shardflow.connect(
        workers=2, initial_shard_bytes=0, data_dir=tmp_path / "data", auto_balance=False
    ) as db:
        db.create_table("t", table, distributed_by="id")
        target = db._backend.handle.workers.get("node-1").pid().get()
        [shard, *_] = [s for s in db.cluster.shards().to_pylist() if s["node"] == "node-0"]
        db.cluster.migrate(shard["shard"], "node-1")
        assert resident(target, "RssShmem") < shard["bytes"] // 10, shard
        assert db.sql("SELECT count(*) AS n, sum(id) AS s FROM t").to_pylist() == [
            {"n": ROWS, "s": ROWS * (ROWS - 1) // 2}
        ]
