"""Answers read as they arrive on a real Ray cluster (``db.stream``): each worker's part over
its fast lane, equal to DuckDB's answer (an ORDER BY's sorted parts interleaved, holding
about a frame per worker); and a worker killed with SIGKILL while its part is
being read, which must end the answer with ``AnswerInterrupted`` (or leave it whole), never
give rows twice or missing, and not keep the next reading from being whole."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pytest

import shardflow
from shardflow.errors import AnswerInterrupted
from shardflow.runtime.fastlane import STREAM_FRAME_BYTES
from tests.cluster.conftest import sigkill_worker, wait_for_failover

pytestmark = pytest.mark.cluster
ROWS = 600_000


def wide() -> pa.Table:
    ids = pa.array(range(ROWS), pa.int64())
    return pa.table({"id": ids, "pad": pc.binary_join_element_wise(
        pc.cast(ids, pa.string()), pa.scalar("y" * 100), "")})  # fmt: skip


def oracle(query: str) -> list[int]:
    con = duckdb.connect()
    con.register("w", wide())
    try:
        return con.sql(query).to_arrow_table().column("id").to_pylist()
    finally:
        con.close()


def test_a_worker_killed_while_its_part_is_read_ends_the_answer_cleanly(tmp_path: Path) -> None:
    with shardflow.connect(
        workers=3, data_dir=tmp_path / "data", initial_shard_bytes=0, stream_buffer_mb=1
    ) as db:
        db.create_table("w", wide(), distributed_by="id")
        holders = {row["node"] for row in db.cluster.shards().to_pylist()}
        assert len(holders) == 3, "the test needs a part on every worker"
        whole = db.stream("SELECT id FROM w WHERE id % 3 = 0").read_all()
        assert sorted(whole.column("id").to_pylist()) == list(range(0, ROWS, 3))

        # sorted parts interleaved as they arrive, about a frame per worker held here
        query = "SELECT id, pad FROM w WHERE id % 7 = 2 ORDER BY pad DESC LIMIT 50000"
        session = db._session
        assert session is not None
        ordered = session.stream(query)
        got = pa.Table.from_batches(list(ordered), ordered.schema)
        assert got.column("id").to_pylist() == oracle(query)
        assert ordered.most_held <= ordered.limit + STREAM_FRAME_BYTES < got.nbytes

        reader = db.stream("SELECT id, pad FROM w")
        ids = reader.read_next_batch().column("id").to_pylist()  # the parts are under way
        sigkill_worker(db, "node-1")
        try:
            for batch in reader:
                ids.extend(batch.column("id").to_pylist())
        except AnswerInterrupted as error:
            assert "run the query again" in str(error)
            assert len(ids) < ROWS
        else:  # node-1's part was all read before it died: the answer is whole
            assert len(ids) == ROWS
        assert len(set(ids)) == len(ids)  # never a row twice

        wait_for_failover(db)
        again = db.stream("SELECT id, pad FROM w").read_all()
        assert again.num_rows == ROWS and pc.count_distinct(again["id"]).as_py() == ROWS
