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
* ``DATE '1998-12-01'`` (a cast of a string) becomes Polars' ``DATE('1998-12-01')``.

Types come from SQLGlot's annotation over the input tables' schemas, so the rewrite is done
once per fragment text and input schemas (cached). What it cannot type is left as it is; the
engine still checks the result's types against DuckDB's and falls back where they differ.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import pyarrow as pa
import sqlglot
from sqlglot import exp
from sqlglot.optimizer.annotate_types import annotate_types
from sqlglot.optimizer.qualify_columns import qualify_columns
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
    mapping = MappingSchema({table: dict(columns) for table, columns in schema}, dialect="duckdb")
    try:  # columns need their tables for their types (the planner's fragments have them)
        tree = qualify_columns(tree, mapping, expand_stars=False, allow_partial_qualification=True)
    except sqlglot.errors.SqlglotError:
        pass  # what stays unqualified stays untyped, and is left as it is
    annotate_types(tree, schema=mapping, dialect="duckdb")
    return _exact(tree).sql(dialect="postgres")


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
                cast = _cast(node.copy(), f"DECIMAL({EXACT_PRECISION}, {result})")
                node = node.replace(cast) if node.parent is not None else cast
            else:
                result = 0 if node.is_int else None
        elif (
            isinstance(node, exp.Cast)
            and node.to.is_type(exp.DataType.Type.DATE)
            and isinstance(node.this, exp.Literal)
            and node.this.is_string
        ):  # Polars 1 warns that casting a string to a date is deprecated: its DATE() parses
            parsed = exp.Anonymous(this="DATE", expressions=[node.this.copy()])
            node = node.replace(parsed) if node.parent is not None else parsed
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
