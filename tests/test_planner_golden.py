"""Planner rules, case by case: each ``golden/NAME.sql`` is planned against the in-memory
cluster's catalog and must (1) explain as ``golden/NAME.plan`` says and (2) answer what
DuckDB answers on the same data. Set SHARDFLOW_UPDATE_GOLDEN=1 to rewrite the .plan files
after a deliberate planner change (then review the diff)."""

from __future__ import annotations

import os
from pathlib import Path

import duckdb
import pytest

from shardflow.engine import DuckDBEngine
from shardflow.runtime.query.executor import execute
from shardflow.sql import explain, plan
from tests.support.inmemory import InMemoryCluster
from tests.support.oracle import assert_same_result, query_is_ordered

GOLDEN = Path(__file__).parent / "golden"
CASES = sorted(p.stem for p in GOLDEN.glob("*.sql"))


@pytest.mark.parametrize("case", CASES)
def test_plan_matches_golden(case: str, inmemory: InMemoryCluster) -> None:
    sql = (GOLDEN / f"{case}.sql").read_text()
    rendered = explain(plan(sql, inmemory.catalog)) + "\n"
    expected_path = GOLDEN / f"{case}.plan"
    if os.environ.get("SHARDFLOW_UPDATE_GOLDEN") == "1":
        expected_path.write_text(rendered)
    assert expected_path.exists(), f"no golden plan for {case}; run with SHARDFLOW_UPDATE_GOLDEN=1"
    assert rendered == expected_path.read_text()


@pytest.mark.parametrize("case", CASES)
def test_plan_answers_like_duckdb(
    case: str, inmemory: InMemoryCluster, tiny_oracle: duckdb.DuckDBPyConnection
) -> None:
    sql = (GOLDEN / f"{case}.sql").read_text()
    result, _ = execute(plan(sql, inmemory.catalog), inmemory, DuckDBEngine(threads=1))
    expected = tiny_oracle.sql(sql).to_arrow_table()
    assert_same_result(
        result, expected, ordered=query_is_ordered(sql), check_names=False, context=case
    )
    assert expected.num_rows > 0, f"{case} should exercise data, not an empty answer"
