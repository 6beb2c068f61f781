"""Answers read as they arrive (``runtime/client/streams.py``), in process: real workers,
DuckDB and files, DuckDB as the oracle. The answer is the query's whatever the routing the
session starts with; at most ``stream_buffer_mb`` wait for the reader; a part that moved is
asked again, and where rows were handed out already the cluster cannot change under the
reader without the reader being told: never rows twice, never rows missing."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest

from shardflow.errors import AnswerInterrupted
from shardflow.runtime.client.streams import AnswerStream, merged_in_order, streams
from shardflow.runtime.fastlane import STREAM_FRAME_BYTES
from shardflow.sql.plan import WHOLE
from tests.support.local_cluster import LocalCluster

ROWS = 200_000


def wide(start: int, count: int) -> pa.Table:
    """Rows of about 120 bytes: ``ROWS`` of them make an answer of ~24 MB."""
    ids = pa.array(range(start, start + count), pa.int64())
    pad = pa.array([f"{i:0>100}" for i in range(start, start + count)])
    return pa.table({"id": ids, "v": pa.compute.multiply(ids, 3), "pad": pad})


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    local = LocalCluster(tmp_path / "data", nodes=3, stream_buffer_mb=1)
    local.create_table("t", wide(0, ROWS), "id")
    yield local
    local.close()


def oracle(query: str) -> pa.Table:
    con = duckdb.connect()
    con.register("t", wide(0, ROWS))
    try:
        return con.sql(query).to_arrow_table()
    finally:
        con.close()


def read(stream: AnswerStream, pause_s: float = 0.0) -> pa.Table:
    batches = []
    for batch in stream:
        batches.append(batch)
        time.sleep(pause_s)
    return pa.Table.from_batches(batches, stream.schema)


def same_rows(got: pa.Table, want: pa.Table) -> bool:
    order = [(name, "ascending") for name in want.column_names]
    return got.sort_by(order).equals(want.sort_by(order))


@pytest.mark.parametrize(
    "query",
    [
        "SELECT * FROM t",
        "SELECT id, pad FROM t WHERE v % 7 = 1",
        "SELECT * FROM t WHERE id = 4242",
        "SELECT * FROM t WHERE id < 0",
        "SELECT v % 10 AS d, count(*) AS n FROM t GROUP BY d",  # merged: answered whole
        "SELECT id FROM t ORDER BY v DESC LIMIT 5",
        "SELECT id, pad FROM t ORDER BY v DESC",  # sorted parts, interleaved as they come
        "SELECT pad AS p, id FROM t WHERE v % 7 = 1 ORDER BY pad DESC, id LIMIT 900 OFFSET 25",
    ],
)
def test_a_streamed_answer_is_duckdbs(cluster: LocalCluster, query: str) -> None:
    stream = cluster.session.stream(query)
    got = read(stream)
    want = oracle(query)
    assert got.schema == cluster.sql(query).schema  # as db.sql types it
    assert got.column_names == want.column_names
    if "ORDER BY" in query:
        assert got.to_pylist() == want.to_pylist()
    else:
        assert same_rows(got, want.cast(got.schema))


def test_a_slow_reader_holds_no_more_than_the_buffer(cluster: LocalCluster) -> None:
    """~24 MB of answer through a 1 MB buffer: the parts wait on the workers' side."""
    query = "SELECT * FROM t"
    assert streams(cluster.session.plan(query).plan, len(cluster.units("t")))
    stream = cluster.session.stream(query)
    got = read(stream, pause_s=0.002)
    assert got.num_rows == ROWS and got.nbytes > 20 * stream.limit
    assert stream.most_held <= stream.limit + STREAM_FRAME_BYTES


def test_a_reader_that_stops_early_ends_the_reading(cluster: LocalCluster) -> None:
    stream = cluster.session.stream("SELECT * FROM t")
    first = next(iter(stream))
    assert first.num_rows > 0
    stream.close()
    again = read(cluster.session.stream("SELECT count(*) AS n FROM t"))
    assert again.to_pylist() == [{"n": ROWS}]


