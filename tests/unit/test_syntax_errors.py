"""Syntax errors point at the mistake: DuckDB's parser judges DuckDB's syntax (its message
names the token, the line, and puts a caret under it); where SQLGlot stops on text DuckDB
reads, the error is UnsupportedError with SQLGlot's line and column."""

from __future__ import annotations

import pytest
import sqlglot
from sqlglot.errors import ParseError

import shardflow
from shardflow.sql.parse import parse, syntax_error


@pytest.mark.parametrize(
    ("sql", "near", "line", "caret"),
    [
        ("SELEC * FROM t", "SELEC", "LINE 1: SELEC * FROM t", "        ^^^^^"),
        ("SELECT *\nFROM t\nWHERE a = = 1", "=", "LINE 3: WHERE a = = 1", "                  ^"),
        ('SELECT "a FROM t', None, 'LINE 1: SELECT "a FROM t', "               ^"),
        (
            "SELECT * FROM t WHERE (a = 1",
            "1",
            "LINE 1: SELECT * FROM t WHERE (a = 1",
            " " * 35 + "^",
        ),
    ],
)
def test_a_syntax_error_names_the_line_and_points_at_the_token(
    sql: str, near: str | None, line: str, caret: str
) -> None:
    with pytest.raises(shardflow.SqlSyntaxError) as raised:
        parse(sql)
    message = str(raised.value)
    if near is not None:
        assert f'syntax error at or near "{near}"' in message
    lines = message.splitlines()
    at = next(i for i, text in enumerate(lines) if text.startswith(line))
    assert lines[at + 1] == caret
    assert "sqlglot" not in message and "Required keyword" not in message


def test_text_duckdb_reads_but_sqlglot_does_not_is_unsupported_with_its_position() -> None:
    with pytest.raises(ParseError) as stopped:
        sqlglot.parse_one("SELECT 1 +\n  2 * FROM t", read="duckdb")
    # the error of one text shown under another that DuckDB reads: what a user meets when
    # SQLGlot lacks a piece of DuckDB's grammar
    error = syntax_error("SELECT 1 +\n  2 * 3 FROM t", stopped.value)
    assert isinstance(error, shardflow.UnsupportedError)
    text = str(error)
    assert "though DuckDB can" in text and "(line 2, column" in text
    assert text.splitlines()[-2] == "    2 * 3 FROM t"
    assert text.splitlines()[-1].strip().startswith("^")
