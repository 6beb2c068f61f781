"""Self-tests for tests/support (result comparator and random query generator). No Ray."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from datetime import date
from decimal import Decimal
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest
import sqlglot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.oracle import (
    assert_same_result,
    cells_equal,
    order_insensitive_within_ties,
    query_is_ordered,
    sort_key_indexes,
)
from tests.support.querygen import (
    SHAPES,
    labelled_select_queries,
    select_queries,
    sql_strategy_names,
)

TPCH_TABLES = ("customer", "lineitem", "nation", "orders", "part", "partsupp", "region", "supplier")


def _t(**cols: list[object]) -> pa.Table:
    return pa.table(cols)


# --------------------------------------------------------------------------------------
# comparator


def test_unordered_accepts_reordered_rows() -> None:
    a = _t(k=[1, 2, 3, None], v=["x", "y", "z", "w"])
    e = _t(k=[None, 3, 1, 2], v=["w", "z", "x", "y"])
    assert_same_result(a, e, ordered=False)
    with pytest.raises(AssertionError, match="ordered comparison"):
        assert_same_result(a, e, ordered=True)


def test_rejects_one_cell_difference() -> None:
    a = _t(k=[1, 2, 3], v=["x", "y", "z"])
    e = _t(k=[1, 2, 3], v=["x", "y", "Z"])
    for ordered in (False, True):
        with pytest.raises(AssertionError) as err:
            assert_same_result(a, e, ordered=ordered, context="Q-cell")
        msg = str(err.value)
        assert "Q-cell" in msg and "first differing row" in msg and "'Z'" in msg


def test_rejects_numeric_difference_hidden_by_sort_key_rounding() -> None:
    # equal to 9 significant digits (the sort key), different beyond the tolerance
    a = _t(v=[Decimal("1.0000000001"), Decimal("2.0")])
    e = _t(v=[Decimal("1.0000000002"), Decimal("2.0")])
    with pytest.raises(AssertionError):
        assert_same_result(a, e, ordered=False)
    with pytest.raises(AssertionError):
        assert_same_result(_t(v=[1.0, 2.0]), _t(v=[1.001, 2.0]), ordered=False)


def test_float_vs_decimal_and_hugeint_vs_bigint() -> None:
    a = _t(s=[1 / 3, 2.5000000000001, 7.0], n=pa.array([10, 20, 30], pa.decimal128(38, 0)))
    e = _t(
        s=pa.array(
            [Decimal("0.33333333333"), Decimal("2.50"), Decimal("7")], pa.decimal128(15, 11)
        ),
        n=pa.array([10, 20, 30], pa.int64()),
    )
    assert_same_result(a, e, ordered=True)
    assert_same_result(a, e, ordered=False)
    with pytest.raises(AssertionError):
        assert_same_result(a, _t(s=[1 / 3, 2.5, 7.1], n=[10, 20, 30]), ordered=False)
    with pytest.raises(AssertionError):  # exact types compare exactly
        assert_same_result(_t(n=[Decimal("1.01")]), _t(n=[1]), ordered=False)


def test_rejects_row_and_column_count_and_names() -> None:
    a = _t(k=[1, 2, 3])
    with pytest.raises(AssertionError, match="row count differs: 3 != 4"):
        assert_same_result(a, _t(k=[1, 2, 3, 3]), ordered=False)
    with pytest.raises(AssertionError, match="row count"):
        assert_same_result(a, _t(k=[1, 2]), ordered=True)
    with pytest.raises(AssertionError, match="column count"):
        assert_same_result(a, _t(k=[1, 2, 3], j=[1, 2, 3]), ordered=False)
    with pytest.raises(AssertionError, match="column names"):
        assert_same_result(a, _t(K=[1, 2, 3]), ordered=False)
    assert_same_result(a, _t(K=[3, 2, 1]), ordered=False, check_names=False)


def test_duplicates_are_a_multiset() -> None:
    with pytest.raises(AssertionError):
        assert_same_result(_t(k=[1, 1, 2]), _t(k=[1, 2, 2]), ordered=False)


def test_cells_none_nan_types() -> None:
    assert cells_equal(None, None)
    assert not cells_equal(None, 0)
    assert not cells_equal(0.0, None)
    assert cells_equal(float("nan"), float("nan"))
    assert not cells_equal(float("nan"), 1.0)
    assert cells_equal(float("inf"), float("inf"))
    assert not cells_equal(float("inf"), float("-inf"))
    assert not cells_equal(True, 1)
    assert not cells_equal("1", 1)
    assert cells_equal(date(1995, 3, 15), date(1995, 3, 15))
    assert not cells_equal(date(1995, 3, 15), date(1995, 3, 16))
    assert cells_equal(1e-9, 0)  # abs_tol
    assert cells_equal(Decimal("2.50"), Decimal("2.5"))
    nan_tab = _t(v=[float("nan"), None, 1.0])
    assert_same_result(nan_tab, _t(v=[None, 1.0, float("nan")]), ordered=False)
    with pytest.raises(AssertionError):
        assert_same_result(nan_tab, _t(v=[float("nan"), float("nan"), 1.0]), ordered=False)


def test_mixed_types_in_sort_key() -> None:
    a = _t(v=pa.array([1.5, None, 2.0], pa.float64()), s=["b", None, "a"])
    e = _t(
        v=pa.array([Decimal("2.0"), Decimal("1.5"), None], pa.decimal128(5, 1)), s=["a", "b", None]
    )
    assert_same_result(a, e, ordered=False)


def test_string_encodings_compare_as_values() -> None:
    a = pa.table({"s": pa.array(["b", "a", None]).dictionary_encode()})
    assert_same_result(
        a, pa.table({"s": pa.array(["a", None, "b"], pa.large_string())}), ordered=False
    )
    with pytest.raises(AssertionError):
        assert_same_result(a, pa.table({"s": ["a", None, "c"]}), ordered=False)


def test_sort_keys_allow_any_order_within_ties() -> None:
    # ORDER BY k: rows tying on k may come in any order, but the runs must stay in place
    e = _t(k=[1, 1, 1, 2, 3, 3], v=["a", "b", "c", "d", "e", "f"])
    a = _t(k=[1, 1, 1, 2, 3, 3], v=["c", "a", "b", "d", "f", "e"])
    with pytest.raises(AssertionError):
        assert_same_result(a, e, ordered=True)
    assert_same_result(a, e, ordered=True, sort_keys=[0])
    order_insensitive_within_ties(a, e, [0])
    bad = _t(k=[1, 1, 1, 2, 3, 3], v=["c", "a", "d", "b", "f", "e"])  # d moved across runs
    with pytest.raises(AssertionError, match="tied on sort keys"):
        order_insensitive_within_ties(bad, e, [0])
    wrong_order = _t(k=[2, 1, 1, 1, 3, 3], v=["d", "a", "b", "c", "e", "f"])
    with pytest.raises(AssertionError):
        order_insensitive_within_ties(wrong_order, e, [0])
    # tolerance applies to the key columns too
    order_insensitive_within_ties(
        _t(k=[0.1 + 0.2, 0.3], v=["y", "x"]), _t(k=[0.3, 0.3], v=["x", "y"]), [0]
    )
    with pytest.raises(ValueError):
        order_insensitive_within_ties(a, e, [5])


def test_error_message_is_readable() -> None:
    a = _t(k=list(range(10)), v=[str(i) for i in range(10)])
    e = _t(k=list(range(10)), v=[str(i) for i in range(9)] + ["nine"])
    with pytest.raises(AssertionError) as err:
        assert_same_result(a, e, ordered=True, context="TPC-H Q9")
    msg = str(err.value)
    assert msg.startswith("context: TPC-H Q9")
    assert "first differing row 9" in msg
    assert "(9, '9')" in msg and "(9, 'nine')" in msg
    assert "10 rows x 2 cols" in msg
    assert "expected (first rows" in msg and "... 5 more" in msg


def test_accepts_record_batch_reader() -> None:
    t = _t(k=[1, 2])
    assert_same_result(pa.RecordBatchReader.from_batches(t.schema, t.to_batches()), t, ordered=True)


@pytest.mark.parametrize(
    ("sql", "expected"),
    [
        ("SELECT a FROM t", False),
        ("SELECT a FROM t ORDER BY a", True),
        ("SELECT a FROM t ORDER BY a DESC LIMIT 5", True),
        ("SELECT * FROM (SELECT a FROM t ORDER BY a LIMIT 3) AS d", False),
        ("SELECT a FROM t WHERE a IN (SELECT b FROM u ORDER BY b LIMIT 3)", False),
        ("WITH x AS (SELECT a FROM t ORDER BY a) SELECT a FROM x", False),
        ("WITH x AS (SELECT a FROM t) SELECT a FROM x ORDER BY 1", True),
        ("SELECT a FROM t UNION ALL SELECT b FROM u ORDER BY 1", True),
        ("SELECT a FROM t UNION ALL (SELECT b FROM u ORDER BY 1)", False),
        ("(SELECT a FROM t ORDER BY a)", True),
    ],
)
def test_query_is_ordered(sql: str, expected: bool) -> None:
    assert query_is_ordered(sql) is expected


def test_sort_key_indexes() -> None:
    names = ["l_returnflag", "x0", "x1"]
    sql = (
        "SELECT l_returnflag, sum(l_quantity) AS x0, count(*) AS x1 FROM lineitem "
        "GROUP BY 1 ORDER BY x1 DESC, 1, sum(l_quantity)"
    )
    assert sort_key_indexes(sql, names) == [2, 0, 1]
    assert sort_key_indexes("SELECT a, b FROM t ORDER BY b, c, a", ["a", "b"]) == [1]
    assert sort_key_indexes("SELECT a, b FROM t", ["a", "b"]) == []


# --------------------------------------------------------------------------------------
# query generator against DuckDB at SF 0.01


def _tpchgen() -> str:
    exe = Path(sys.executable).with_name("tpchgen-cli")
    if exe.exists():
        return str(exe)
    found = shutil.which("tpchgen-cli")
    if found is None:
        pytest.skip("tpchgen-cli not found")
    return found


@pytest.fixture(scope="session")
def tpch_sf001_con(tmp_path_factory: pytest.TempPathFactory) -> Iterator[duckdb.DuckDBPyConnection]:
    out = tmp_path_factory.mktemp("tpch_sf001_selfcheck")
    subprocess.run(
        [_tpchgen(), "parquet", "-s", "0.01", "-o", str(out)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    con = duckdb.connect()
    for t in TPCH_TABLES:
        path = str(out / f"{t}.parquet").replace("'", "''")
        con.execute(f"CREATE TABLE {t} AS SELECT * FROM read_parquet('{path}')")
    yield con
    con.close()


def _check_query(con: duckdb.DuckDBPyConnection, sql: str) -> pa.Table:
    sqlglot.parse_one(sql, dialect="duckdb")
    first = con.sql(sql).to_arrow_table()
    second = con.sql(sql).to_arrow_table()
    assert_same_result(second, first, ordered=query_is_ordered(sql), context=sql)
    return first


@settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(sql=select_queries())
def test_generated_queries_run_on_duckdb(
    tpch_sf001_con: duckdb.DuckDBPyConnection, sql: str
) -> None:
    _check_query(tpch_sf001_con, sql)


@pytest.mark.parametrize("shape", SHAPES)
def test_every_shape_runs(tpch_sf001_con: duckdb.DuckDBPyConnection, shape: str) -> None:
    seen: list[str] = []

    @settings(
        max_examples=6,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(pair=labelled_select_queries([shape]))
    def run(pair: tuple[str, str]) -> None:
        got_shape, sql = pair
        assert got_shape == shape
        _check_query(tpch_sf001_con, sql)
        seen.append(sql)

    run()
    assert seen


@settings(max_examples=200, deadline=None, database=None)
@given(data=st.data())
def test_limit_always_has_full_order_by(data: st.DataObject) -> None:
    sql = data.draw(select_queries())
    tree = sqlglot.parse_one(sql, dialect="duckdb")
    for node in tree.find_all(sqlglot.exp.Select):
        if node.args.get("limit") is None and node.args.get("offset") is None:
            continue
        order = node.args.get("order")
        assert order is not None, sql
        assert len(order.expressions) >= len(node.expressions), sql
    # joins always carry an equi-join condition, cross joins excepted
    for join in tree.find_all(sqlglot.exp.Join):
        cross = (join.args.get("kind") or "").upper() == "CROSS"
        assert cross or join.args.get("on") is not None or " WHERE " in sql.upper(), sql
    lowered = sql.lower()
    assert "random(" not in lowered and "now(" not in lowered, sql


def test_shape_names() -> None:
    names = sql_strategy_names()
    assert names == SHAPES
    for required in (
        "scan",
        "group_by",
        "global_agg",
        "top_n",
        "join",
        "distinct",
        "in_subquery",
        "exists_subquery",
        "scalar_subquery",
        "derived_table",
        "cross_join",
        "correlated_subquery",
        "names",
    ):
        assert required in names
    with pytest.raises(ValueError):
        select_queries(["no_such_shape"])


_ROW = st.tuples(
    st.none() | st.integers(-3, 3),
    st.none() | st.integers(-300, 300).map(lambda c: Decimal(c).scaleb(-2)),
    st.none() | st.sampled_from(["a", "b", "c"]),
)


def _table(rows: list[tuple[object, ...]]) -> pa.Table:
    cols = list(zip(*rows, strict=True)) if rows else [(), (), ()]
    return pa.table(
        {
            "i": pa.array(cols[0], pa.int64()),
            "d": pa.array(cols[1], pa.decimal128(10, 2)),
            "s": pa.array(cols[2], pa.string()),
        }
    )


@settings(max_examples=150, deadline=None, database=None)
@given(rows=st.lists(_ROW, max_size=25), data=st.data())
def test_comparator_properties(rows: list[tuple[object, ...]], data: st.DataObject) -> None:
    expected = _table(rows)
    perm = data.draw(st.permutations(range(len(rows))))
    shuffled = [rows[i] for i in perm]
    actual = _table(shuffled)
    assert_same_result(actual, expected, ordered=False)
    # engine-side type differences: DOUBLE for DECIMAL, DECIMAL(38,0) for BIGINT
    retyped = actual.set_column(1, "d", actual.column(1).cast(pa.float64()))
    retyped = retyped.set_column(0, "i", retyped.column(0).cast(pa.decimal128(38, 0)))
    assert_same_result(retyped, expected, ordered=False)

    # ORDER BY i: shuffling only within runs of equal i is accepted with sort_keys=[0]
    def by_i(r: tuple[object, ...]) -> tuple[bool, object]:
        return (r[0] is None, r[0] if r[0] is not None else 0)

    ordered_rows = sorted(rows, key=by_i)
    within = sorted(shuffled, key=by_i)  # stable: ties keep the shuffled order
    order_insensitive_within_ties(_table(within), _table(ordered_rows), [0])

    if not rows:
        return
    # any single-cell change is detected, in every mode
    r = data.draw(st.integers(0, len(rows) - 1))
    c = data.draw(st.integers(0, 2))
    old = shuffled[r][c]
    new: object
    if old is None:
        new = (0, Decimal("0.01"), "a")[c]
    elif c == 2:
        new = "z" if data.draw(st.booleans()) else None
    elif old == 0:
        new = None
    else:
        new = old + (1 if c == 0 else Decimal("0.01"))  # type: ignore[operator]
    changed = list(shuffled)
    changed[r] = tuple(new if k == c else v for k, v in enumerate(changed[r]))
    with pytest.raises(AssertionError):
        assert_same_result(_table(changed), expected, ordered=False)
    changed_retyped = _table(changed)
    changed_retyped = changed_retyped.set_column(
        1, "d", changed_retyped.column(1).cast(pa.float64())
    )
    with pytest.raises(AssertionError):
        assert_same_result(changed_retyped, expected, ordered=False)


def _commit(repo: Path, version: str, message: str) -> str:
    (repo / "pyproject.toml").write_text(f'[project]\nname = "x"\nversion = "{version}"\n')
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t",
                    "commit", "-qm", message], check=True)  # fmt: skip
    done = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return done.stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_previous_release_is_the_commit_that_set_its_version(tmp_path: Path) -> None:
    """Without tags, the release before is the commit that set its version in pyproject.toml
    (the oldest of those that changed that line), not a later one; with the tag, the tag."""
    from tests.support.releases import NoRelease, previous_release

    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "CHANGELOG.md").write_text("# Changelog\n\n## Unreleased\n\n## 0.2.0\n\n## 0.1.0\n")
    _commit(repo, "0.1.0", "first")
    released = _commit(repo, "0.2.0", "release 0.2.0")
    _commit(repo, "0.3.0.dev0", "after it")
    assert previous_release(repo) == ("0.2.0", released)
    subprocess.run(["git", "-C", str(repo), "tag", "v0.2.0", "HEAD~2"], check=True)
    assert previous_release(repo)[1] != released  # the tag wins where there is one
    bare = tmp_path / "bare"  # a checkout without the history (its files alone)
    bare.mkdir()
    (bare / "CHANGELOG.md").write_text("## 0.2.0\n")
    with pytest.raises(NoRelease, match=r"no tag v0\.2\.0"):
        previous_release(bare)
