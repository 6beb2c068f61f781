"""A table loads from any Arrow stream — a RecordBatchReader, a DuckDB relation, a Polars
DataFrame — read once, batch by batch, and holds the same rows as DuckDB's own table."""

from __future__ import annotations

from collections.abc import Iterator

import duckdb
import polars as pl
import pyarrow as pa
import pytest

import shardflow

pytestmark = pytest.mark.cluster

QUERY = "SELECT o_orderstatus, count(*) AS n, sum(o_totalprice) AS total FROM {} GROUP BY 1"


def _sorted(table: pa.Table) -> list[dict[str, object]]:
    return sorted(table.to_pylist(), key=lambda row: str(row["o_orderstatus"]))


@pytest.mark.parametrize("producer", ["duckdb", "polars", "reader"])
def test_a_table_loads_from_an_arrow_stream(
    db: shardflow.Database, small_oracle: duckdb.DuckDBPyConnection, producer: str
) -> None:
    orders = small_oracle.sql("SELECT * FROM orders ORDER BY o_orderkey").to_arrow_table()
    pulled: list[int] = []

    def batches() -> Iterator[pa.RecordBatch]:  # one batch bigger than a load batch
        for batch in orders.combine_chunks().to_batches():
            pulled.append(batch.num_rows)
            yield batch

    source: object = {
        "duckdb": small_oracle.sql("SELECT * FROM orders"),
        "polars": pl.from_arrow(orders),
        "reader": pa.RecordBatchReader.from_batches(orders.schema, batches()),
    }[producer]
    name = f"orders_from_{producer}"
    assert db.create_table(name, source, distributed_by="o_orderkey", progress=True) == len(orders)
    try:
        expected = small_oracle.sql(QUERY.format("orders")).to_arrow_table()
        assert _sorted(db.sql(QUERY.format(name))) == _sorted(expected)
        if producer == "reader":
            assert pulled == [len(orders)], "the stream was not read exactly once"
    finally:
        db.drop_table(name)


def test_a_stream_that_fails_halfway_leaves_no_table(db: shardflow.Database) -> None:
    schema = pa.schema([("k", pa.int64()), ("v", pa.float64())])

    def failing() -> Iterator[pa.RecordBatch]:
        yield pa.record_batch([pa.array([1, 2]), pa.array([1.0, 2.0])], schema=schema)
        raise pa.ArrowInvalid("the producer broke")

    def ill_typed() -> Iterator[pa.RecordBatch]:
        yield pa.record_batch([pa.array(["x"]), pa.array([1.0])], names=["k", "v"])

    before = db.tables().column("name").to_pylist()
    for producer, message in [(failing, "the producer broke"), (ill_typed, "k: string")]:
        source = pa.RecordBatchReader.from_batches(schema, producer())
        with pytest.raises(shardflow.TableError, match=message):
            db.create_table("streamed", source, distributed_by="k")
    assert db.tables().column("name").to_pylist() == before
