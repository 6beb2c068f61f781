"""Answers read straight from the workers on a real Ray cluster (``db.endpoints``): each
worker reserves its part over its fast lane and serves it from its own Flight port; the
parts together are DuckDB's answer. A worker killed with SIGKILL before its part is read
fails that read with a retryable error (UNAVAILABLE), and once its shards failed over the
same query is reserved and read whole again."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.flight as flight
import pytest

import shardflow
from shardflow.records import AnswerPart
from tests.cluster.conftest import sigkill_worker, wait_for_failover

pytestmark = pytest.mark.cluster
ROWS = 90_000
QUERY = "SELECT id, v FROM w WHERE v % 5 <> 2"
TOKEN = "a-bearer-token"


def rows() -> pa.Table:
    return pa.table({"id": pa.array(range(ROWS), pa.int64()),
                     "v": pa.array([i * 7 % 1000 for i in range(ROWS)], pa.int64())})  # fmt: skip


def oracle() -> list[int]:
    con = duckdb.connect()
    con.register("w", rows())
    ids = sorted(con.sql(QUERY).to_arrow_table().column("id").to_pylist())
    con.close()
    return ids


def read(part: AnswerPart) -> pa.Table:
    client = flight.FlightClient(part.location)
    options = flight.FlightCallOptions(headers=[(b"authorization", f"Bearer {TOKEN}".encode())])
    try:
        return client.do_get(flight.Ticket(part.ticket), options).read_all()
    finally:
        client.close()


def test_parts_read_from_the_workers_and_a_worker_killed_before_its_read(tmp_path: Path) -> None:
    with shardflow.connect(workers=3, data_dir=tmp_path / "data", initial_shard_bytes=0) as db:
        db.create_table("w", rows(), distributed_by="id")
        reserved = db.endpoints(QUERY, credential=TOKEN)
        assert reserved is not None
        schema, parts = reserved
        assert sorted(p.node for p in parts) == ["node-0", "node-1", "node-2"]
        read_parts = [read(part) for part in parts]
        assert all(part.schema == schema for part in read_parts)
        assert sorted(pa.concat_tables(read_parts).column("id").to_pylist()) == oracle()
        assert db.endpoints("SELECT count(*) FROM w") is None  # merged: not in parts
        assert db.endpoints(QUERY, tls=True) is None  # no endpoint here speaks TLS

        _, parts = db.endpoints(QUERY, credential=TOKEN) or (None, [])
        victim = next(p for p in parts if p.node == "node-1")
        sigkill_worker(db, victim.node)
        with pytest.raises(flight.FlightUnavailableError):
            read(victim)

        wait_for_failover(db)
        again = db.endpoints(QUERY, credential=TOKEN)
        assert again is not None
        ids = pa.concat_tables([read(part) for part in again[1]]).column("id").to_pylist()
        assert sorted(ids) == oracle()
