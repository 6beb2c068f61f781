"""Which queries run as written over gathered tables: each construct the distributed
planner cannot take apart is named; ordinary analytics are not sent this way."""

from __future__ import annotations

import pytest

from shardflow import tpch
from shardflow.sql.parse import parse
from shardflow.sql.verbatim import duckdb_aggregates, whole_query_reason


@pytest.mark.parametrize(
    ("sql", "named"),
    [
        ("SELECT mad(x) FROM t", "mad() is an aggregate"),
        ("SELECT histogram(x) FROM t", "histogram() is an aggregate"),
        ("SELECT any_value(x ORDER BY y) FROM t", "IGNORE/RESPECT NULLS"),  # SQLGlot's reading
        ("SELECT list(x ORDER BY y) FROM t", "orders its input"),
        ("SELECT * FROM a ASOF JOIN b ON a.t >= b.t", "ASOF JOIN"),
        ("SELECT * FROM a POSITIONAL JOIN b", "POSITIONAL JOIN"),
        ("SELECT * FROM a ANTI JOIN b ON a.k = b.k", "ANTI JOIN"),
        ("SELECT sum(x) OVER w FROM t WINDOW w AS (ORDER BY y)", "named WINDOW"),
        ("SELECT DISTINCT ON (k) * FROM t", "DISTINCT ON"),
        ("SELECT x FROM t UNION BY NAME SELECT x FROM u", "UNION BY NAME"),
        ("SELECT * FROM t LIMIT 10%", "percentage"),
        ("SELECT * FROM t LIMIT (SELECT 3)", "by an expression"),
        ("SELECT COLUMNS('a.*') FROM t", "COLUMNS"),
        ("SELECT * REPLACE (x + 1 AS x) FROM t", "REPLACE"),
        ("SELECT * FROM t ORDER BY * DESC", "ORDER BY *"),
        ("SELECT unnest(l) FROM t", "UNNEST"),
        ("SELECT * FROM t, LATERAL (SELECT t.x) s", "LATERAL"),
        ("SELECT DISTINCT a FROM t ORDER BY a, b", "does not select"),
        ("SELECT 1, a FROM t UNION SELECT b AS a, 1 FROM u ORDER BY a", "different columns"),
        ("SELECT arr[:loc] FROM t, p", "placeholder"),
    ],
)
def test_a_construct_the_planner_cannot_take_apart_is_named(sql: str, named: str) -> None:
    reason = whole_query_reason(parse(sql))
    assert reason is not None and named in reason, reason


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT DISTINCT a FROM t ORDER BY a",
        "SELECT DISTINCT a AS k, b FROM t ORDER BY k DESC, 2",
        "SELECT DISTINCT a + 1 FROM t ORDER BY a + 1",
        "SELECT a FROM t UNION SELECT b FROM u ORDER BY b",
        "SELECT a, 1 FROM t UNION ALL SELECT a, 2 FROM u ORDER BY a",
        "SELECT arr[1:2] FROM t",
    ],
)
def test_the_ordinary_forms_of_those_are_planned(sql: str) -> None:
    assert whole_query_reason(parse(sql)) is None


@pytest.mark.parametrize("number", range(1, 23))
def test_tpch_queries_are_planned_distributed(number: int) -> None:
    assert whole_query_reason(parse(tpch.query(number))) is None


def test_duckdbs_aggregates_come_from_duckdb() -> None:
    names = duckdb_aggregates()
    assert {"sum", "mad", "histogram", "product", "arbitrary", "bitstring_agg"} <= names
    assert "abs" not in names and "upper" not in names
