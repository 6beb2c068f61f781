"""Planning grows about linearly with the size of a query, and a query nested too deeply
for the planner gets a clear error, never a RecursionError. Work is counted in function
calls (deterministic), not seconds: ``bench/planning.py`` times it."""

from __future__ import annotations

import cProfile
import pstats
from collections.abc import Callable

import duckdb
import pytest

from shardflow import UnsupportedError
from shardflow.sql import plan
from shardflow.sql.parse import MAX_NESTING
from tests.support.compare import same_as_duckdb
from tests.support.inmemory import InMemoryCluster

Small = tuple[InMemoryCluster, duckdb.DuckDBPyConnection]


def ors(n: int) -> str:
    return "SELECT * FROM t WHERE " + " OR ".join(f"col1 = {i}" for i in range(n))


def ands(n: int) -> str:
    return "SELECT * FROM t WHERE " + " AND ".join(f"col1 <> {i}" for i in range(n))


def calls_to_plan(sql: str, cluster: InMemoryCluster) -> int:
    profile = cProfile.Profile()
    profile.enable()
    try:
        plan(sql, cluster.catalog)
    finally:
        profile.disable()
    return int(pstats.Stats(profile).total_calls)  # type: ignore[attr-defined]


@pytest.mark.parametrize("terms", [ors, ands])
def test_planning_work_grows_linearly_with_or_and_and_terms(
    small: Small, terms: Callable[[int], str]
) -> None:
    cluster, _ = small
    ratio = calls_to_plan(terms(2_000), cluster) / calls_to_plan(terms(500), cluster)
    # linear work gives 4 (4x the terms); it was 7.3 for ORs (and ANDs ran out of stack)
    assert ratio < 5.5, ratio


def test_five_thousand_ors_answer_like_duckdb(small: Small) -> None:
    same_as_duckdb(*small, ors(5_000))


@pytest.mark.parametrize(
    "sql",
    [
        # rebuilt conditions keep their parentheses (the tree has no precedence of its own)
        "SELECT count(*), sum(t1.col1) FROM t1 CROSS JOIN t3 WHERE t1.col0 > 5 "
        "AND (t1.col1 > 0 OR t1.col2 IS NULL) AND t1.col1 < 40 AND t3.col0 < 9",
        "SELECT count(*) FROM t1, t3 WHERE (t1.col1 > 0 OR t1.col2 IS NULL) AND t1.col0 > 5 "
        "AND t3.col2 IS NULL AND (t3.col1 < 0 OR t3.col0 = 3 OR t3.col0 = 4)",
        "SELECT col1 FROM t WHERE col0 > 1 AND (col1 > 0 OR col2 = -43) AND col1 < 30 "
        "OR col0 = 3 AND (col2 IS NULL OR col1 = 0)",
    ],
)
def test_split_and_rebuilt_conditions_keep_their_meaning(small: Small, sql: str) -> None:
    same_as_duckdb(*small, sql)


def unions(n: int) -> str:
    return " UNION ALL ".join(f"SELECT col1 FROM t WHERE col2 = {i - 50}" for i in range(n))


def test_a_long_union_all_chain_answers_like_duckdb(small: Small) -> None:
    same_as_duckdb(*small, unions(600))


def test_planning_work_for_a_union_chain_grows_about_linearly(small: Small) -> None:
    cluster, _ = small
    ratio = calls_to_plan(unions(1_600), cluster) / calls_to_plan(unions(400), cluster)
    # 4x the branches: about 4 balanced; the left-deep chain made it over 5.5
    assert ratio < 5.5, ratio


@pytest.mark.parametrize(
    "sql",
    [
        # chains are balanced only where the operation is associative: one kind, no
        # modifiers of their own; EXCEPT and mixed ALL/DISTINCT keep their order
        "SELECT col1 FROM t UNION SELECT col2 FROM t UNION ALL SELECT col1 FROM t "
        "UNION ALL SELECT col0 FROM t UNION ALL SELECT 7",
        "SELECT col1 FROM t UNION ALL SELECT col2 FROM t UNION SELECT col1 FROM t "
        "UNION SELECT col0 FROM t UNION SELECT 7 ORDER BY 1 LIMIT 5",
        "SELECT col1 FROM t EXCEPT SELECT col2 FROM t EXCEPT SELECT 3 EXCEPT SELECT 4",
        "SELECT col1 FROM t INTERSECT SELECT col2 FROM t INTERSECT SELECT col1 FROM t "
        "UNION ALL SELECT 1 UNION ALL SELECT 2",
        "(SELECT col1 FROM t UNION ALL SELECT col2 FROM t UNION ALL SELECT 1 ORDER BY 1 LIMIT 3)"
        " UNION ALL SELECT col0 FROM t UNION ALL SELECT 9",
    ],
)
def test_rebalanced_set_operations_keep_their_meaning(small: Small, sql: str) -> None:
    same_as_duckdb(*small, sql)


def _nested(kind: str, depth: int) -> str:
    if kind == "parentheses":
        return "SELECT * FROM t WHERE " + "(" * depth + "col1 = 1" + ")" * depth
    if kind == "functions":
        return "SELECT " + "abs(" * depth + "col1" + ")" * depth + " AS x FROM t"
    if kind == "case":
        return "SELECT " + "CASE WHEN col1 > 0 THEN " * depth + "col1" + " END" * depth + " FROM t"
    if kind == "subqueries":
        return "SELECT * FROM " + "(SELECT * FROM " * depth + "t" + ") s" * depth
    assert kind == "scalar"
    return "SELECT col1, " + "(SELECT " * depth + "1" + ")" * depth + " AS x FROM t"


KINDS = ["parentheses", "functions", "case", "subqueries", "scalar"]


@pytest.mark.parametrize("kind", KINDS)
def test_nesting_up_to_the_limit_answers_like_duckdb(small: Small, kind: str) -> None:
    same_as_duckdb(*small, _nested(kind, MAX_NESTING))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("depth", [MAX_NESTING + 1, 500])
def test_deeper_nesting_is_refused_naming_the_limit(small: Small, kind: str, depth: int) -> None:
    cluster, _ = small
    with pytest.raises(UnsupportedError, match=f"{depth} levels deep; shardflow plans at most"):
        plan(_nested(kind, depth), cluster.catalog)


@pytest.mark.parametrize("operator", ["NOT ", "- "])
def test_nesting_without_brackets_is_refused_not_a_recursion_error(
    small: Small, operator: str
) -> None:
    cluster, _ = small
    with pytest.raises(UnsupportedError, match="nested too deeply"):
        plan(f"SELECT {operator * 2_000}col1 = 1 AS x FROM t", cluster.catalog)
