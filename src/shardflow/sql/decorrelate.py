"""Rewrites for subqueries that cannot run per shard.

``decorrelate`` turns chosen correlated subqueries into joins with grouped derived tables
(SQLGlot's rewrite, applied only to them: a subquery correlated on the distribution key is
better left to the engine). ``semijoin_reduction`` then restricts such a derived table to the
keys the enclosing query can match, so that only those groups are computed and shipped.
"""

from __future__ import annotations

from sqlglot import exp
from sqlglot.helper import name_sequence
from sqlglot.optimizer import unnest_subqueries as sqlglot_unnest
from sqlglot.optimizer.scope import ScopeType, traverse_scope

from shardflow.sql import analysis as a

MARK = "shardflow_decorrelate"


def mark(query: exp.Expr) -> None:
    """Ask :func:`decorrelate` to rewrite this (correlated) subquery."""
    query.meta[MARK] = True


def decorrelate(select: exp.Select) -> None:
    """Rewrite the marked correlated subqueries of ``select`` into joins, in place."""
    rewritten = select.copy()
    names = name_sequence("_u_")
    for scope in traverse_scope(rewritten):
        inner = scope.expression
        parent = inner.parent_select
        if parent is None or not inner.meta.get(MARK) or not scope.external_columns:
            continue
        assert isinstance(inner, exp.Select)
        if scope.scope_type == ScopeType.SET_OPERATION or _evaluated_after_aggregate(inner, parent):
            continue  # SQLGlot leaves these alone too; the caller gathers instead
        sqlglot_unnest.decorrelate(  # type: ignore[no-untyped-call]
            inner, parent, scope.external_columns, names
        )
    for key in set(select.args) | set(rewritten.args):
        select.set(key, rewritten.args.get(key))


def _evaluated_after_aggregate(inner: exp.Select, parent: exp.Select) -> bool:
    return not sqlglot_unnest._has_plain_explicit_group(
        parent
    ) and sqlglot_unnest._is_post_aggregation(inner, parent)


def semijoin_reduction(
    select: exp.Select, ref: a.SourceRef, inner: exp.Expr, replicated: set[str]
) -> bool:
    """Add to derived table ``inner`` (the body of source ``ref`` of ``select``) a filter
    ``key IN (SELECT col FROM R WHERE <R's filters>)`` when ``select`` joins it on
    ``ref.key = R.col`` with a replicated table ``R`` that ``select`` filters. Only rows no
    result row can match are removed. ``replicated`` names the sources that are replicated
    tables. Returns whether a filter was added."""
    if not isinstance(inner, exp.Select) or inner.args.get("limit") or inner.args.get("offset"):
        return False
    joins = a.sources(select)
    if any(s.side in ("RIGHT", "FULL") for s in joins):
        return False
    preserved_by_outer_join = ref.join is None and any(s.outer_right for s in joins)
    if preserved_by_outer_join or ref.kind in ("ANTI",):
        return False
    by_alias = {s.alias: s for s in joins}
    where = a.conjuncts(select.args.get("where"))
    pairs = list(a.equalities(select.args.get("where")))
    if ref.join is not None:
        pairs += list(a.equalities(ref.join.args.get("on")))
    for left, right in pairs:
        for mine, theirs in ((left, right), (right, left)):
            if mine[1] != ref.alias or theirs[1] not in replicated:
                continue
            other = by_alias.get(theirs[1])
            if other is None or not isinstance(other.node, exp.Table) or other.outer_right:
                continue
            filters = [p for p in where if _reads_only(p, theirs[1])]
            if not filters:
                continue
            key = _grouped_expression(inner, mine[2])
            if key is None:
                continue
            probe = (
                exp.select(exp.column(a.identifier(theirs[2]), table=theirs[1]))
                .from_(other.node.copy())
                .where(a.and_all(filters))
            )
            inner.where(exp.In(this=key.copy(), query=exp.Subquery(this=probe)), copy=False)
            return True
    return False


def _reads_only(condition: exp.Expr, alias: str) -> bool:
    """A condition on one source alone (uncorrelated subqueries allowed)."""
    own = [c for c in condition.find_all(exp.Column) if not _inside_query(c, condition)]
    if not own or any(c.table != alias for c in own):
        return False
    return all(not a.external_columns(q) for q in condition.find_all(exp.Select)) and not any(
        a.is_aggregate(n) or isinstance(n, exp.Window) for n in condition.walk()
    )


def _inside_query(node: exp.Expr, root: exp.Expr) -> bool:
    parent = node.parent
    while parent is not None and parent is not root:
        if isinstance(parent, a.QUERY_NODES):
            return True
        parent = parent.parent
    return False


def _grouped_expression(inner: exp.Select, output: str) -> exp.Expr | None:
    """The expression behind output ``output`` if filtering rows on it before the query
    only removes whole output rows (a GROUP BY key, or any row-wise expression)."""
    projection = next((p for p in inner.selects if p.alias_or_name == output), None)
    if projection is None:
        return None
    expression = projection.unalias()
    if any(a.is_aggregate(n) or isinstance(n, exp.Window | exp.Select) for n in expression.walk()):
        return None
    group = inner.args.get("group")
    if group is not None:
        keys = {g.sql() for g in group.expressions}
        return expression if expression.sql() in keys else None
    if a.block_has_aggregates(inner) or inner.args.get("distinct"):
        return None if a.block_has_aggregates(inner) else expression
    return expression
