"""The Polars engine (the GPU path's engine, run here on the CPU) answers like DuckDB: every
TPC-H fragment and random SELECTs run through it over partitioned data, and what it cannot
run falls back to DuckDB, saying so."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, example, given, settings

from shardflow import tpch
from shardflow.catalog.types import storage_schema
from shardflow.engine import DuckDBEngine
from shardflow.engine.polars_engine import PolarsEngine
from shardflow.runtime.query.executor import execute
from shardflow.sql import plan
from tests.support.inmemory import InMemoryCluster
from tests.support.oracle import assert_same_result, query_is_ordered, sort_key_indexes
from tests.support.querygen import select_queries

pytest.importorskip("polars")
CLIENT = DuckDBEngine(threads=1)
FALLS_BACK: dict[int, str] = {}
"""TPC-H queries with a fragment Polars cannot run (it runs on DuckDB, counted and shown)."""


@pytest.fixture(scope="module")
def tiny_tables(tpch_tiny: Path) -> dict[str, pa.Table]:
    """The tiny TPC-H tables as shardflow stores them."""
    tables = {}
    for layout in tpch.LAYOUT:
        table = pq.read_table(tpch_tiny / f"{layout.name}.parquet")
        tables[layout.name] = table.cast(storage_schema(table.schema))
    return tables


@pytest.fixture(scope="module")
def polars_cluster(tiny_tables: dict[str, pa.Table]) -> tuple[InMemoryCluster, PolarsEngine]:
    engine = PolarsEngine(DuckDBEngine(threads=1))
    cluster = InMemoryCluster(nodes=3, units_per_node=2, engine=engine)
    for layout in tpch.LAYOUT:
        cluster.create_table(
            layout.name,
            tiny_tables[layout.name],
            layout.distributed_by,
            layout.colocate_with,
            layout.replicated,
        )
    return cluster, engine


def assert_tpch_answer(number: int, result: pa.Table, oracle: duckdb.DuckDBPyConnection) -> None:
    sql = tpch.query(number)
    expected = oracle.sql(sql).to_arrow_table()
    assert_same_result(
        result,
        expected,
        ordered=query_is_ordered(sql),
        check_names=False,
        sort_keys=sort_key_indexes(sql, expected.column_names),
        context=f"Q{number}",
    )


@pytest.mark.parametrize("number", tpch.QUERY_NUMBERS)
def test_every_tpch_fragment_runs_on_polars(
    number: int,
    polars_cluster: tuple[InMemoryCluster, PolarsEngine],
    tiny_oracle: duckdb.DuckDBPyConnection,
) -> None:
    cluster, engine = polars_cluster
    before = sum(engine.fallbacks.values())
    result, _ = execute(plan(tpch.query(number), cluster.catalog), cluster, CLIENT)
    assert_tpch_answer(number, result, tiny_oracle)
    if number not in FALLS_BACK:
        assert sum(engine.fallbacks.values()) == before, engine.last_fallback  # Polars ran it


def test_what_polars_cannot_run_falls_back_to_duckdb_and_says_so() -> None:
    engine = PolarsEngine(DuckDBEngine(threads=1))
    result = engine.run("SELECT regexp_extract('abc123', '[0-9]+') AS digits, 42 AS n")
    assert result.to_pylist() == [{"digits": "123", "n": 42}]
    assert engine.fallbacks["duckdb"] == 1 and engine.fell_back == "duckdb"
    assert engine.last_fallback.startswith("fell back to duckdb")
    assert engine.run("SELECT 1 AS one").to_pylist() == [{"one": 1}]
    assert engine.fell_back == ""  # per call: the last one ran on Polars


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(sql=select_queries())
@example(  # found by this test: date - date is a duration in Polars, days in DuckDB
    sql="SELECT DISTINCT l_shipdate - l_commitdate AS x0 FROM lineitem "
    "WHERE l_orderkey BETWEEN 1 AND 301"
)
@example(  # found by this test: Polars folded min(-2) to -2 over no rows (DuckDB: NULL)
    sql="SELECT min(-2) AS x0, sum(3) AS x1, count(*) AS n FROM lineitem WHERE l_suppkey < 0"
)
def test_random_selects_on_polars_match_duckdb(
    sql: str,
    polars_cluster: tuple[InMemoryCluster, PolarsEngine],
    tiny_oracle: duckdb.DuckDBPyConnection,
) -> None:
    cluster, _ = polars_cluster
    result, _ = execute(plan(sql, cluster.catalog), cluster, CLIENT)
    expected = tiny_oracle.sql(sql).to_arrow_table()
    assert_same_result(
        result, expected, ordered=query_is_ordered(sql), check_names=False, context=sql
    )


def test_polars_gets_only_the_columns_and_tables_a_query_reads() -> None:
    import pyarrow as pa

    engine = PolarsEngine(DuckDBEngine(threads=1))
    t = pa.table({"a": [1, 2, 3], "b": ["x", "y", "z"], "c": [1.5, 2.5, 3.5]})
    other = pa.table({"z": [1]})
    tables = {"t": t, "other": other}
    assert engine.run("SELECT count(*) AS n FROM t", tables).to_pylist() == [{"n": 3}]
    assert engine.run("SELECT 1 AS one FROM t", tables).num_rows == 3  # rows, no columns
    assert engine.run("SELECT * FROM t WHERE a > 2", tables).to_pylist() == [
        {"a": 3, "b": "z", "c": 3.5}
    ]
    assert engine.run("SELECT sum(c) AS s FROM t WHERE b <> 'x'", tables).to_pylist() == [
        {"s": 6.0}
    ]
    assert sum(engine.fallbacks.values()) == 0, engine.last_fallback


def test_decimal_arithmetic_and_literals_answer_like_duckdb() -> None:
    """Polars 1 rounds a decimal product to the larger operand's scale, divides decimals as
    decimals and reads 0.05 as a float; the rewrite keeps DuckDB's answers and types."""
    from decimal import Decimal

    import pyarrow as pa

    money = pa.decimal128(15, 2)
    t = pa.table(
        {
            "price": pa.array([Decimal("10.55"), Decimal("3.33"), Decimal("7.01")], money),
            "discount": pa.array([Decimal("0.05"), Decimal("0.07"), Decimal("0.08")], money),
            "n": pa.array([3, 4, 5], pa.int64()),
            "day": pa.array([10_000, 10_500, 11_000], pa.int32()).cast(pa.date32()),
        }
    )
    engine = PolarsEngine(DuckDBEngine(threads=1))
    queries = [
        "SELECT price * (1 - discount) AS x, price * (1 - discount) * (1 + discount) AS y FROM t",
        "SELECT sum(price * discount) AS s, sum(price) / sum(discount) AS r FROM t",
        "SELECT n / 2 AS half, price / n AS per, price * 0.5 AS p, -price * discount AS m FROM t",
        "SELECT count(*) AS c FROM t WHERE discount BETWEEN 0.06 - 0.01 AND 0.06 + 0.01",
        "SELECT 100.00 * sum(price * discount) / sum(price) AS pct FROM t",
        "SELECT count(*) AS c FROM t WHERE day >= DATE '1997-06-01' AND day < DATE '2000-01-01'",
    ]
    for sql in queries:
        expected = DuckDBEngine(threads=1).run(sql, {"t": t})
        got = engine.run(sql, {"t": t})
        assert engine.fell_back == "", (sql, engine.last_fallback)
        assert got.schema.equals(expected.schema), (sql, got.schema, expected.schema)
        assert got.to_pylist() == expected.to_pylist(), sql


