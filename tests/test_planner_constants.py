"""Constants in SELECT, DISTINCT, GROUP BY and ORDER BY, and DISTINCT after GROUP BY: the
plans must answer what DuckDB answers, and never emit SQL DuckDB refuses (an integer in a
GROUP BY or ORDER BY is a position there)."""

from __future__ import annotations

import duckdb
import pytest

from shardflow.sql import plan
from tests.support.compare import same_as_duckdb
from tests.support.inmemory import InMemoryCluster

Small = tuple[InMemoryCluster, duckdb.DuckDBPyConnection]

QUERIES = [
    # the issue: one row per worker instead of one
    "SELECT DISTINCT -53 FROM t GROUP BY col0",
    "SELECT DISTINCT col0 % 2 FROM t GROUP BY col0",
    "SELECT DISTINCT col1 % 3, col0 FROM t GROUP BY col0, col1",
    "SELECT DISTINCT count(*) FROM t GROUP BY col0",
    "SELECT DISTINCT ON (col1 % 3) col1 % 3, col1 FROM t ORDER BY col1 % 3, col1",
    "SELECT DISTINCT ON (col0) col0, col1 FROM t ORDER BY col0, col1 DESC",
    # the issue: Binder Error: GROUP BY term out of range
    "SELECT DISTINCT 83 FROM t WHERE col2 IN (-43)",
    "SELECT DISTINCT 83 FROM t WHERE col2 IN (-4300)",
    "SELECT SUM(DISTINCT 11) FROM t",
    "SELECT SUM(DISTINCT 11), COUNT(DISTINCT 'a'), AVG(DISTINCT 2.5) FROM t WHERE col1 > 0",
    "SELECT DISTINCT -col1 AS col0, -5 FROM t",
    "SELECT DISTINCT NULL, 'x', col2 FROM t3",
    "SELECT 83, count(*) FROM t GROUP BY 1",
    "SELECT 83 AS a, count(*) FROM t WHERE col1 > 1000 GROUP BY 1",
    "SELECT 83 AS a, col2, count(*) FROM t GROUP BY 1, 2 ORDER BY 2 NULLS FIRST",
    "SELECT 'k', col2, max(col1) FROM t3 GROUP BY 'k', col2",
    "SELECT NULL AS n, min(col1) FROM t GROUP BY n",
    "SELECT col2, 7 FROM t ORDER BY 2, 1 NULLS FIRST LIMIT 5",
    "SELECT col1, -3 AS k FROM t ORDER BY k, 1 LIMIT 5",
    "SELECT DISTINCT 1, 2, 3 FROM t ORDER BY 3, 2, 1",
    "SELECT count(*), 5 FROM t GROUP BY col1 % 2 ORDER BY 2, 1",
    "SELECT col0 FROM t ORDER BY 1 + 1, 1 NULLS FIRST LIMIT 3",
    "SELECT min(7), max(NULL), count(3), sum(1) FROM t",
    "SELECT min(7), sum(1) FROM t WHERE col1 > 1000",
    "SELECT col2, sum(2), count(DISTINCT 4) FROM t GROUP BY col2",
    "SELECT col2 FROM t GROUP BY col2, 'k' HAVING count(*) > 1",
]


@pytest.mark.parametrize("sql", QUERIES)
def test_constants_answer_like_duckdb(small: Small, sql: str) -> None:
    same_as_duckdb(*small, sql)


@pytest.mark.parametrize("sql", QUERIES)
def test_no_stage_groups_or_orders_by_a_literal(small: Small, sql: str) -> None:
    """Every stage's SQL binds in DuckDB as written: no literal key is read as a position."""
    import sqlglot
    from sqlglot import exp

    cluster, _ = small
    for stage in plan(sql, cluster.catalog).stages:
        for text in (stage.sql, stage.merge_sql):
            if text is None:
                continue
            tree = sqlglot.parse_one(text, dialect="duckdb")
            for group in tree.find_all(exp.Group):
                assert not any(isinstance(k, exp.Literal) for k in group.expressions), text
            for order in tree.find_all(exp.Order):
                assert not any(isinstance(o.this, exp.Literal) for o in order.expressions), text
