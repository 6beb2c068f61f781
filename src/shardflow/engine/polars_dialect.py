"""DuckDB SQL rewritten for Polars' SQL front end, keeping DuckDB's answers.

SQLGlot translates the syntax (Polars reads a PostgreSQL-like dialect). Decimal arithmetic
needs more than syntax, because Polars 1 (the version cudf-polars runs) types it otherwise:

* ``a * b`` of decimals gets the larger operand's scale (DECIMAL(15,2) * DECIMAL(15,2) is
  rounded to 2 places), where DuckDB keeps the exact product (scale 2 + 2). The left
  operand is cast to the exact scale first, which Polars then keeps.
* ``/`` of decimals stays decimal at the larger scale; DuckDB divides as DOUBLE. Numeric
  operands of ``/`` are cast to DOUBLE.
* A literal such as ``0.05`` is a float to Polars and a DECIMAL to DuckDB, which decides
  ``l_discount <= 0.06 + 0.01``; such literals become DECIMAL casts.
* A literal such as ``0.05`` is read by Polars as a float (``12345678901234567.12`` would lose
  its cents): decimal literals become casts of their text, ``CAST('0.05' AS DECIMAL(38, 2))``,
  which Polars folds into an exact decimal.

Constants are folded into literals the GPU engine takes, as cudf-polars refuses what Polars
makes of them otherwise: ``DATE '1998-12-01'`` (Polars parses the text with a cached
``strptime``, a CPU feature) and ``DATE '1998-12-01' - INTERVAL 90 DAY`` (``offset_by``)
become ``CAST(10561 AS DATE)`` (days since 1970), which Polars reads as a date literal; and
an uncorrelated scalar subquery (which Polars joins back to its query as a one-row
horizontal concatenation, broadcast on the CPU but padded with nulls on the GPU: TPC-H Q11
found nothing) is run first and its value written in its place (:func:`scalar_subqueries`,
:func:`with_values`).

Types come from SQLGlot's annotation over the input tables' schemas, so the rewrite is done
once per fragment text and input schemas (cached). What it cannot type is left as it is; the
engine still checks the result's types against DuckDB's and falls back where they differ.
"""

from __future__ import annotations

import calendar
import datetime
import functools
import math
from collections.abc import Mapping
from decimal import Decimal
from typing import NamedTuple

import pyarrow as pa
import pyarrow.compute as pc
import sqlglot
from sqlglot import exp
from sqlglot.optimizer.annotate_types import annotate_types
from sqlglot.optimizer.qualify_columns import qualify_columns
from sqlglot.optimizer.scope import build_scope
from sqlglot.optimizer.unnest_subqueries import unnest_subqueries
from sqlglot.schema import MappingSchema

SchemaKey = tuple[tuple[str, tuple[tuple[str, str], ...]], ...]
"""The input tables' columns and SQL types: ((table, ((column, type), ...)), ...)."""

EXACT_PRECISION = 38


@functools.lru_cache(maxsize=2048)
def inputs(sql: str) -> tuple[frozenset[str], frozenset[str] | None]:
    """The tables a DuckDB query reads (CTE names left out) and the column names it
    mentions (None when it selects ``*``: then every column is needed)."""
    tree = sqlglot.parse_one(sql, read="duckdb")
    ctes = {cte.alias_or_name for cte in tree.find_all(exp.CTE)}
    tables = frozenset(t.name for t in tree.find_all(exp.Table)) - ctes
    star = any(not isinstance(s.parent, exp.Count) for s in tree.find_all(exp.Star))
    columns = None if star else frozenset(c.name for c in tree.find_all(exp.Column))
    return tables, columns


def schema_key(tables: Mapping[str, pa.Schema]) -> SchemaKey:
    """``tables``' schemas as the rewrite reads them (hashable, for its cache)."""
    return tuple(
        (name, tuple((f.name, _sql_type(f.type)) for f in tables[name])) for name in sorted(tables)
    )


@functools.lru_cache(maxsize=2048)
def polars_sql(sql: str, schema: SchemaKey = ()) -> str:
    """``sql`` (DuckDB) as Polars SQL with DuckDB's decimal and division semantics."""
    tree = sqlglot.parse_one(sql, read="duckdb")
    for aggregate in tree.find_all(exp.AggFunc):
        counts_rows = isinstance(aggregate, exp.Count) and isinstance(aggregate.this, exp.Star)
        if not counts_rows and aggregate.find(exp.Column) is None:
            # Polars folds min(-2) to -2 even over no rows, where DuckDB gives NULL
            raise sqlglot.errors.UnsupportedError(f"{aggregate.sql('duckdb')} of a constant")
    tree = _qualified(tree, schema)
    tree = _join_filters(_decorrelated(tree))
    annotate_types(tree, schema=_mapping(schema), dialect="duckdb")
    return _exact(tree).sql(dialect="postgres")