def test_a_rounded_decimal_is_refused_not_returned() -> None:
    from decimal import Decimal

    import pyarrow as pa

    from shardflow.engine.polars_engine import conform

    rounded = pa.table({"x": pa.array([Decimal("10.02")], pa.decimal128(38, 2))})
    with pytest.raises(ValueError, match="rounded"):
        conform(rounded, pa.schema([("x", pa.decimal128(38, 4))]))
    narrower = conform(rounded, pa.schema([("y", pa.decimal128(12, 2))]))  # DuckDB's name
    assert narrower.schema == pa.schema([("y", pa.decimal128(12, 2))])
    assert narrower.to_pylist() == [{"y": Decimal("10.02")}]


def test_the_gpu_engine_without_its_gpu_runs_on_polars_cpu_and_says_so() -> None:
    """What an NVIDIA node does when cudf-polars cannot run a fragment: the GPU collect
    raises, the same plan runs on Polars' CPU engine, and the fallback is counted."""
    from shardflow.telemetry.devices import installed

    if installed("cudf_polars"):
        pytest.skip("cudf-polars is installed: the GPU engine would run")
    import pyarrow as pa

    engine = PolarsEngine(DuckDBEngine(threads=1), gpu=True)
    assert engine.name == "polars-gpu"
    t = pa.table({"k": [1, 1, 2], "v": [1.0, 2.0, 3.0]})
    result = engine.run("SELECT k, sum(v) AS s FROM t GROUP BY k ORDER BY k", {"t": t})
    assert result.to_pylist() == [{"k": 1, "s": 3.0}, {"k": 2, "s": 3.0}]
    assert engine.fell_back == "cpu" and engine.fallbacks == {"cpu": 1}
    assert "GPU engine" in engine.last_fallback and "cudf" in engine.last_fallback


