"""Shared fixtures: TPC-H data generated once per session, an in-memory cluster over it for
planner tests, and one real local Ray cluster for the cluster tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import duckdb
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
