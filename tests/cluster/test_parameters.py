"""``db.sql(query, params)`` on a real cluster answers as DuckDB does when DuckDB binds the
same parameters itself (TPC-H SF 0.1); a routed lookup stays routed with a parameter."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

import shardflow
from shardflow.errors import QueryError

pytestmark = pytest.mark.cluster

CASES: list[tuple[str, list[Any]]] = [
    ("SELECT o_orderkey, o_totalprice FROM orders WHERE o_orderkey = ?", [5]),
    ("SELECT o_orderkey FROM orders WHERE o_orderkey IN (?, ?, ?) ORDER BY 1", [1, 2, 32]),
    (
        "SELECT o_orderpriority, count(*) AS n FROM orders WHERE o_orderdate >= ? "
        "AND o_orderdate < $2 GROUP BY 1 ORDER BY 1",
        [datetime.date(1995, 1, 1), datetime.date(1995, 4, 1)],
    ),
    ("SELECT count(*) AS n FROM customer WHERE c_mktsegment = ?", ["BUILDING"]),
    ("SELECT count(*) AS n FROM customer WHERE c_name = ?", ["x' OR '1'='1"]),
]


@pytest.mark.parametrize(("query", "params"), CASES, ids=range(len(CASES)))
def test_parameters_answer_as_duckdb_binds_them(
    db: shardflow.Database, small_oracle: Any, query: str, params: list[Any]
) -> None:
    ours = db.sql(query, params)
    theirs = small_oracle.sql(query, params=params).to_arrow_table()
    assert ours.to_pylist() == theirs.to_pylist()


def test_a_parameterised_key_lookup_is_routed(db: shardflow.Database) -> None:
    db.sql("SELECT * FROM orders WHERE o_orderkey = ?", [7])
    assert len({f.worker for s in db.last_report.stages for f in s.fragments}) == 1


def test_an_unbound_parameter_is_refused(db: shardflow.Database) -> None:
    with pytest.raises(QueryError, match="parameter 2 is not bound"):
        db.sql("SELECT * FROM orders WHERE o_orderkey = ? AND o_custkey = ?", [7])
