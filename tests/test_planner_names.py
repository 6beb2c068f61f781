"""Names as DuckDB has them: tables and columns matched by DuckDB's rule wherever they are
written, repeated output names, and positions in ORDER BY / GROUP BY that point at them.
Each query is answered by the in-memory cluster and compared with DuckDB, names included."""

from __future__ import annotations

import duckdb
import pytest

from shardflow import TableExistsError, UnknownColumnError, UnknownTableError
from shardflow.sql import explain, plan
from tests.support.compare import same_as_duckdb
from tests.support.inmemory import InMemoryCluster

Small = tuple[InMemoryCluster, duckdb.DuckDBPyConnection]


@pytest.mark.parametrize(
    "sql",
    [
        # the issue: ORDER BY 1 became the constant 1 when the output names repeat
        "SELECT col0 AS a, col1 AS a FROM t ORDER BY 1 LIMIT 3",
        "SELECT col0 AS a, col1 AS a FROM t ORDER BY 2 DESC, 1 LIMIT 5",
        "SELECT col1 AS a, col2 AS A FROM t ORDER BY 2 NULLS FIRST, 1 LIMIT 5",
        "SELECT col1, col1 FROM t ORDER BY 2 DESC LIMIT 4",
        "SELECT col2 AS a, count(*) AS a FROM t GROUP BY 1 ORDER BY 2, 1",
        "SELECT DISTINCT col2 AS a, col2 % 3 AS a FROM t ORDER BY 2, 1",
        "SELECT col1, col2 FROM t ORDER BY (2) DESC NULLS LAST, (1) LIMIT 6",
        "SELECT col2 % 4, count(*) FROM t GROUP BY (1) ORDER BY (1)",
        "SELECT * FROM (SELECT col0 AS a, col1 AS a FROM t) s ORDER BY 2 LIMIT 3",
        "SELECT col1 AS a FROM t UNION ALL SELECT col2 FROM t1 ORDER BY 1 NULLS FIRST LIMIT 7",
    ],
)
def test_positions_point_at_the_select_item(small: Small, sql: str) -> None:
    same_as_duckdb(*small, sql)


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT -col1 AS col0 FROM t ORDER BY col0 + 0 NULLS FIRST, 1 LIMIT 5",
        "SELECT col1 AS x, col2 FROM t ORDER BY -x, 2 NULLS FIRST LIMIT 5",
        "SELECT col2 % 2 AS k, count(*) FROM t GROUP BY col2 % 2 ORDER BY -k NULLS FIRST",
        # found by test_random_selects_on_polars_match_duckdb: col2 is an output and a column
        "SELECT col2, CASE WHEN col0 = col2 THEN col1 ELSE 0 END AS x0, count(*) AS x1 FROM t "
        "GROUP BY col2, CASE WHEN col0 = col2 THEN col1 ELSE 0 END "
        "ORDER BY 1 NULLS FIRST, CASE WHEN col0 = col2 THEN col1 ELSE 0 END, 3",
    ],
)
def test_names_in_order_by_expressions_bind_as_in_duckdb(small: Small, sql: str) -> None:
    """``ORDER BY x`` names an output first; inside ``ORDER BY x + 0`` a column comes first."""
    same_as_duckdb(*small, sql)


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT col0 AS a, -col1 AS a FROM t ORDER BY a NULLS FIRST, 1 NULLS FIRST",
        "SELECT -col1 AS a, col2 AS a FROM t ORDER BY a DESC NULLS LAST, 1 LIMIT 6",
        "SELECT col0 AS a, -col1 AS A FROM t ORDER BY a + 0, 1 NULLS FIRST",
        "SELECT * FROM (SELECT col2 AS a, -col1 AS a FROM t3 ORDER BY a LIMIT 5) s",
        "SELECT col2 AS a, count(*) AS a FROM t GROUP BY col2 ORDER BY a, 1 NULLS FIRST",
    ],
)
def test_order_by_a_repeated_name_means_the_last_output_of_it(small: Small, sql: str) -> None:
    """As in DuckDB: ``SELECT x AS a, y AS a ... ORDER BY a`` orders by ``y``."""
    same_as_duckdb(*small, sql)


def test_a_position_never_becomes_a_constant_key(small: Small) -> None:
    cluster, _ = small
    text = explain(plan("SELECT col0 AS a, col1 AS a FROM t ORDER BY 1 LIMIT 3", cluster.catalog))
    assert "1 AS _o0" not in text


