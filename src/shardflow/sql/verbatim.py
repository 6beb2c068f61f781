"""Queries the planner leaves as written.

The distributed planner takes a query apart and writes its pieces back as SQL through
SQLGlot. Some of DuckDB's constructs do not survive that: SQLGlot reads them as something
else (``any_value(x ORDER BY y)`` becomes ``IGNORE NULLS``), does not know them as
aggregates (``mad``, ``histogram``, ``product``: run per shard they give one row per
worker), or the planner has no rule for them (ASOF and POSITIONAL joins, named windows).
A query with any of them runs **as written**, in DuckDB, over its tables gathered whole
(:func:`shardflow.sql.planner.gather_plan`): slower, and right wherever DuckDB is.
:func:`whole_query_reason` names the construct; the plan's reason shows it in ``explain``.
"""

from __future__ import annotations

import functools

import duckdb
from sqlglot import exp

from shardflow.catalog import name_key


@functools.cache
def duckdb_aggregates() -> frozenset[str]:
    """The names of DuckDB's aggregate functions (and their aliases), as DuckDB lists them."""
    with duckdb.connect() as con:
        rows = con.sql(
            "SELECT DISTINCT function_name FROM duckdb_functions() "
            "WHERE function_type = 'aggregate'"
        ).fetchall()
    return frozenset(name_key(name) for (name,) in rows)


def whole_query_reason(tree: exp.Expr) -> str | None:
    """Why ``tree`` must run as written (the first such construct found), or None."""
    for node in tree.walk():
        reason = _reason(node)
        if reason is not None:
            return reason
    return None


def _reason(node: exp.Expr) -> str | None:
    if isinstance(node, exp.Anonymous) and name_key(str(node.name)) in duckdb_aggregates():
        return f"{node.name}() is an aggregate the planner cannot split"
    if isinstance(node, exp.AggFunc) and isinstance(node.this, exp.Order):
        return f"{node.key}() orders its input"
    if isinstance(node, exp.IgnoreNulls | exp.RespectNulls):
        return "IGNORE/RESPECT NULLS"
    if isinstance(node, exp.Join):
        method = str(node.args.get("method") or "").upper()
        kind = str(node.args.get("kind") or "").upper()
        if method in ("ASOF", "POSITIONAL") or kind in ("ANTI", "SEMI"):
            return f"{method or kind} JOIN"
        if node.args.get("nearest") is not None:
            return "APPROX NEAREST join"
    if isinstance(node, exp.Lateral):
        return "LATERAL"
    if isinstance(node, exp.Select):
        if node.args.get("windows"):
            return "a named WINDOW"
        distinct = node.args.get("distinct")
        if isinstance(distinct, exp.Distinct) and distinct.args.get("on") is not None:
            return "DISTINCT ON"
    if isinstance(node, exp.SetOperation) and node.args.get("by_name"):
        return "UNION BY NAME"
    if isinstance(node, exp.Limit | exp.Offset):
        options = node.args.get("limit_options")
        if options is not None and options.args.get("percent"):
            return "LIMIT with a percentage"
        limit = node.expression
        if limit is not None and not isinstance(limit, exp.Literal):
            return "LIMIT or OFFSET by an expression"
    if isinstance(node, exp.Columns):
        return "COLUMNS(...)"
    if isinstance(node, exp.Star) and (node.args.get("replace") or node.args.get("rename")):
        return "* REPLACE/RENAME"
    if isinstance(node, exp.Like | exp.ILike | exp.SimilarTo) and isinstance(node.this, exp.Star):
        return "* LIKE / SIMILAR TO"
    if isinstance(node, exp.Ordered) and isinstance(node.this, exp.Star):
        return "ORDER BY *"
    if isinstance(node, exp.Explode | exp.Unnest) and not isinstance(node.parent, exp.From):
        return "UNNEST in a SELECT list"
    if isinstance(node, exp.Alias) and name_key(node.alias) == "export_state":
        return "EXPORT_STATE"
    return None
