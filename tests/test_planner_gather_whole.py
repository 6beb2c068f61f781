"""The plan that is right for any query DuckDB answers (``gather_plan``): every table the
text names is gathered whole and the query runs as written. The session falls back to it
when the planner cannot read a query, or DuckDB refuses a stage the planner made."""

from __future__ import annotations

import dataclasses

import duckdb
import pyarrow as pa
import pytest

from shardflow.engine import DuckDBEngine
from shardflow.errors import (
    QueryError,
    StageRefused,
    UnknownTableError,
    UnreadableSql,
    UnsupportedError,
)
from shardflow.runtime.query.executor import execute
from shardflow.runtime.query.planning import Binder, PlannedQuery, answer, plan_query
from shardflow.sql import explain, gather_plan, plan
from shardflow.sql.parse import parse
from shardflow.sql.planner import check_stage_groups
from tests.support.inmemory import InMemoryCluster


@pytest.fixture(scope="module")
def cluster() -> tuple[InMemoryCluster, duckdb.DuckDBPyConnection]:
    trades = pa.table(
        {"sym": ["a", "a", "b", "b", "a"], "t": [1, 5, 2, 7, 9], "px": [1.0, 2, 3, 4, 5]}
    )
    quotes = pa.table({"sym": ["a", "b", "a", "b"], "t": [0, 1, 4, 6], "bid": [10.0, 20, 30, 40]})
    syms = pa.table({"sym": ["a", "b"], "name": ["Alpha", "Beta"]})
    memory = InMemoryCluster()
    memory.create_table("trades", trades, distributed_by="t")
    memory.create_table("Quotes", quotes, distributed_by="sym")
    memory.create_table("syms", syms, replicated=True)
    oracle = duckdb.connect()
    for name, table in (("trades", trades), ("Quotes", quotes), ("syms", syms)):
        oracle.register(name, table)
    return memory, oracle


@pytest.mark.parametrize(
    "sql",
    [
        # ASOF, POSITIONAL and named windows: the distributed planner does not take them apart
        "SELECT t.sym, t.t, q.bid FROM trades t ASOF JOIN quotes q ON t.sym = q.sym AND t.t >= q.t"
        " ORDER BY t.t",
        "SELECT x.t, y.sym FROM (SELECT t FROM trades ORDER BY t) x "
        "POSITIONAL JOIN (SELECT sym FROM QUOTES ORDER BY t) y ORDER BY 1 NULLS LAST",
        "SELECT sym, t, sum(px) OVER w AS run FROM trades WINDOW w AS (PARTITION BY sym ORDER BY t)"
        " ORDER BY sym, t",
        "SELECT s.name, count(*) FROM trades JOIN syms s USING (sym) GROUP BY ALL ORDER BY 1",
    ],
)
def test_a_query_gathered_whole_answers_as_duckdb(
    cluster: tuple[InMemoryCluster, duckdb.DuckDBPyConnection], sql: str
) -> None:
    memory, oracle = cluster
    planned = gather_plan(sql, memory.catalog, "test")
    answer, _ = execute(planned, memory, memory.engine)
    expected = oracle.sql(sql).to_arrow_table()
    assert answer.to_pylist() == expected.to_pylist()


def test_only_the_tables_the_text_names_are_gathered(
    cluster: tuple[InMemoryCluster, duckdb.DuckDBPyConnection],
) -> None:
    memory, _ = cluster
    planned = gather_plan("SELECT * FROM QUOTES q, Syms", memory.catalog, "test")
    assert [(s.output, s.placement) for s in planned.stages[:-1]] == [
        ("Quotes", "shards"),
        ("syms", "worker"),
    ]
    assert planned.result.sql == "SELECT * FROM QUOTES q, Syms"
    assert planned.result.inputs == ("Quotes", "syms")


def _bound(memory: InMemoryCluster, sql: str) -> PlannedQuery:
    return plan_query(sql, memory.catalog, Binder(DuckDBEngine(threads=1)))