GPU_REFUSES = ("strptime", "offset_by", "HCONCAT", "(?s)")
"""What Polars makes of SQL that cudf-polars refuses or gets wrong, seen on an H200: a date
literal parsed with a cached strptime ("a CPU feature"), date arithmetic with an interval
(offset_by), a scalar subquery joined back as a one-row horizontal concat (padded with nulls
on the GPU, so TPC-H Q11 found no rows), and LIKE as a dot-all regex (which libcudf's regex
refuses)."""


def test_like_patterns_reach_polars_without_a_dot_all_regex() -> None:
    import pyarrow as pa

    words = ["PROMO BRUSHED", "forest green", "forest\ngreen tin", "MEDIUM POLISHED", "50% off"]
    t = pa.table({"s": pa.array([*words, None]), "n": pa.array(range(6), pa.int64())})
    engine = PolarsEngine(DuckDBEngine(threads=1))
    patterns = {  # True: rewritten for the GPU; False: stays as it is
        "PROMO%": True,
        "%green": True,
        "%green%": True,
        "forest%green%": True,
        "%Customer%Complaints%": True,
        "f_rest%": True,
        "%.%": True,
        "50\\%%": False,  # a backslash: left alone
        "forest%n": False,  # would need an end anchor
        "%": True,
    }
    for pattern, rewritten in patterns.items():
        for sql in (
            f"SELECT n FROM t WHERE s LIKE '{pattern}' ORDER BY n",
            f"SELECT n FROM t WHERE s NOT LIKE '{pattern}' ORDER BY n",
            f"SELECT n, s LIKE '{pattern}' AS hit FROM t ORDER BY n",
        ):
            expected = DuckDBEngine(threads=1).run(sql, {"t": t})
            got = engine.run(sql, {"t": t})
            assert got.to_pylist() == expected.to_pylist(), sql
            assert ("(?s)" not in engine.explain(sql, {"t": t})) == rewritten, sql