def _decorrelated(tree: exp.Expr) -> exp.Expr:
    """Correlated subqueries joined to their query instead (SQLGlot's ``unnest_subqueries``:
    a correlated scalar aggregate becomes a left join to the aggregate grouped by the
    correlated columns), which Polars' SQL front end takes: it cannot resolve an outer
    query's column inside a subquery (TPC-H Q2, Q17 fell back to DuckDB). A subquery
    counting rows stays (``count`` over no rows is 0, the join would give NULL), as does
    what the rewrite cannot take."""
    root = build_scope(tree)
    if root is None:
        return tree
    correlated = [s.expression for s in root.traverse() if s.is_correlated_subquery]
    if not correlated or not all(_scalar_aggregate(q) for q in correlated):
        return tree  # EXISTS and IN subqueries Polars takes as they are (TPC-H Q21, Q22)
    try:
        unnested = unnest_subqueries(tree.copy())
    except sqlglot.errors.SqlglotError:
        return tree
    for select in unnested.find_all(exp.Select):  # the new joins see every table before
        for join in select.args.get("joins") or ():  # them: ``a, b LEFT JOIN s ON a.k ..``
            if not join.args.get("kind") and not join.side and join.args.get("on") is None:
                join.set("kind", "CROSS")  # would bind s to b alone
    return unnested


def _scalar_aggregate(query: exp.Expr) -> bool:
    """A subquery compared as one value, its one output an aggregate other than a count
    (``x < (SELECT 0.2 * avg(q) FROM ... WHERE outer.k = k)``)."""
    parent = query.parent
    while isinstance(parent, exp.Paren | exp.Subquery):
        parent = parent.parent
    if not isinstance(query, exp.Select) or not isinstance(parent, exp.Binary):
        return False
    if isinstance(parent, exp.Connector) or len(query.expressions) != 1:
        return False
    output = query.expressions[0]
    return output.find(exp.AggFunc) is not None and output.find(exp.Count) is None


def _join_filters(tree: exp.Expr) -> exp.Expr:
    """A left join's conditions on its joined table alone, taken into that table: ``LEFT
    JOIN o ON c.k = o.k AND o.x NOT LIKE '%y%'`` reads ``LEFT JOIN (SELECT * FROM o WHERE
    o.x NOT LIKE '%y%') AS o ON c.k = o.k`` (the same rows: the condition only decides
    which of o's rows can match). Polars' SQL front end joins on equalities only (TPC-H
    Q13 fell back to DuckDB)."""
    for join in list(tree.find_all(exp.Join)):
        table = join.this
        condition = join.args.get("on")
        if join.side != "LEFT" or not isinstance(table, exp.Table) or condition is None:
            continue
        name = table.alias_or_name
        kept, moved = [], []
        for part in _conjuncts(condition):
            tables = {c.table for c in part.find_all(exp.Column)}
            only_joined = tables == {name} and part.find(exp.Subquery) is None
            (moved if only_joined and not isinstance(part, exp.EQ) else kept).append(part)
        if not moved or not kept:
            continue
        inner = exp.select("*").from_(table.copy()).where(exp.and_(*moved))
        join.set(
            "this", exp.Subquery(this=inner, alias=exp.TableAlias(this=exp.to_identifier(name)))
        )
        join.set("on", exp.and_(*kept))
    return tree


def _conjuncts(condition: exp.Expr) -> list[exp.Expr]:
    if isinstance(condition, exp.And):
        return [*_conjuncts(condition.this), *_conjuncts(condition.expression)]
    if isinstance(condition, exp.Paren):
        return _conjuncts(condition.this)
    return [condition]


def _mapping(schema: SchemaKey) -> MappingSchema:
    return MappingSchema({table: dict(columns) for table, columns in schema}, dialect="duckdb")


def _qualified(tree: exp.Expr, schema: SchemaKey) -> exp.Expr:
    """``tree`` with its columns qualified by their tables in ``schema``, where it can be."""
    try:  # columns need their tables for their types (the planner's fragments have them)
        return qualify_columns(
            tree, _mapping(schema), expand_stars=False, allow_partial_qualification=True
        )
    except sqlglot.errors.SqlglotError:
        return tree  # what stays unqualified stays untyped, and is left as it is


