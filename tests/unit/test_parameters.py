"""Query parameters bind as literals through SQLGlot, checked against DuckDB's own binding
of the same parameters."""

from __future__ import annotations

import datetime
import decimal
import doctest

import duckdb
import pytest

from shardflow.errors import QueryError, SqlSyntaxError
from shardflow.sql import parameters
from shardflow.sql.parameters import bind
from shardflow.sql.shapes import shape_of

VALUES = [
    7, -2.5, "it's; DROP TABLE t --", None, True, decimal.Decimal("12.50"),
    datetime.date(2024, 2, 29), datetime.datetime(2024, 2, 29, 13, 5, 1), b"\x00\xff",
]  # fmt: skip


def test_docstring_examples_run() -> None:
    assert doctest.testmod(parameters).failed == 0


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_a_bound_value_is_what_duckdb_binds(value: object) -> None:
    con = duckdb.connect()
    ours = con.sql(bind("SELECT ? AS v", [value])).fetchall()
    theirs = con.execute("SELECT ? AS v", [value]).fetchall()
    assert ours == theirs


def test_numbered_placeholders_may_repeat_and_come_in_any_order() -> None:
    con = duckdb.connect()
    query = "SELECT $2 || '-' || $1 AS a, $1 AS b, $2 AS c"
    assert con.sql(bind(query, ["x", "y"])).fetchall() == con.execute(query, ["x", "y"]).fetchall()


def test_a_string_is_a_value_never_sql() -> None:
    con = duckdb.connect()
    con.execute("CREATE TABLE t AS SELECT 1 AS id")
    with pytest.raises(duckdb.ConversionException):  # compared as a value: not an integer
        con.sql(bind("SELECT count(*) FROM t WHERE id = ?", ["1 OR 1=1"])).fetchall()
    text = bind("SELECT ? AS v", ["'); DROP TABLE t; --"])
    assert con.sql(text).fetchall() == [("'); DROP TABLE t; --",)]
    assert con.sql("SELECT count(*) FROM t").fetchall() == [(1,)]


@pytest.mark.parametrize(
    ("query", "params", "message"),
    [
        ("SELECT ?, ?", [1], "parameter 2 is not bound"),
        ("SELECT ?", [1, 2], "no placeholder for parameter 2"),
        ("SELECT $3", [1, 2, 3], "no placeholder for parameter 1"),
        ("SELECT ?", {"a": 1}, "a list or tuple"),
        ("SELECT ?", "ab", "a list or tuple"),
        ("SELECT ?", [object()], "parameter 1 is a object"),
    ],
)
def test_bad_parameters_are_refused_with_what_is_wrong(
    query: str, params: object, message: str
) -> None:
    with pytest.raises(QueryError, match=message):
        bind(query, params)  # type: ignore[arg-type]


def test_malformed_sql_is_a_syntax_error() -> None:
    with pytest.raises(SqlSyntaxError):
        bind("SELEC ? FROM", [1])


def test_a_value_never_joins_the_token_before_it() -> None:
    con = duckdb.connect()
    assert con.sql(bind("SELECT 5 -? AS v, ?AS w", [-2, 3])).fetchall() == [(7, 3)]


def test_a_query_text_is_parsed_once_and_its_bindings_share_a_shape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    query = "SELECT * FROM t WHERE k = ? AND d < ? AND s IN (?, ?)"
    day = datetime.date(2024, 1, 1)
    first = bind(query, [1, day, "a", "b"])
    parses: list[str] = []
    original = parameters.sqlglot.parse_one
    monkeypatch.setattr(
        parameters.sqlglot, "parse_one", lambda sql, **kw: parses.append(sql) or original(sql, **kw)
    )
    second = bind(query, [2, day + datetime.timedelta(days=1), "it's", "c"])
    assert parses == []
    a, b = shape_of(first), shape_of(second)
    assert a is not None and b is not None
    assert a.key == b.key and len(a.values) == 4 and a.values != b.values
