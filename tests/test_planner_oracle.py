"""The distributed plans answer exactly what DuckDB answers, run over really partitioned
data in one process (fast; the cluster tests run the same plans on Ray workers)."""

from __future__ import annotations

import os
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, example, given, settings

from shardflow import tpch
from shardflow.engine import DuckDBEngine
from shardflow.runtime.query.executor import execute
from shardflow.sql import explain, plan
from shardflow.sql.plan import WHOLE
from tests.support.inmemory import InMemoryCluster
from tests.support.oracle import assert_same_result, query_is_ordered, sort_key_indexes
from tests.support.querygen import select_queries

ENGINE = DuckDBEngine(threads=1)


def run(sql: str, cluster: InMemoryCluster) -> object:
    result, _ = execute(plan(sql, cluster.catalog), cluster, ENGINE)
    return result


@pytest.mark.parametrize("number", tpch.QUERY_NUMBERS)
def test_tpch_query_matches_duckdb(
    number: int, inmemory: InMemoryCluster, tiny_oracle: duckdb.DuckDBPyConnection
) -> None:
    sql = tpch.query(number)
    assert_tpch_answer(number, run(sql, inmemory), tiny_oracle)  # type: ignore[arg-type]


def assert_tpch_answer(number: int, answer: pa.Table, oracle: duckdb.DuckDBPyConnection) -> None:
    sql = tpch.query(number)
    expected = oracle.sql(sql).to_arrow_table()
    assert_same_result(
        answer,
        expected,
        ordered=query_is_ordered(sql),
        sort_keys=sort_key_indexes(sql, expected.column_names),
        check_names=False,
        context=f"Q{number}",
    )


@pytest.fixture(scope="module")
def one_node(tpch_tiny: Path) -> InMemoryCluster:
    """TPC-H with every shard on one node: each query runs there whole, as written."""
    cluster = InMemoryCluster(nodes=1, units_per_node=2)
    for layout in tpch.LAYOUT:
        table = pq.read_table(tpch_tiny / f"{layout.name}.parquet")
        cluster.create_table(
            layout.name, table, layout.distributed_by, layout.colocate_with, layout.replicated
        )
    return cluster


@pytest.mark.parametrize("number", tpch.QUERY_NUMBERS)
def test_tpch_query_on_one_node_runs_whole_and_matches_duckdb(
    number: int, one_node: InMemoryCluster, tiny_oracle: duckdb.DuckDBPyConnection
) -> None:
    sql = tpch.query(number)
    planned = plan(sql, one_node.catalog)
    if number in (2, 11, 16):  # they read only replicated tables
        assert [s.strategy for s in planned.stages] == ["replicated"]
    else:
        assert [(s.strategy, s.sql) for s in planned.stages] == [(WHOLE, sql)]
        assert "every shard it reads is on one node" in explain(planned)
    assert_tpch_answer(number, one_node.sql(sql), tiny_oracle)


@settings(
    max_examples=int(os.environ.get("SHARDFLOW_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(sql=select_queries())
@example(  # found by this test: the merge's ORDER BY lost NULLS FIRST
    sql="SELECT DISTINCT NULLIF(l_linenumber, 1) AS x0, l_suppkey, l_quantity FROM lineitem "
    "ORDER BY 2, 3, NULLIF(l_linenumber, 1) NULLS FIRST LIMIT 1"
)
def test_random_selects_match_duckdb(
    sql: str, inmemory: InMemoryCluster, tiny_oracle: duckdb.DuckDBPyConnection
) -> None:
    expected = tiny_oracle.sql(sql).to_arrow_table()
    assert_same_result(inmemory.sql(sql), expected, ordered=query_is_ordered(sql), context=sql)
