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
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import sqlglot
from sqlglot import exp
from sqlglot.tokenizer_core import TokenType

from shardflow.errors import QueryError, SqlSyntaxError
from shardflow.sql.parse import tokenize

VALUE_TYPES = (
    type(None), bool, int, float, decimal.Decimal, str, bytes, datetime.date, datetime.datetime,
)  # fmt: skip
"""What a parameter may be (a datetime is also a date)."""


def bind(query: str, params: Sequence[Any]) -> str:
    """``query`` with its placeholders replaced by ``params`` as literals. A query text
    is parsed once (a syntax error is raised here); after that its placeholders are found
    by its tokens, so a repeated query is not parsed again (its plan is kept by shape)."""
    _check_values(params)
    spans = _placeholders(query)
    if spans is None:  # a named placeholder ($name): bound through the parsed tree
        return bind_parsed(_parse(query), params)
    used: set[int] = set()
    pieces, last = [], 0
    for position, (start, end, number) in enumerate(spans):
        index = number - 1 if number is not None else position
        if not 0 <= index < len(params):
            raise QueryError(f"parameter {index + 1} is not bound ({len(params)} given)")
        used.add(index)
        pieces += [query[last:start], _spaced(query, start, end, _literal(params[index]))]
        last = end + 1
    _check_all_used(params, used)
    return "".join(pieces) + query[last:]


_CHECKED: OrderedDict[str, tuple[tuple[int, int, int | None], ...] | None] = OrderedDict()
_CHECKED_SIZE = 1024
_CHECKED_LOCK = threading.Lock()


def _placeholders(query: str) -> tuple[tuple[int, int, int | None], ...] | None:
    """Each placeholder of ``query``: (start, end, its number for ``$n``), from the tokens
    of a query text parsed once; None when one is named."""
    with _CHECKED_LOCK:
        if query in _CHECKED:
            _CHECKED.move_to_end(query)
            return _CHECKED[query]
    _parse(query)  # a syntax error is the caller's, before any value is bound
    tokens = tokenize(query)
    spans: list[tuple[int, int, int | None]] = []
    named = False
    for index, token in enumerate(tokens):
        if token.token_type == TokenType.PLACEHOLDER:
            spans.append((token.start, token.end, None))
        elif token.token_type == TokenType.PARAMETER:
            following = tokens[index + 1] if index + 1 < len(tokens) else None
            named = (
                following is None
                or following.token_type != TokenType.NUMBER
                or following.start != token.end + 1
                or not following.text.isdigit()
            )
            if named or following is None:
                break
            spans.append((token.start, following.end, int(following.text)))
    found = None if named else tuple(spans)
    with _CHECKED_LOCK:
        _CHECKED[query] = found
        while len(_CHECKED) > _CHECKED_SIZE:
            _CHECKED.popitem(last=False)
    return found


def _spaced(query: str, start: int, end: int, literal: str) -> str:
    """``literal`` for ``query[start:end + 1]``, with a space where it would otherwise
    join a neighbouring token (``x -?`` and ``-1`` must not make a ``--`` comment)."""
    before = query[start - 1] if start > 0 else " "
    after = query[end + 1] if end + 1 < len(query) else " "
    return (
        ("" if before.isspace() or before in "(," else " ")
        + literal
        + ("" if after.isspace() or after in "),;" else " ")
    )


def _parse(query: str) -> exp.Expr:
    try:
        return sqlglot.parse_one(query, read="duckdb")
    except sqlglot.errors.ParseError as error:
        raise SqlSyntaxError(str(error).splitlines()[0]) from None


def _literal(value: object) -> str:
    return str(exp.convert(value).sql("duckdb"))


def _check_values(params: Sequence[Any]) -> None:
    if isinstance(params, str | bytes) or not isinstance(params, Sequence):
        raise QueryError(f"query parameters are a list or tuple, not {type(params).__name__}")
    for position, value in enumerate(params):
        if not isinstance(value, VALUE_TYPES):
            raise QueryError(
                f"parameter {position + 1} is a {type(value).__name__}; a parameter is a "
                "number, string, bytes, bool, date, datetime, Decimal or None"
            )


def _check_all_used(params: Sequence[Any], used: set[int]) -> None:
    unused = sorted(set(range(len(params))) - used)
    if unused:
        raise QueryError(
            f"{len(params)} parameter(s) given, but the query has no placeholder for "
            f"parameter {unused[0] + 1}"
        )


def bind_parsed(statement: exp.Expr, params: Sequence[Any]) -> str:
    """:func:`bind` for a statement parsed already (a prepared statement's)."""
    _check_values(params)
    bound = statement.copy()
    used: set[int] = set()
    for position, node in enumerate(list(bound.find_all(exp.Placeholder, bfs=False))):
        index = int(node.name) - 1 if node.name and node.name.isdigit() else position
        if not 0 <= index < len(params):
            raise QueryError(f"parameter {index + 1} is not bound ({len(params)} given)")
        used.add(index)
        node.replace(exp.convert(params[index]))
    _check_all_used(params, used)
    return str(bound.sql("duckdb"))