@pytest.mark.parametrize(
    ("sql", "error", "match"),
    [
        # a command DuckDB reads is no query, whatever the parser makes of it
        (
            "COPY (SELECT finalize(sum(t) EXPORT_STATE) FROM trades) TO 'x.csv'",
            UnsupportedError,
            "cannot read",
        ),
        ("SELECT finalize(sum(t) EXPORT_STATE) FROM nosuch", UnknownTableError, "nosuch"),
        ("SELECT finalize(sum(rowid) EXPORT_STATE) FROM trades", UnsupportedError, "rowid"),
    ],
)
def test_text_only_duckdb_reads_is_still_checked(
    cluster: tuple[InMemoryCluster, duckdb.DuckDBPyConnection],
    sql: str,
    error: type[Exception],
    match: str,
) -> None:
    memory, _ = cluster
    with pytest.raises(error, match=match):
        _bound(memory, sql)


def test_a_stage_duckdb_refuses_falls_back_to_running_the_query_as_written(
    cluster: tuple[InMemoryCluster, duckdb.DuckDBPyConnection],
) -> None:
    memory, oracle = cluster
    sql = "SELECT sym, count(*) AS n FROM trades GROUP BY sym ORDER BY sym"
    planned = _bound(memory, sql)
    assert planned.plan.result.sql != sql  # distributed
    # fault: the planner wrote a stage DuckDB cannot bind
    broken = [dataclasses.replace(s, sql="SELECT nosuch FROM trades") for s in planned.plan.stages]
    faulty = dataclasses.replace(
        planned, plan=dataclasses.replace(planned.plan, stages=tuple(broken))
    )
    result, _, answered = answer(sql, faulty, memory.catalog, memory, memory.engine)
    assert answered.plan.result.sql == sql  # gathered whole, for the caller to keep
    assert result.to_pylist() == oracle.sql(sql).to_arrow_table().to_pylist()
    # a query run as written that DuckDB refuses is the query's error, not another fallback
    bad = "SELECT nosuch FROM trades"
    whole = dataclasses.replace(planned, plan=gather_plan(bad, memory.catalog, "test"))
    with pytest.raises(QueryError, match="nosuch") as refused:
        answer(bad, whole, memory.catalog, memory, memory.engine)
    assert not isinstance(refused.value, StageRefused)


def test_a_query_needing_duckdbs_table_statistics_is_unsupported(
    cluster: tuple[InMemoryCluster, duckdb.DuckDBPyConnection],
) -> None:
    memory, oracle = cluster
    with pytest.raises(UnsupportedError, match="statistics"):
        memory.sql("SELECT bitstring_agg(t) FROM trades")
    sql = "SELECT bit_count(bitstring_agg(t, 1, 9)) AS n FROM trades"  # given: it runs
    assert memory.sql(sql).to_pylist() == oracle.sql(sql).to_arrow_table().to_pylist()


@pytest.mark.parametrize(
    "sql",
    [
        # text DuckDB parses and SQLGlot does not: it runs as written, not refused
        "SELECT sym, finalize(sum(px) EXPORT_STATE) AS s FROM trades GROUP BY sym ORDER BY sym",
        "SELECT finalize(count(*) EXPORT_STATE) AS n FROM trades JOIN quotes USING (sym)",
        # an aggregate of the outer query's columns only, inside a subquery, aggregates the
        # outer query: one row, not one per outer row
        "SELECT EXISTS(SELECT 1 FROM quotes WHERE quotes.t > min(tr.t)) AS e FROM trades tr",
        "SELECT (SELECT max(tr.px) + count(*) FROM syms) AS m FROM trades tr",
        "SELECT CASE WHEN 9 IN (SELECT max(tr.t)) THEN 1 END AS c FROM trades tr",
        # DuckDB keeps one row per distinct selection, ordered by a value of it
        "SELECT DISTINCT sym FROM trades ORDER BY sym, t",
        # modifiers after the brackets belong to the brackets
        "(SELECT t FROM trades) ORDER BY t DESC LIMIT 2",
        # DuckDB's bare VALUES query
        "(VALUES (1, 3), (2, 4))",
    ],
)
def test_queries_a_split_would_misread_run_as_written(
    cluster: tuple[InMemoryCluster, duckdb.DuckDBPyConnection], sql: str
) -> None:
    memory, oracle = cluster
    planned = _bound(memory, sql)
    assert planned.plan.result.sql == sql, explain(planned.plan)
    assert memory.sql(sql).to_pylist() == oracle.sql(sql).to_arrow_table().to_pylist()


