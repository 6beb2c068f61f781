"""Run a query on the in-memory cluster and on DuckDB over the same rows and compare the
answers, names included."""

from __future__ import annotations

import duckdb

from tests.support.inmemory import InMemoryCluster
from tests.support.oracle import assert_same_result, query_is_ordered, sort_key_indexes


def same_as_duckdb(cluster: InMemoryCluster, oracle: duckdb.DuckDBPyConnection, sql: str) -> None:
    """``sql`` answers on ``cluster`` what DuckDB answers over ``oracle``: the same rows
    (in the same order where the query orders them, ties aside), column names and count."""
    expected = oracle.sql(sql).to_arrow_table()
    actual = cluster.sql(sql)
    assert_same_result(
        actual,
        expected,
        ordered=query_is_ordered(sql),
        sort_keys=sort_key_indexes(sql, expected.column_names),
        context=sql,
    )
