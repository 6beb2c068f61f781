"""A table loads from any Arrow stream — a RecordBatchReader, a DuckDB relation, a Polars
DataFrame — read once, batch by batch, and holds the same rows as DuckDB's own table."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import duckdb
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import shardflow
from shardflow.config import Settings
from shardflow.runtime.client.sources import arrow_size, open_source

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


def test_a_small_source_is_one_shard_and_a_stream_or_an_empty_one_is_spread(
    small_oracle: duckdb.DuckDBPyConnection, tmp_path: Path
) -> None:
    """A new table gets no more shards than its size fills at ``initial_shard_bytes`` each,
    where the size is known before the load: a table's, or a Parquet file's (estimated from
    its first batch); a stream's is not, and an empty table is made to be filled."""
    orders = small_oracle.sql("SELECT * FROM orders").to_arrow_table()
    assert 0 < orders.nbytes < Settings().initial_shard_bytes
    pq.write_table(orders, tmp_path / "orders.parquet", row_group_size=20_000)
    stream = pa.RecordBatchReader.from_batches(orders.schema, orders.to_batches())
    sources: dict[str, tuple[object, int]] = {
        "from_table": (orders, 1),
        "from_parquet": (tmp_path / "orders.parquet", 1),
        "from_stream": (stream, 2),
        "empty": (orders.slice(0, 0), 2),
    }
    with shardflow.connect(workers=2, data_dir=tmp_path / "data", auto_balance=False) as db:
        for name, (source, _) in sources.items():
            db.create_table(name, source, distributed_by="o_orderkey")
        db.create_table("beside", orders, distributed_by="o_orderkey", colocate_with="empty")
        shards = {row["name"]: row["shards"] for row in db.tables().to_pylist()}
        assert shards == {"beside": 2} | {name: units for name, (_, units) in sources.items()}
        expected = _sorted(small_oracle.sql(QUERY.format("orders")).to_arrow_table())
        for name in ("from_table", "from_parquet", "from_stream", "beside"):
            assert _sorted(db.sql(QUERY.format(name))) == expected, name


def test_a_parquet_sources_size_is_estimated_from_its_first_batch(tmp_path: Path) -> None:
    table = pa.table(
        {
            "k": pa.array(range(50_000), pa.int64()),
            "s": [f"row {i} " * (i % 7) for i in range(50_000)],
        }
    )
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=8_000)
    _, total, batches = open_source(tmp_path / "t.parquet", 10_000)
    size, batches = arrow_size(tmp_path / "t.parquet", total, batches)
    assert size is not None and abs(size - table.nbytes) < 0.25 * table.nbytes
    assert sum(b.num_rows for b in batches) == 50_000  # the batch read ahead is not lost