IN_LIST_MAX = 10_000
"""An IN subquery with at most this many values is written into its query as a list."""


class Subquery(NamedTuple):
    sql: str
    """DuckDB SQL that runs on its own."""
    listed: bool
    """``x IN (SELECT ...)``: its values make a list; else a scalar subquery: one value."""


@functools.lru_cache(maxsize=2048)
def constant_subqueries(sql: str, schema: SchemaKey = ()) -> tuple[Subquery, ...]:
    """The uncorrelated subqueries of a DuckDB query whose values can be written into it:
    scalar ones (``x > (SELECT avg(y) FROM t)``) and those of ``x [NOT] IN (SELECT ...)``,
    not one inside another, each once, as SQL that runs on its own (with the query's WITH
    clause where it reads one of its CTEs). Columns are qualified with ``schema`` first, so
    that one naming the outer query's table is seen; a subquery naming a column no table
    here has fails on its own, and stays."""
    _, found = _constants(sql, schema)
    return tuple(dict.fromkeys(subquery for _, subquery in found))


def with_values(sql: str, schema: SchemaKey, values: Mapping[Subquery, str | list[str]]) -> str:
    """``sql`` with each subquery (as :func:`constant_subqueries` gives it for the same
    ``schema``) that ``values`` holds replaced by its value's SQL, or for an IN subquery by
    the list of its values' SQL (``x IN ()`` is FALSE)."""
    tree, found = _constants(sql, schema)
    for node, subquery in found:
        value = values.get(subquery)
        if isinstance(value, str):
            node.replace(sqlglot.parse_one(value, read="duckdb"))
        elif value is not None:
            test = node.parent
            assert isinstance(test, exp.In)
            items = [sqlglot.parse_one(v, read="duckdb") for v in value]
            test.replace(exp.In(this=test.this, expressions=items) if items else exp.false())
    return tree.sql(dialect="duckdb")


def _constants(sql: str, schema: SchemaKey) -> tuple[exp.Expr, list[tuple[exp.Expr, Subquery]]]:
    tree = _qualified(sqlglot.parse_one(sql, read="duckdb"), schema)
    ctes = tree.args.get("with_")
    cte_names = {cte.alias_or_name for cte in ctes.expressions} if ctes else set()
    root = build_scope(tree)
    found = []
    for scope in root.traverse() if root is not None else ():
        node = scope.expression.parent
        listed = isinstance(node, exp.Subquery) and _is_in_list(node)
        if (
            scope.is_subquery
            and (listed or _is_scalar(node))
            and not scope.external_columns
            and not _inside_constant(node)
        ):
            query = scope.expression.copy()
            if ctes and any(t.name in cte_names for t in query.find_all(exp.Table)):
                query.set("with_", ctes.copy())
            found.append((node, Subquery(query.sql(dialect="duckdb"), listed)))
    return tree, found


def _inside_constant(node: exp.Expr) -> bool:
    parent = node.parent
    while parent is not None:
        if _is_scalar(parent) or _is_in_list(parent):
            return True
        parent = parent.parent
    return False


def _is_in_list(node: exp.Expr) -> bool:
    return (
        isinstance(node, exp.Subquery)
        and isinstance(node.parent, exp.In)
        and node.parent.args.get("query") is node
        and isinstance(node.this, exp.Query)
        and len(node.this.selects) == 1
    )


def _is_scalar(node: exp.Expr | None) -> bool:
    return (
        isinstance(node, exp.Subquery)
        and isinstance(node.this, exp.Query)
        and len(node.this.selects) == 1
        and not isinstance(node.parent, exp.In | exp.Exists | exp.Any | exp.All)
        and not isinstance(node.parent, exp.From | exp.Join | exp.Lateral)
        and not node.alias
    )


def sql_literal(table: pa.Table) -> str | None:
    """The value of a one-column result of at most one row as a typed DuckDB literal (NULL
    when it has no row); None when it is not such a result or its type has no literal
    here (the subquery is then left to run where it is)."""
    if table.num_columns != 1 or table.num_rows > 1:
        return None
    return _literal(table.column(0)[0].as_py() if table.num_rows else None, table.schema[0].type)


def sql_values(table: pa.Table) -> list[str] | None:
    """The distinct values of a one-column result as typed DuckDB literals; None when it is
    not one column, holds a NULL (``x NOT IN`` a list with NULL is never true, which a
    list of values would not keep), holds more than :data:`IN_LIST_MAX` values or values
    of a type that has no literal here."""
    if table.num_columns != 1 or table.column(0).null_count:
        return None
    values = pc.unique(table.column(0))
    if len(values) > IN_LIST_MAX:
        return None
    kind = table.schema[0].type
    literals = [_literal(value, kind) for value in values.to_pylist()]
    return None if None in literals else [v for v in literals if v is not None]