def test_export_state_is_text_only_duckdb_reads() -> None:
    with pytest.raises(UnreadableSql):
        parse("SELECT finalize(count(*) EXPORT_STATE) AS n FROM trades")


def test_a_subquerys_own_aggregates_are_still_distributed(
    cluster: tuple[InMemoryCluster, duckdb.DuckDBPyConnection],
) -> None:
    memory, oracle = cluster
    sql = "SELECT sym, (SELECT max(q.bid) FROM quotes q WHERE q.sym = tr.sym) AS b FROM trades tr"
    planned = _bound(memory, sql)
    assert planned.plan.result.sql != sql, explain(planned.plan)
    assert sorted(memory.sql(sql).to_pylist(), key=str) == sorted(
        oracle.sql(sql).to_arrow_table().to_pylist(), key=str
    )


def test_a_comment_after_the_last_semicolon_is_not_a_second_statement(
    cluster: tuple[InMemoryCluster, duckdb.DuckDBPyConnection],
) -> None:
    memory, _ = cluster
    assert memory.sql("SELECT count(*) AS n FROM trades; -- all of them").to_pylist() == [{"n": 5}]
    with pytest.raises(UnsupportedError, match="one statement at a time"):
        memory.sql("SELECT 1; SELECT 2")


TOP_N_OVER_CTES = """
WITH cte1 AS (
    SELECT struct_pack(ff := c) AS s1, t1.a AS p FROM t3 JOIN t1 USING (c)
), cte2 AS (
    SELECT cte1.s1, struct_pack(fff := cte1.p) AS s2
    FROM cte1 JOIN t2 AS t22 ON cte1.p = t22.a LEFT JOIN t2 ON t22.b = t2.a
), cte3 AS (SELECT cte2.* FROM cte2 ORDER BY s1, s2)
SELECT * FROM cte3 LIMIT 1
"""


def test_a_shard_stage_reads_only_tables_cut_like_its_group() -> None:
    # seen: a CTE settled into an earlier stage stayed in the last one, which then bound
    # t1 with t2's unit ids; the workers answered "moved" until the query timed out. The
    # planner's choice there follows the (random) group ids: plan over several catalogs.
    for _ in range(24):
        memory = InMemoryCluster()
        memory.create_table("t3", pa.table({"c": ["19", "21", "22", "23"]}), distributed_by="c")
        t2 = pa.table({"a": ["3", "5", "8", "11"], "b": ["8", None, None, None]})
        memory.create_table("t2", t2, distributed_by="a")
        t1 = pa.table({"a": ["2", "3", "11", "5"], "c": ["22", "21", "19", "23"]})
        memory.create_table("t1", t1, distributed_by="a")
        planned = plan(TOP_N_OVER_CTES, memory.catalog)
        for stage in planned.stages:
            for name in stage.tables:
                assert memory.catalog.table(name).group == stage.group, explain(planned)
    # a plan that breaks the rule is the planner's fault: refused, so it runs as written
    wrong = dataclasses.replace(planned.stages[-1], tables=("t1", "t2", "t3"))
    with pytest.raises(QueryError, match="another table's group"):
        check_stage_groups([wrong], memory.catalog)
