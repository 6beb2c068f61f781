"""Shared fixtures: TPC-H data generated once per session, an in-memory cluster over it for
planner tests, and one real local Ray cluster for the cluster tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardflow import tpch
from shardflow.catalog.types import storage_schema
from tests.support.inmemory import InMemoryCluster

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@pytest.fixture(scope="session")
def tpch_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TPC-H at scale factor 0.01 (fast planner tests)."""
    return tpch.generate(0.01, tmp_path_factory.mktemp("tpch"))


@pytest.fixture(scope="session")
def tpch_small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TPC-H at scale factor 0.1 (the cluster tests, as the issue asks)."""
    return tpch.generate(0.1, tmp_path_factory.mktemp("tpch"))


def add_extra_tables(load: object, tables: dict[str, object]) -> None:
    """Beyond TPC-H: a second co-location group and a table without a distribution key."""
    load("customer_d", tables["customer"], "c_custkey", None, False)  # type: ignore[operator]
    load("orders_rr", tables["orders"], None, None, False)  # type: ignore[operator]


@pytest.fixture(scope="session")
def inmemory(tpch_tiny: Path) -> InMemoryCluster:
    cluster = InMemoryCluster(nodes=3, units_per_node=2)
    tables = {}
    for layout in tpch.LAYOUT:
        table = pq.read_table(tpch_tiny / f"{layout.name}.parquet")
        tables[layout.name] = table.cast(storage_schema(table.schema))
        cluster.create_table(
            layout.name,
            tables[layout.name],
            layout.distributed_by,
            layout.colocate_with,
            layout.replicated,
        )
    add_extra_tables(cluster.create_table, tables)
    return cluster


@pytest.fixture(scope="session")
def tiny_oracle(tpch_tiny: Path) -> Iterator[duckdb.DuckDBPyConnection]:
    con = tpch.duckdb_oracle(tpch_tiny)
    con.execute("CREATE TABLE customer_d AS SELECT * FROM customer")
    con.execute("CREATE TABLE orders_rr AS SELECT * FROM orders")
    yield con
    con.close()


def _small_tables() -> dict[str, tuple[pa.Table, str | None, str | None, bool]]:
    """name -> (rows, distributed_by, colocate_with, replicated): small tables in the style
    of SQL logic tests (integers with NULLs), and mixed-case and non-ASCII names."""
    n = 40
    ints = {
        "col0": pa.array([i if i % 9 else None for i in range(n)], pa.int64()),
        "col1": pa.array([(i * 37) % 97 - 48 for i in range(n)], pa.int64()),
        "col2": pa.array([(i * 11) % 13 - 43 if i % 7 else None for i in range(n)], pa.int64()),
    }
    t = pa.table(ints)
    mixed = pa.table(
        {
            "O_OrderKey": pa.array(range(1, n + 1), pa.int64()),
            "O_CustKey": pa.array([i % 7 for i in range(n)], pa.int64()),
            "Straße": pa.array([f"s{i % 3}" for i in range(n)]),
            "STRASSE": pa.array([i % 5 for i in range(n)], pa.int64()),
        }
    )
    apples = pa.table(
        {"Äpfel": pa.array(range(7), pa.int64()), "name": [f"n{i}" for i in range(7)]}
    )
    return {
        "t": (t, "col0", None, False),
        "t1": (t, "col0", None, False),
        "t2": (t.rename_columns(["col0", "x", "col2"]), "col0", "t1", False),
        "t3": (t, "col1", None, False),
        "r": (t, None, None, True),
        "Orders": (mixed, "O_OrderKey", None, False),
        "Äpfel": (apples, None, None, True),
        "äpfel": (apples.rename_columns(["äpfel", "NAME"]), None, None, True),
    }


@pytest.fixture(scope="session")
def small() -> Iterator[tuple[InMemoryCluster, duckdb.DuckDBPyConnection]]:
    """An in-memory cluster (2 nodes, 2 units each) over :func:`_small_tables`, and DuckDB
    over the same rows."""
    cluster = InMemoryCluster(nodes=2, units_per_node=2)
    con = duckdb.connect()
    for name, (rows, key, colocate, replicated) in _small_tables().items():
        cluster.create_table(name, rows, key, colocate, replicated)
        con.register(f"__{name}", rows)
        con.execute(f'CREATE TABLE "{name}" AS SELECT * FROM "__{name}"')
    yield cluster, con
    con.close()
