"""Query parameters: ``?`` placeholders (in order) and ``$1``, ``$2`` ... (by number)
replaced by literals through SQLGlot, so that a value is only ever a value, never SQL.

>>> bind("SELECT * FROM t WHERE id = ? AND s = ?", [5, "it's"])
"SELECT * FROM t WHERE id = 5 AND s = 'it''s'"
>>> bind("SELECT $1 + $1 AS twice", [21])
'SELECT 21 + 21 AS twice'
"""

from __future__ import annotations

import datetime
import decimal
from collections.abc import Sequence
from typing import Any

import sqlglot
from sqlglot import exp

from shardflow.errors import QueryError, SqlSyntaxError

VALUE_TYPES = (
    type(None), bool, int, float, decimal.Decimal, str, bytes, datetime.date, datetime.datetime,
)  # fmt: skip
"""What a parameter may be (a datetime is also a date)."""


def bind(query: str, params: Sequence[Any]) -> str:
    """``query`` with its placeholders replaced by ``params`` as literals."""
    try:
        statement = sqlglot.parse_one(query, read="duckdb")
    except sqlglot.errors.ParseError as error:
        raise SqlSyntaxError(str(error).splitlines()[0]) from None
    return bind_parsed(statement, params)


def bind_parsed(statement: exp.Expr, params: Sequence[Any]) -> str:
    """:func:`bind` for a statement parsed already (a prepared statement's)."""
    if isinstance(params, str | bytes) or not isinstance(params, Sequence):
        raise QueryError(f"query parameters are a list or tuple, not {type(params).__name__}")
    for position, value in enumerate(params):
        if not isinstance(value, VALUE_TYPES):
            raise QueryError(
                f"parameter {position + 1} is a {type(value).__name__}; a parameter is a "
                "number, string, bytes, bool, date, datetime, Decimal or None"
            )
    bound = statement.copy()
    used: set[int] = set()
    for position, node in enumerate(list(bound.find_all(exp.Placeholder, bfs=False))):
        index = int(node.name) - 1 if node.name and node.name.isdigit() else position
        if not 0 <= index < len(params):
            raise QueryError(f"parameter {index + 1} is not bound ({len(params)} given)")
        used.add(index)
        node.replace(exp.convert(params[index]))
    unused = sorted(set(range(len(params))) - used)
    if unused:
        raise QueryError(
            f"{len(params)} parameter(s) given, but the query has no placeholder for "
            f"parameter {unused[0] + 1}"
        )
    return str(bound.sql("duckdb"))