def _literal(value: object, kind: pa.DataType) -> str | None:
    name = _sql_type(kind)
    if name == "UNKNOWN" or (pa.types.is_timestamp(kind) and kind.tz is not None):
        return None
    if value is None:
        return f"CAST(NULL AS {name})"
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, Decimal) or (isinstance(value, float) and not math.isfinite(value)):
        return f"CAST('{value}' AS {name})"  # exact: Polars folds the text into a decimal
    if isinstance(value, int | float):
        return f"CAST({value!r} AS {name})"
    if isinstance(value, datetime.datetime):
        return f"TIMESTAMP '{value.isoformat(sep=' ')}'"
    if isinstance(value, datetime.date):
        return f"DATE '{value.isoformat()}'"
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    return None


def _sql_type(kind: pa.DataType) -> str:
    if pa.types.is_decimal(kind):
        return f"DECIMAL({kind.precision}, {kind.scale})"
    for test, name in _SQL_TYPES:
        if test(kind):
            return name
    return "UNKNOWN"


_SQL_TYPES = (
    (pa.types.is_integer, "BIGINT"),
    (pa.types.is_floating, "DOUBLE"),
    (pa.types.is_boolean, "BOOLEAN"),
    (pa.types.is_date, "DATE"),
    (pa.types.is_timestamp, "TIMESTAMP"),
    (lambda kind: pa.types.is_string(kind) or pa.types.is_large_string(kind), "VARCHAR"),
)


def _exact(tree: exp.Expr) -> exp.Expr:
    """Rewrite decimal products, divisions and decimal literals, children before parents
    (a product's scale depends on its operands' scales after their own rewriting)."""
    scales: dict[int, int | None] = {}
    dates: dict[int, datetime.date] = {}  # date constants folded so far

    def scale(node: exp.Expr) -> int | None:
        """DuckDB's scale of a numeric expression (0: an integer); None when it is not an
        exact number, or not known."""
        return scales.get(id(node), _annotated_scale(node))

    def visit(node: exp.Expr) -> exp.Expr:
        for child in list(node.iter_expressions()):
            visit(child)
        result: int | None
        if isinstance(node, exp.Literal) and node.is_number:
            text = node.name
            if "." in text and "e" not in text.lower():
                result = len(text.split(".", 1)[1])
                cast = _cast(exp.Literal.string(text), f"DECIMAL({EXACT_PRECISION}, {result})")
                node = node.replace(cast) if node.parent is not None else cast
            else:
                result = 0 if node.is_int else None
        elif (day := _date_of(node)) is not None:
            node = _replace(node, _date_literal(day))
            dates[id(node)] = day
            result = None
        elif (day := _shifted_date(node, dates)) is not None:
            node = _replace(node, _date_literal(day))
            dates[id(node)] = day
            result = None
        elif isinstance(node, exp.Like) and (matched := _like(node)) is not None:
            node = _replace(node, matched)
            result = None
        elif isinstance(node, exp.Mul):
            left, right = scale(node.left), scale(node.right)
            result = None if left is None or right is None else left + right
            if left and right:  # both fractional: Polars would keep only the larger scale
                node.set("this", _cast(node.left, f"DECIMAL({EXACT_PRECISION}, {result})"))
        elif isinstance(node, exp.Div):
            if scale(node.left) is not None or scale(node.right) is not None:
                node.set("this", _cast(node.left, "DOUBLE"))
                node.set("expression", _cast(node.right, "DOUBLE"))
            result = None
        elif isinstance(node, exp.Add | exp.Sub):
            left, right = scale(node.left), scale(node.right)
            result = None if left is None or right is None else max(left, right)
        elif isinstance(node, exp.Paren | exp.Neg | exp.Sum | exp.Min | exp.Max):
            result = scale(node.this)
        else:
            result = _annotated_scale(node)
        scales[id(node)] = result
        return node

    return visit(tree)


def _replace(node: exp.Expr, by: exp.Expr) -> exp.Expr:
    return node.replace(by) if node.parent is not None else by


_EPOCH = datetime.date(1970, 1, 1)


def _date_literal(day: datetime.date) -> exp.Expr:
    """A date Polars reads as a literal: the cast of its days since 1970."""
    return _cast(exp.Literal.number((day - _EPOCH).days), "DATE")