def test_date_constants_fold_into_date_literals() -> None:
    import pyarrow as pa

    days = pa.array([-400, 0, 9_000, 9_500, 10_000, 10_471, 10_472, 11_000], pa.int32())
    t = pa.table({"d": days.cast(pa.date32()), "n": pa.array(range(8), pa.int64())})
    engine = PolarsEngine(DuckDBEngine(threads=1))
    queries = [
        "SELECT count(*) AS c FROM t WHERE d <= DATE '1998-12-01' - INTERVAL 90 DAY",
        "SELECT count(*) AS c FROM t WHERE d <= DATE '1998-12-01' - INTERVAL '90' DAY",
        "SELECT n FROM t WHERE d >= DATE '1994-01-01'"
        " AND d < DATE '1994-01-01' + INTERVAL '1' YEAR",
        "SELECT n FROM t WHERE d < INTERVAL '3' MONTH + DATE '1996-01-31'",  # Apr 30
        "SELECT n FROM t WHERE d >= DATE '1995-01-31' + INTERVAL 1 MONTH",  # Feb 28
        "SELECT n FROM t WHERE d > DATE '1970-01-05' - INTERVAL 2 WEEK",  # before 1970
        "SELECT n, DATE '1998-12-01' - INTERVAL 3 DAY AS due FROM t WHERE n < 2",
    ]
    for sql in queries:
        expected = DuckDBEngine(threads=1).run(sql, {"t": t})
        assert not any(word in engine.explain(sql, {"t": t}) for word in GPU_REFUSES), sql
        got = engine.run(sql, {"t": t})
        assert engine.fell_back == "", (sql, engine.last_fallback)
        assert got.to_pylist() == expected.to_pylist(), sql


def test_a_long_decimal_literal_keeps_every_digit() -> None:
    """Polars reads 12345678901234567.12 as a float (…567.68); the text is cast instead."""
    from decimal import Decimal

    import pyarrow as pa

    t = pa.table({"x": pa.array([Decimal("0.01")], pa.decimal128(15, 2))})
    sql = "SELECT x + 12345678901234567.12 AS y FROM t WHERE x < 12345678901234567.12"
    got = PolarsEngine(DuckDBEngine(threads=1)).run(sql, {"t": t})
    assert got.to_pylist() == [{"y": Decimal("12345678901234567.13")}]


def test_uncorrelated_scalar_subqueries_run_first() -> None:
    from decimal import Decimal

    import pyarrow as pa

    money = pa.decimal128(15, 2)
    t = pa.table(
        {
            "k": pa.array([1, 1, 2, 3, 3, 3], pa.int64()),
            "v": pa.array(
                [Decimal(x) for x in ("1.50", "2.25", "9.00", "0.10", "4.00", "1.00")], money
            ),
            "s": pa.array(["a", "b", "c", "a", "b", "c"]),
            "m": pa.array([1, None, 2, 2, 1, 1], pa.int64()),
        }
    )
    tables = {"t": t}
    engine = PolarsEngine(DuckDBEngine(threads=1))
    queries = {  # the shapes of TPC-H Q11 (HAVING), Q15 (a CTE) and Q22 (in a derived table)
        "SELECT k, sum(v) AS total FROM t GROUP BY k "
        "HAVING sum(v) > (SELECT sum(v) * 0.25 FROM t) ORDER BY k": True,
        "WITH per AS (SELECT k, sum(v) AS total FROM t GROUP BY k) "
        "SELECT k FROM per WHERE total = (SELECT max(total) FROM per)": True,
        "SELECT count(*) AS c FROM (SELECT v FROM t WHERE v > (SELECT avg(v) FROM t)) AS big": True,
        "SELECT s FROM t WHERE s = (SELECT max(s) FROM t WHERE k = 3) ORDER BY s": True,
        "SELECT k FROM t WHERE v > (SELECT max(v) FROM t WHERE k > 5)": True,  # NULL: no rows
        "SELECT s, k FROM t WHERE k IN (SELECT k FROM t WHERE v > 3) ORDER BY s, k": True,
        "SELECT count(*) AS c FROM t WHERE k NOT IN (SELECT k FROM t WHERE v > 100)": True,
        "SELECT count(*) AS c FROM t WHERE s IN (SELECT s FROM t WHERE k = 3)": True,
        # a NULL among an IN subquery's values: NOT IN is never true; it stays as it is
        "SELECT count(*) AS c FROM t WHERE k NOT IN (SELECT m FROM t)": False,
        # correlated: the subquery names the outer row, and stays where it is
        "SELECT k, v FROM t AS o"
        " WHERE v > (SELECT avg(v) FROM t WHERE t.k = o.k) ORDER BY k": False,
    }
    for sql, folded in queries.items():
        expected = DuckDBEngine(threads=1).run(sql, tables)
        if folded:
            assert "HCONCAT" not in engine.explain(sql, tables), sql
        got = engine.run(sql, tables)
        assert got.to_pylist() == expected.to_pylist(), sql


