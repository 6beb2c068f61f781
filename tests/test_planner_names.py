"""Names as DuckDB has them: tables and columns matched by DuckDB's rule wherever they are
written. Each query is answered by the in-memory cluster and compared with DuckDB, names
included."""

from __future__ import annotations

import duckdb
import pytest

from shardflow import TableExistsError, UnknownColumnError, UnknownTableError
from shardflow.sql import plan
from tests.support.compare import same_as_duckdb
from tests.support.inmemory import InMemoryCluster

Small = tuple[InMemoryCluster, duckdb.DuckDBPyConnection]


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
