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


def resolved_whole_reason(tree: exp.Expr) -> str | None:
    """Why the resolved ``tree`` (every column qualified by its source) must run as
    written, or None: an aggregate in a subquery over the outer query's columns only
    (``EXISTS (SELECT ... WHERE i > min(outer.i))``) aggregates the *outer* query, which
    DuckDB then answers with one row; the planner would run it per outer row."""
    for agg in tree.find_all(exp.AggFunc):
        select = agg.find_ancestor(exp.Select)
        if select is None or select.find_ancestor(exp.Select, exp.SetOperation) is None:
            continue  # the outermost query's own aggregates are the planner's to split
        columns = [c for c in agg.find_all(exp.Column) if c.table]
        if columns and not any(name_key(c.table) in _sources(select) for c in columns):
            return f"{agg.key}() in a subquery aggregates only the outer query's columns"
    return None


def _sources(select: exp.Select) -> set[str]:
    """The names (aliases) of the relations ``select`` reads in its FROM and JOINs."""
    found = [select.args.get("from_") or select.args.get("from")]
    found += list(select.args.get("joins") or [])
    return {name_key(f.this.alias_or_name) for f in found if f is not None and f.this}


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
        if isinstance(distinct, exp.Distinct) and _orders_by_unselected(node):
            return "SELECT DISTINCT ordered by what it does not select"
    if isinstance(node, exp.SetOperation) and node.args.get("by_name"):
        return "UNION BY NAME"
    if isinstance(node, exp.SetOperation) and _orders_by_an_ambiguous_name(node):
        return "a set operation ordered by a name its branches give different columns"
    if isinstance(node, exp.Placeholder):
        return "a :name placeholder (DuckDB reads it as slice syntax)"
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


def _orders_by_unselected(select: exp.Select) -> bool:
    """Whether a SELECT DISTINCT orders by an expression it does not select (DuckDB keeps
    one row per distinct selection and orders by a value of it; the planner would keep
    the key as a column and with it, rows DISTINCT had merged)."""
    order = select.args.get("order")
    if order is None:
        return False
    selected = {e.unalias().sql() for e in select.expressions}
    names = {name_key(e.alias_or_name) for e in select.expressions}
    for ordered in order.expressions:
        key = ordered.this
        if isinstance(key, exp.Literal) and key.is_int:
            continue
        if isinstance(key, exp.Column) and not key.table and name_key(key.name) in names:
            continue
        if key.sql() not in selected:
            return True
    return False


def _orders_by_an_ambiguous_name(union: exp.SetOperation) -> bool:
    """Whether a set operation's ORDER BY names a column that its branches output at
    different positions (``SELECT 1, a ... UNION SELECT b AS a, 1 ... ORDER BY a``), which
    DuckDB binds by rules of its own."""
    order = union.args.get("order")
    if order is None:
        return False
    keys = {
        name_key(o.this.name)
        for o in order.expressions
        if isinstance(o.this, exp.Column) and not o.this.table
    }
    if not keys:
        return False
    positions: dict[str, set[int]] = {key: set() for key in keys}
    for branch in _branches(union):
        for i, output in enumerate(branch.expressions):
            name = name_key(output.alias_or_name)
            if name in positions:
                positions[name].add(i)
    return any(len(found) > 1 for found in positions.values())


def _branches(node: exp.Expr) -> list[exp.Select]:
    """The SELECTs a tree of set operations combines, left to right (iteratively: a
    UNION ALL of thousands of branches nests that deep)."""
    found: list[exp.Select] = []
    stack = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, exp.SetOperation):
            stack += [current.expression, current.this]
        elif isinstance(current, exp.Subquery):
            stack.append(current.this)
        elif isinstance(current, exp.Select):
            found.append(current)
    return found