def test_a_part_that_moved_before_it_was_read_is_asked_again(cluster: LocalCluster) -> None:
    """The session's routing is older than a move: the old owner answers Moved, the part
    runs again at its new owner, and the answer is whole."""
    cluster.sql("SELECT count(*) FROM t")  # the session routes t now
    routed = cluster.session.catalog
    unit = cluster.units("t")[0]
    other = next(n for n in cluster.catalog.nodes if n != unit.node)
    assert cluster.migrate(unit.unit_id, other)["outcome"] == "done"
    cluster.session.catalog = routed  # as a session that did not see the move has it
    assert routed.group_of("t").units != cluster.units("t")
    got = read(cluster.session.stream("SELECT id, v FROM t"))
    assert same_rows(got, oracle("SELECT id, v FROM t"))


def test_a_split_under_a_reader_who_has_rows_ends_the_answer_and_says_so(
    cluster: LocalCluster,
) -> None:
    """Units split after the session routed: where nothing was handed out the answer starts
    over; where rows were, reading raises a retryable ClusterError instead of rows twice."""
    cluster.sql("SELECT count(*) FROM t")
    routed = cluster.session.catalog
    first = cluster.units("t")[0]
    assert cluster.split(first.unit_id)["outcome"] == "done"
    cluster.session.catalog = routed  # as a session that did not see the split has it
    stream = cluster.session.stream("SELECT * FROM t")
    batches: list[pa.RecordBatch] = []
    with pytest.raises(AnswerInterrupted, match="run the query again"):
        for batch in stream:
            batches.append(batch)
            time.sleep(0.01)  # the reader has rows before the split part is asked again
    assert 0 < sum(b.num_rows for b in batches) < ROWS
    cluster.session.refresh()
    got = read(cluster.session.stream("SELECT * FROM t"))  # the next reading is whole
    assert got.num_rows == ROWS and len(set(got.column("id").to_pylist())) == ROWS


def test_a_table_of_several_units_on_one_worker_streams_its_whole_query(
    cluster: LocalCluster,
) -> None:
    """Every unit on one worker: the query runs whole there, in one part, read as it comes
    (a table of one unit, small, is answered whole)."""
    node = cluster.units("t")[0].node
    for unit in cluster.units("t")[1:]:
        assert cluster.migrate(unit.unit_id, node)["outcome"] == "done"
    planned = cluster.session.plan("SELECT * FROM t")
    assert planned.plan.result.strategy == WHOLE
    assert streams(planned.plan, len(cluster.units("t")))
    assert not streams(planned.plan, 1)
    stream = cluster.session.stream("SELECT * FROM t")
    got = read(stream, pause_s=0.002)
    assert same_rows(got, oracle("SELECT * FROM t").cast(got.schema))
    assert stream.most_held <= stream.limit + STREAM_FRAME_BYTES


def test_a_sorted_answer_leaves_in_order_holding_about_a_batch_per_worker(
    cluster: LocalCluster,
) -> None:
    """``ORDER BY`` over ~24 MB through a 1 MB buffer: each worker sorts its part, the
    client interleaves them as they come (never the whole answer held, as a merge did);
    a part that moved since the session routed is asked again before anything went out."""
    query = "SELECT * FROM t ORDER BY v DESC"
    assert merged_in_order(cluster.session.plan(query).plan) is not None
    cluster.sql("SELECT count(*) FROM t")
    routed = cluster.session.catalog
    unit = cluster.units("t")[0]
    other = next(n for n in cluster.catalog.nodes if n != unit.node)
    assert cluster.migrate(unit.unit_id, other)["outcome"] == "done"
    cluster.session.catalog = routed  # as a session that did not see the move has it
    stream = cluster.session.stream(query)
    got = read(stream, pause_s=0.002)
    assert got.to_pylist() == oracle(query).cast(got.schema).to_pylist()
    assert got.nbytes > 20 * stream.limit
    assert stream.most_held <= stream.limit + STREAM_FRAME_BYTES