@pytest.mark.parametrize("number", tpch.QUERY_NUMBERS)
def test_whole_tpch_queries_reach_polars_in_a_form_the_gpu_engine_takes(
    number: int, tiny_tables: dict[str, pa.Table], tiny_oracle: duckdb.DuckDBPyConnection
) -> None:
    tables = dict(tiny_tables)
    engine = PolarsEngine(DuckDBEngine(threads=1))
    sql = tpch.query(number)
    assert_tpch_answer(number, engine.run(sql, tables), tiny_oracle)
    if engine.fell_back:  # Polars' SQL front end refused it: DuckDB answered (counted)
        return
    plan = engine.explain(sql, tables)
    refused = [word for word in GPU_REFUSES if word in plan]
    assert not refused, f"Q{number} reaches Polars with {refused}"


def test_correlated_aggregates_and_left_join_filters_run_on_polars_as_duckdb_answers() -> None:
    """What Polars' SQL front end refused is written so it takes it, the answers DuckDB's:
    a correlated scalar aggregate (TPC-H Q2, Q17) joined to its query, a left join's
    condition on its joined table taken into that table (Q13). What the rewrites must not
    touch (a correlated count, a condition on the left table) still answers as DuckDB."""
    t = pa.table({"k": [1, 1, 2, 3, 3, 4], "v": [1.0, 2.0, 9.0, 0.5, 4.0, None]})
    u = pa.table({"k": [1, 2, 2, 5], "w": [5.0, 1.0, 3.0, 2.0], "c": ["x", "yz", "x", "x"]})
    tables = {"t": t, "u": u}
    runs_on_polars = [
        "SELECT t.k, t.v FROM t, u WHERE t.k = u.k AND t.v < (SELECT max(w) FROM u"
        " WHERE u.k = t.k) ORDER BY t.k, t.v",
        "SELECT k, v FROM t WHERE v > (SELECT 0.5 * avg(v) FROM t AS i WHERE i.k = t.k)"
        " ORDER BY k, v",
        "SELECT t.k, count(u.w) AS n FROM t LEFT JOIN u ON t.k = u.k AND u.c NOT LIKE '%z%'"
        " GROUP BY t.k ORDER BY t.k",
    ]
    answers_only = [
        "SELECT k FROM t WHERE 0 = (SELECT count(*) FROM u WHERE u.k = t.k) ORDER BY k",
        "SELECT t.k, count(u.w) AS n FROM t LEFT JOIN u ON t.k = u.k AND t.v > 1"
        " GROUP BY t.k ORDER BY t.k",
    ]
    for sql in [*runs_on_polars, *answers_only]:
        engine = PolarsEngine(DuckDBEngine(threads=1))
        expected = DuckDBEngine(threads=1).run(sql, tables)
        assert engine.run(sql, tables).to_pylist() == expected.to_pylist(), sql
        if sql in runs_on_polars:
            assert not engine.fallbacks, (sql, engine.last_fallback)


def test_the_gpu_bench_runs_its_resident_path_on_the_cpu(tmp_path: Path) -> None:
    """``bench/gpu.py --resident --cpu``: the path the device run takes, over frames kept in
    Polars' memory, with its last line as the device run prints it."""
    bench = Path(__file__).resolve().parents[1] / "bench" / "gpu.py"
    args = ["--sf", "0.01", "--cpu", "--resident", "--repeat", "1", "--queries", "1,2,13,17"]
    done = subprocess.run(
        [sys.executable, str(bench), *args, "--home", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    last = done.stdout.strip().splitlines()[-1]
    pattern = r"gpu_ratio_warm=[\d.]+ gpu_ratio_cold=[\d.]+ answers_equal=(\d+)/4 fallbacks=(\d+) "
    match = re.fullmatch(pattern + r"cache_build_s=[\d.]+", last)
    assert match is not None, done.stdout
    assert match.groups() == ("4", "0"), done.stdout
