"""Distributed SQL on a real local Ray cluster answers what DuckDB answers."""

from __future__ import annotations

import os

import duckdb
import pytest
from hypothesis import HealthCheck, given, settings

import shardflow
from shardflow import tpch
from shardflow.config import Settings
from shardflow.tools.localcluster import descendants
from tests.cluster.conftest import listening_sockets
from tests.support.oracle import assert_same_result, query_is_ordered, sort_key_indexes
from tests.support.querygen import select_queries

pytestmark = pytest.mark.cluster


@pytest.mark.parametrize("number", tpch.QUERY_NUMBERS)
def test_tpch(number: int, db: shardflow.Database, small_oracle: duckdb.DuckDBPyConnection) -> None:
    sql = tpch.query(number)
    result = db.sql(sql)
    expected = small_oracle.sql(sql).to_arrow_table()
    assert_same_result(
        result,
        expected,
        ordered=query_is_ordered(sql),
        sort_keys=sort_key_indexes(sql, expected.column_names),
        context=f"Q{number}",
    )
    assert result.schema.names == expected.schema.names
    assert db.last_report is not None and db.last_report.stages


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(sql=select_queries())
def test_random_selects(
    sql: str, db: shardflow.Database, small_oracle: duckdb.DuckDBPyConnection
) -> None:
    expected = small_oracle.sql(sql).to_arrow_table()
    result = db.sql(sql)
    assert_same_result(result, expected, ordered=query_is_ordered(sql), context=sql)


ISSUE_QUERIES = [
    # DISTINCT after a GROUP BY on the key: one row, not one per worker
    "SELECT DISTINCT -53 FROM orders GROUP BY o_orderkey",
    # a position that points at a repeated name
    "SELECT o_orderkey AS a, o_custkey AS a FROM orders ORDER BY 1 LIMIT 3",
    # names as DuckDB matches and spells them
    "SELECT O_ORDERKEY FROM orders ORDER BY 1 LIMIT 3",
    'SELECT count(*) FROM "ORDERS"',
    'SELECT "N_Name", count(*) FROM NATION n JOIN "customer" c ON c.C_NATIONKEY = n.n_nationkey '
    "GROUP BY 1 ORDER BY 1",
    # repeated output names: distributed, replicated, joined, in a subquery
    "SELECT 51 AS o_custkey, o_custkey FROM orders WHERE o_orderkey < 100",
    "SELECT * FROM orders o1 JOIN orders o2 ON o1.o_orderkey = o2.o_orderkey "
    "WHERE o1.o_orderkey < 50",
    "SELECT * FROM nation n1 CROSS JOIN nation n2 WHERE n1.n_regionkey = 1",
    "SELECT n_name AS x, r_name AS x FROM nation, region",
    "SELECT * FROM (SELECT o_custkey AS k, o_orderkey AS k FROM orders WHERE o_orderkey < 40) s",
    "SELECT o_orderstatus AS s, count(*) AS s FROM orders GROUP BY o_orderstatus",
    # constants: DISTINCT, GROUP BY, aggregates
    "SELECT DISTINCT 83 FROM orders WHERE o_custkey IN (-43)",
    "SELECT DISTINCT 83 FROM orders WHERE o_custkey IN (1)",
    "SELECT SUM(DISTINCT 11) FROM orders",
    "SELECT DISTINCT -o_custkey AS o_orderkey, -5 FROM orders WHERE o_orderkey < 200",
    "SELECT 83, count(*) FROM lineitem GROUP BY 1",
    # outputs DuckDB names by their text ('k', CAST(k AS INTEGER)), not after a column
    "SELECT k, sum(v0) AS x0, count(DISTINCT v0) AS x2, 83, 'k' FROM (SELECT l_quantity AS v0, "
    "l_orderkey AS k FROM lineitem) AS d GROUP BY k ORDER BY k, 2, 3, 4, 5 LIMIT 20",
    "SELECT 'o_custkey', CAST(o_orderkey AS INTEGER), o_orderkey FROM orders "
    "ORDER BY o_custkey, o_orderkey LIMIT 20",
    # run as written over gathered tables: an aggregate of the outer query inside a
    # subquery; DISTINCT ordered by what it does not select
    "SELECT EXISTS(SELECT 1 FROM nation WHERE n_nationkey > min(o.o_custkey)) AS e FROM orders o",
    "SELECT DISTINCT o_orderstatus FROM orders ORDER BY o_orderstatus, o_orderkey",
    # many terms
    "SELECT count(*) FROM orders WHERE " + " OR ".join(f"o_custkey = {i}" for i in range(5000)),
]


