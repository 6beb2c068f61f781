"""The plan that is right for any query DuckDB answers (``gather_plan``): every table the
text names is gathered whole and the query runs as written. The session falls back to it
when the planner cannot read a query, or DuckDB refuses a stage the planner made."""

from __future__ import annotations

import duckdb
import pyarrow as pa
import pytest

from shardflow.runtime.executor import execute
from shardflow.sql import gather_plan
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