@pytest.mark.parametrize(
    "sql",
    [
        # the issue: 'Field "col1" exists 2 times in schema' from the workers
        "SELECT 51 AS col1, col1 FROM t",
        "SELECT * FROM t1 CROSS JOIN t2",
        "SELECT * FROM t1 CROSS JOIN t2 ORDER BY 1, 2, 3, 4, 5, 6 LIMIT 5",
        "SELECT 51 AS col1, col1 FROM r",
        "SELECT * FROM (SELECT 51 AS col1, col1 FROM t) s",
        "SELECT * FROM (SELECT 51 AS col1, col1, col1 FROM t3) s",
        "SELECT * FROM (SELECT 1 AS a, 2 AS a_1, 3 AS a FROM t) s",
        "SELECT * FROM (SELECT * FROM t1, t3 WHERE t1.col1 = t3.col1) s",
        "SELECT * FROM (SELECT * FROM t1, t3 WHERE t1.col1 = t3.col1) s ORDER BY 2, 1, 6 LIMIT 3",
        "WITH c AS (SELECT col1, col1 FROM t3 LIMIT 1000) SELECT * FROM c",
        "SELECT col1, count(*) AS col1 FROM t3 GROUP BY col1",
        "SELECT col2 AS x, sum(col1) AS x FROM t GROUP BY col2",
        "SELECT col0 FROM t WHERE EXISTS (SELECT col1, col1 FROM t3 WHERE t3.col2 = t.col2)",
        "SELECT * FROM t1 JOIN t3 ON t1.col2 = t3.col2",
        "SELECT s.col1 FROM (SELECT 51 AS col1, col1 FROM t3) s",
        # a derived table's repeated names as DuckDB renames them, used by the outer query
        "SELECT x_1 FROM (SELECT col1 AS x, col2 AS x FROM t3) s ORDER BY 1 NULLS FIRST",
        "SELECT * FROM (SELECT col1, col1, col2 AS COL1 FROM t) s WHERE col1_1 > 0",
        # names that differ only in case are one name
        "SELECT * FROM (SELECT o_orderkey AS A, o_custkey AS a FROM orders) s ORDER BY 1",
        "SELECT o_custkey AS Col, o_orderkey AS col FROM orders ORDER BY 2 LIMIT 3",
    ],
)
def test_repeated_output_names_keep_duckdbs_names(small: Small, sql: str) -> None:
    same_as_duckdb(*small, sql)


@pytest.mark.parametrize(
    "sql",
    [
        'SELECT count(*) FROM "ORDERS"',
        "SELECT O_ORDERKEY FROM orders ORDER BY 1 LIMIT 3",
        'SELECT o_orderkey, "straße", "STRASSE" FROM "oRdErS" WHERE strasse > 2 ORDER BY 1',
        'SELECT o.O_CUSTKEY, count(*) FROM orders o JOIN "ÄPFEL" a ON a."Äpfel" = o.o_custkey '
        "GROUP BY 1 ORDER BY 1",
        'SELECT * FROM "äpfel" ORDER BY 1',
        "SELECT * FROM Orders WHERE o_custkey IN (SELECT äpfel FROM äPFEL WHERE NAME = 'n3')",
        'SELECT O_CustKey, count(DISTINCT "Straße") FROM orders GROUP BY o_custkey',
        'WITH X AS (SELECT o_custkey AS "K", count(*) AS N FROM orders GROUP BY 1) '
        "SELECT k, n FROM x ORDER BY K",
        "SELECT * FROM (SELECT * FROM orders o1, äpfel) x ORDER BY 1, 5 LIMIT 3",
        "SELECT count(*) FROM ORDERS o JOIN T ON T.COL0 = o.O_ORDERKEY",
    ],
)
def test_names_match_as_in_duckdb(small: Small, sql: str) -> None:
    same_as_duckdb(*small, sql)


@pytest.mark.parametrize(
    ("sql", "error"),
    [
        ('SELECT * FROM "ÄPFEL2"', UnknownTableError),
        ('SELECT * FROM "STRASSE"', UnknownTableError),
        ('SELECT "STRAßE" FROM "äpfel"', UnknownColumnError),  # no such column there
        ('SELECT "äpfel" FROM "Äpfel"', UnknownColumnError),  # Ä is not ä
    ],
)
def test_names_duckdb_tells_apart_stay_apart(small: Small, sql: str, error: type) -> None:
    cluster, con = small
    with pytest.raises(duckdb.Error):
        con.sql(sql)
    with pytest.raises(error):
        plan(sql, cluster.catalog)


def test_the_plan_reads_tables_and_columns_as_the_catalog_spells_them(small: Small) -> None:
    cluster, _ = small
    stage = plan("SELECT o_custkey FROM ORDERS WHERE o_orderkey > 3", cluster.catalog).result
    assert stage.tables == ("Orders",)
    assert '"Orders"' in stage.sql and '"O_CustKey"' in stage.sql and '"O_OrderKey"' in stage.sql


def test_a_second_table_of_the_same_name_is_refused() -> None:
    import pyarrow as pa

    cluster = InMemoryCluster(nodes=1, units_per_node=1)
    rows = pa.table({"k": pa.array([1, 2, 3], pa.int64())})
    cluster.create_table("lineitem", rows, "k")
    with pytest.raises(TableExistsError):
        cluster.create_table("LINEITEM", rows.slice(0, 1), "k")
    assert cluster.sql('SELECT count(*) AS n FROM "LINEITEM"').to_pylist() == [{"n": 3}]