def _date_of(node: exp.Expr) -> datetime.date | None:
    """The day of a ``DATE 'yyyy-mm-dd'`` literal (None for anything else)."""
    if not (
        isinstance(node, exp.Cast)
        and node.to.is_type(exp.DataType.Type.DATE)
        and isinstance(node.this, exp.Literal)
        and node.this.is_string
    ):
        return None
    try:
        return datetime.date.fromisoformat(node.this.name.strip())
    except ValueError:
        return None


_DAYS_PER_UNIT = {"DAY": 1, "WEEK": 7}
_MONTHS_PER_UNIT = {"MONTH": 1, "QUARTER": 3, "YEAR": 12}


def _shifted_date(node: exp.Expr, dates: Mapping[int, datetime.date]) -> datetime.date | None:
    """The day of a folded date constant plus or minus a constant interval in days, weeks,
    months, quarters or years (DuckDB's calendar: a month later than January 31 is the last
    of February); None when ``node`` is not one."""
    if isinstance(node, exp.Add) and isinstance(node.left, exp.Interval):
        day, interval, sign = dates.get(id(node.right)), node.left, 1
    elif isinstance(node, exp.Add | exp.Sub):
        day, interval, sign = (
            dates.get(id(node.left)),
            node.right,
            -1 if isinstance(node, exp.Sub) else 1,
        )
    else:
        return None
    unit = interval.args.get("unit") if isinstance(interval, exp.Interval) else None
    if day is None or not isinstance(unit, exp.Var) or not isinstance(interval.this, exp.Literal):
        return None
    name = unit.name.upper().removesuffix("S")
    try:
        amount = sign * int(interval.this.name)
        if name in _DAYS_PER_UNIT:
            return day + datetime.timedelta(days=amount * _DAYS_PER_UNIT[name])
        if name in _MONTHS_PER_UNIT:
            months = day.year * 12 + day.month - 1 + amount * _MONTHS_PER_UNIT[name]
            year, month = divmod(months, 12)
            last = calendar.monthrange(year, month + 1)[1]
            return datetime.date(year, month + 1, min(day.day, last))
    except (ValueError, OverflowError):
        pass
    return None


_REGEX_SPECIAL = frozenset("\\.^$|?*+()[]{}")


def _like(node: exp.Like) -> exp.Expr | None:
    """``x LIKE 'pattern'`` in a form the GPU engine takes, where there is one: Polars
    matches LIKE with a regex in dot-all mode (``^(?s)PROMO.*$``), which libcudf's regex
    refuses. A prefix becomes ``STARTS_WITH``, a suffix ``ENDS_WITH``, and a pattern that
    ends with ``%`` a regex without the flag (``%`` as ``[\\s\\S]*``, which also spans
    lines); others (and LIKE ... ESCAPE) stay as they are."""
    pattern = node.expression
    if isinstance(node.parent, exp.Escape) or not (
        isinstance(pattern, exp.Literal) and pattern.is_string
    ):
        return None
    matched = _like_match(node.this.copy(), pattern.name)
    return exp.Not(this=exp.Paren(this=matched)) if matched and node.args.get("negate") else matched


def _like_match(value: exp.Expr, text: str) -> exp.Expr | None:
    inner = text.strip("%")
    if "%" not in text or "\\" in text:
        return None
    if "%" not in inner and "_" not in inner and inner:
        if text == inner + "%":
            return exp.func("STARTS_WITH", value, exp.Literal.string(inner))
        if text == "%" + inner:
            return exp.func("ENDS_WITH", value, exp.Literal.string(inner))
    if not text.endswith("%"):  # its end would need an anchor, which regex dialects differ on
        return None
    wildcards = {"%": "[\\s\\S]*", "_": "[\\s\\S]"}
    body = "".join(wildcards.get(c) or (f"\\{c}" if c in _REGEX_SPECIAL else c) for c in inner)
    if not text.startswith("%"):
        body = "^" + body
    return exp.RegexpLike(this=value, expression=exp.Literal.string(body))


def _annotated_scale(node: exp.Expr) -> int | None:
    kind = node.type
    if kind is None:
        return None
    if kind.is_type(*exp.DataType.INTEGER_TYPES):
        return 0
    if kind.is_type(exp.DataType.Type.DECIMAL):
        params = kind.expressions
        if len(params) == 2:
            return int(params[1].name)
        return None
    return None


def _cast(node: exp.Expr, to: str) -> exp.Expr:
    return exp.Cast(this=node, to=exp.DataType.build(to, dialect="duckdb"))