@pytest.mark.parametrize("sql", ISSUE_QUERIES)
def test_issue_queries_answer_like_duckdb(
    sql: str, db: shardflow.Database, small_oracle: duckdb.DuckDBPyConnection
) -> None:
    expected = small_oracle.sql(sql).to_arrow_table()
    result = db.sql(sql)
    assert_same_result(
        result,
        expected,
        ordered=query_is_ordered(sql),
        sort_keys=sort_key_indexes(sql, expected.column_names),
        context=sql[:300],
    )
    assert result.schema.names == expected.schema.names


def test_text_only_duckdb_parses_is_answered(
    db: shardflow.Database, small_oracle: duckdb.DuckDBPyConnection
) -> None:
    sql = "SELECT finalize(sum(o_totalprice) EXPORT_STATE) AS s FROM orders"
    assert db.sql(sql).to_pylist() == small_oracle.sql(sql).to_arrow_table().to_pylist()


def test_a_stage_the_workers_refuse_is_answered_as_written(
    db: shardflow.Database,
    small_oracle: duckdb.DuckDBPyConnection,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import dataclasses

    from shardflow.runtime.query import planning as queries

    sql = "SELECT o_orderstatus, count(*) AS n FROM orders GROUP BY 1 ORDER BY 1 /* refused */"

    def faulty_plan(text: str, catalog: object) -> object:  # fault hook: a planner bug
        planned = real_plan(text, catalog)
        broken = [dataclasses.replace(s, sql="SELECT nosuch FROM orders") for s in planned.stages]
        return dataclasses.replace(planned, stages=tuple(broken))

    real_plan = queries.plan
    monkeypatch.setattr(queries, "plan", faulty_plan)
    assert db.sql(sql).to_pylist() == small_oracle.sql(sql).to_arrow_table().to_pylist()
    assert "runs as written over the gathered tables" in db.explain(sql)  # kept with the plan


def test_too_deep_a_nesting_is_a_clear_error(db: shardflow.Database) -> None:
    with pytest.raises(shardflow.UnsupportedError, match="500 levels deep"):
        db.sql("SELECT * FROM orders WHERE " + "(" * 500 + "o_orderkey = 1" + ")" * 500)


def test_a_table_named_like_another_is_refused(db: shardflow.Database) -> None:
    import pyarrow as pa

    with pytest.raises(shardflow.TableExistsError):
        db.create_table("ORDERS", pa.table({"k": [1]}), replicated=True)
    assert db.sql('SELECT count(*) AS n FROM "Orders"').to_pylist() == [{"n": 150_000}]


def test_db_sql_changes_tables_as_the_service_does(
    db: shardflow.Database, small_oracle: duckdb.DuckDBPyConnection
) -> None:
    """One statement path for every door: db.sql runs CREATE TABLE ... AS, INSERT INTO ...
    SELECT | VALUES (with or without a column list; its answer is the rows appended),
    UPDATE and DELETE (the answer is the rows changed), TRUNCATE (distributed and
    replicated tables; the answer is the rows emptied) and DROP
    TABLE [IF EXISTS], with parameters; what it refuses says what it runs."""
    made = "SELECT o_orderkey AS k, o_totalprice AS p FROM orders WHERE o_orderkey < 1000"
    assert db.sql(f"CREATE TABLE cheap AS {made}").num_rows == 0
    added = db.sql(
        "INSERT INTO cheap (k, p) VALUES (?, ?), (?, ?)", [5_000_001, 1.5, 5_000_002, 2.5]
    )
    assert added.to_pylist() == [{"count": 2}]
    more = "SELECT o_orderkey + 10000000, o_totalprice FROM orders WHERE o_orderkey < 100"
    copied = db.sql(f"INSERT INTO cheap {more}").to_pylist()[0]["count"]
    expected = small_oracle.execute(
        f"SELECT count(*) AS n, sum(p) AS s FROM ({made} UNION ALL "
        f"SELECT 5000001, 1.5 UNION ALL SELECT 5000002, 2.5 UNION ALL "
        f"SELECT o_orderkey + 10000000, o_totalprice FROM orders WHERE o_orderkey < 100)"
    ).fetchall()[0]
    got = db.sql("SELECT count(*) AS n, sum(p) AS s FROM cheap").to_pylist()[0]
    assert copied == small_oracle.execute(f"SELECT count(*) FROM ({more})").fetchall()[0][0]
    assert got["n"] == expected[0] and float(got["s"]) == pytest.approx(float(expected[1]))
    # UPDATE and DELETE: the answer is the rows changed, the rows are as DuckDB has them
    updated = small_oracle.execute(f"SELECT count(*) FROM ({made}) WHERE k < 500").fetchall()[0]
    assert db.sql("UPDATE cheap SET p = p * 2 WHERE k < ?", [500]).to_pylist() == [
        {"count": updated[0]}
    ]
    assert db.sql("DELETE FROM cheap WHERE k >= 10000000").to_pylist() == [{"count": copied}]
    moved = small_oracle.execute(f"SELECT count(*) FROM ({made}) WHERE k < 100").fetchall()[0][0]
    assert db.sql("UPDATE cheap SET k = k + 20000000 WHERE k < 100").to_pylist() == [
        {"count": moved}
    ]  # of the key, if the table is distributed by it: the rows move to their new shards
    assert db.sql("SELECT k FROM cheap WHERE k = 20000001").to_pylist() == [{"k": 20000001}]
    db.sql("UPDATE cheap SET k = k - 20000000 WHERE k >= 20000000")
    expected = small_oracle.execute(
        f"SELECT count(*) AS n, sum(CASE WHEN k < 500 THEN p * 2 ELSE p END) AS s FROM "
        f"({made} UNION ALL SELECT 5000001, 1.5 UNION ALL SELECT 5000002, 2.5)"
    ).fetchall()[0]
    got = db.sql("SELECT count(*) AS n, sum(p) AS s FROM cheap").to_pylist()[0]
    assert got["n"] == expected[0] and float(got["s"]) == pytest.approx(float(expected[1]))
    replicated = small_oracle.execute("SELECT count(*) FROM nation").fetchall()[0][0]
    db.create_table("few", db.sql("SELECT * FROM nation"), replicated=True)
    for table, held in (("cheap", expected[0]), ("few", replicated)):
        assert db.sql(f"TRUNCATE TABLE {table}").to_pylist() == [{"count": held}]
        assert db.sql(f"SELECT count(*) AS n FROM {table}").to_pylist() == [{"n": 0}]
    db.sql("INSERT INTO cheap VALUES (?, ?)", [7, 0.5])  # the emptied table takes rows again
    db.sql("WITH n AS (SELECT * FROM nation) INSERT INTO few SELECT * FROM n WHERE n_nationkey < 2")
    db.sql("INSERT INTO few WITH n AS (SELECT * FROM nation) SELECT * FROM n WHERE n_nationkey = 2")
    joined = "SELECT count(*) AS n, sum(p) AS s FROM cheap JOIN few ON k - 7 = n_nationkey"
    assert db.sql(joined).to_pylist() == [{"n": 1, "s": 0.5}]
    # rows chosen by another table, and a correlated subquery (a replicated table changed
    # by what a distributed one holds; its copy goes to the shard that changes)
    changed = "UPDATE few SET n_comment = c.p::VARCHAR FROM cheap AS c WHERE c.k - 7 = n_nationkey"
    assert db.sql(changed).to_pylist() == [{"count": 1}]
    gone = "DELETE FROM few WHERE NOT EXISTS (SELECT 1 FROM cheap WHERE k - 7 = n_nationkey)"
    assert db.sql(gone).to_pylist() == [{"count": 2}]
    assert db.sql("SELECT n_nationkey, n_comment FROM few").to_pylist() == [
        {"n_nationkey": 0, "n_comment": "0.50"}  # p is a DECIMAL(15, 2)
    ]
    db.sql("DROP TABLE few")
    db.sql("DROP TABLE cheap")
    db.sql("DROP TABLE IF EXISTS cheap")
    assert "cheap" not in db.table_names()
    with pytest.raises(shardflow.UnknownTableError):
        db.sql("DROP TABLE cheap")
    with pytest.raises(shardflow.QueryError, match="a column list alone has no rows"):
        db.sql("CREATE TABLE empty (a INTEGER)")
    returned = db.sql("DELETE FROM orders WHERE o_orderkey = -1 RETURNING o_orderkey AS k")
    assert returned.num_rows == 0 and returned.column_names == ["k"]
    with pytest.raises(shardflow.QueryError, match="one table at a time"):
        db.sql("TRUNCATE orders, lineitem")
    with pytest.raises(shardflow.UnknownTableError):
        db.sql("TRUNCATE no_such_table")
    with pytest.raises(shardflow.SqlSyntaxError, match="LINE 1: TRUNCATE TABLE"):
        db.sql("TRUNCATE TABLE")  # DuckDB's own message, pointing at the mistake
    with pytest.raises(shardflow.QueryError, match="cannot read this TRUNCATE statement"):
        db.sql("TRUNCATE orders WHERE o_orderkey = 1")
    with pytest.raises(shardflow.QueryError, match="one statement at a time"):
        db.sql("INSERT INTO orders SELECT * FROM orders; DROP TABLE orders")
    assert db.sql("SELECT count(*) AS n FROM orders").to_pylist() == [{"n": 150_000}]


def test_explain_says_where_each_part_runs(db: shardflow.Database) -> None:
    text = db.explain(tpch.query(13))
    assert "on every worker, over its shards" in text
    assert "on one worker" in text
    assert "LEFT OUTER JOIN __sf_t1" in text


def test_tables_nodes_and_shards_report_what_is_where(db: shardflow.Database) -> None:
    tables = {row["name"]: row for row in db.tables().to_pylist()}
    assert tables["lineitem"]["kind"] == "distributed"
    assert tables["lineitem"]["distributed_by"] == "l_orderkey"
    assert tables["lineitem"]["colocation_group"] == tables["orders"]["colocation_group"]
    assert tables["nation"]["kind"] == "replicated" and tables["nation"]["rows"] == 25
    assert tables["nation"]["shards"] == 4  # its copies, one a worker, as cluster shards lists
    per_worker = Settings().shards_per_worker  # the fixture's cluster has the defaults
    assert tables["orders"]["rows"] == 150_000 and tables["orders"]["shards"] == 4 * per_worker

    nodes = db.cluster.nodes()
    assert sorted(n.node_id for n in nodes) == [f"node-{i}" for i in range(4)]
    assert all(n.alive and n.vendor == "cpu" and n.engine == "duckdb" for n in nodes)
    assert all(n.shards == 2 * per_worker for n in nodes)  # lineitem's and orders' units

    shards = db.cluster.shards().to_pylist()
    lineitem = [s for s in shards if s["table"] == "lineitem"]
    orders = [s for s in shards if s["table"] == "orders"]
    assert sum(s["rows"] for s in lineitem) == db.sql("SELECT count(*) FROM lineitem")[0][0].as_py()
    # co-location: equal bucket ranges of lineitem and orders are on the same node
    placed = {(s["bucket_lo"], s["bucket_hi"]): s["node"] for s in orders}
    assert all(placed[(s["bucket_lo"], s["bucket_hi"])] == s["node"] for s in lineitem)
    assert sum(1 for s in shards if s["kind"] == "replica" and s["table"] == "nation") == 4


def test_nothing_listens_beyond_loopback(db: shardflow.Database, sockets_before: set[str]) -> None:
    db.sql("SELECT count(*) FROM orders")
    new = listening_sockets() - sockets_before
    assert new, "the cluster should listen on some loopback ports"
    for address in new:
        host = address.rsplit(":", 1)[0]
        assert host in ("127.0.0.1", "[::ffff:127.0.0.1]", "[::1]"), address


def test_embedded_cluster_starts_no_ray_api_server(db: shardflow.Database) -> None:
    """Start-up on a small machine is processes starting: nothing asks Ray's API server
    (its dashboard process) anything, so an embedded cluster does not start it."""
    commands = []
    for pid in descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                commands.append(cmdline.read().replace(b"\0", b" ").decode())
        except OSError:
            continue
    assert any("raylet" in c for c in commands), commands  # the processes were found
    assert not [c for c in commands if "dashboard/dashboard.py" in c]


def test_profile_says_where_the_time_went(db: shardflow.Database) -> None:
    result, profile = db.profile(tpch.query(13))
    assert result.equals(db.sql(tpch.query(13)))
    assert [s.strategy for s in profile.stages] == ["pushdown", "replicated"]
    scan, finish = profile.stages
    assert sorted(f.worker for f in scan.fragments) == [f"node-{i}" for i in range(4)]
    for fragment in scan.fragments:
        assert fragment.engine == "duckdb" and fragment.device.startswith("cpu")
        assert fragment.rows_in > 0 and fragment.bytes_in > fragment.bytes_out > 0
        assert fragment.submitted_at <= fragment.started_at + 0.01  # one machine, one clock
        assert profile.started_at <= fragment.started_at <= fragment.finished_at
    assert sum(f.rows_out for f in scan.fragments) == scan.rows
    assert len(finish.fragments) == 1 and finish.rows == result.num_rows
    assert profile.seconds >= sum(s.finished_at - s.started_at for s in profile.stages) * 0.99
    assert profile.text().count("node-") == 5
    page = profile.html()
    assert page.count('class="lane"') == 5  # four workers and the client
