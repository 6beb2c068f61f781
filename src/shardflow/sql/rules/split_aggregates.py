"""Split a GROUP BY (or global) aggregate into partial aggregates on the shards and a final
aggregate over the partials on the client.

SUM, MIN, MAX and ANY_VALUE combine as themselves; COUNT combines as a SUM of counts; AVG
travels as a SUM and a COUNT. DISTINCT aggregates are exact: their arguments join the partial
GROUP BY, so the final step sees every distinct value of every group. HAVING, ORDER BY,
LIMIT and window functions over the aggregates run after the final step.
"""

from __future__ import annotations

from sqlglot import exp

from shardflow.sql import analysis as a
from shardflow.sql.outputs import group_by
from shardflow.sql.rules.finish import Finish, output_names, partials

_COMBINE_AS_ITSELF = (exp.Sum, exp.Min, exp.Max, exp.AnyValue, exp.LogicalAnd, exp.LogicalOr)


class _CannotSplit(Exception):
    pass


class _FragmentColumns:
    """Expressions the fragment computes, each once, named ``<prefix><n>``."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._by_text: dict[str, exp.Alias] = {}

    def column(self, expression: exp.Expr) -> exp.Column:
        text = expression.sql()
        if text not in self._by_text:
            name = f"{self._prefix}{len(self._by_text)}"
            self._by_text[text] = exp.Alias(this=expression.copy(), alias=exp.to_identifier(name))
        return exp.column(self._by_text[text].alias)

    def projections(self) -> list[exp.Alias]:
        return list(self._by_text.values())


def split_aggregates(query: exp.Expr, local: bool, reason: str) -> Finish | None:
    if reason != "aggregate" or not isinstance(query, exp.Select):
        return None
    distinct = query.args.get("distinct")
    if distinct is not None and distinct.args.get("on") is not None:
        return None  # DISTINCT ON keeps one whole row per key: gathered
    group = query.args.get("group")
    if group is not None and (
        group.args.get("rollup") or group.args.get("cube") or group.args.get("grouping_sets")
    ):
        return None
    try:
        return _split(query)
    except _CannotSplit:
        return None


def _split(query: exp.Select) -> Finish:
    group = query.args.get("group")
    if group is not None:
        group_exprs = [g.copy() for g in group.expressions]
    elif query.args.get("distinct") and not a.block_has_aggregates(query):
        group_exprs = [p.unalias().copy() for p in query.expressions]
    else:
        group_exprs = []
    group_exprs = list({g.sql(): g for g in group_exprs}.values())  # GROUP BY a, a
    sources = {s.alias for s in a.sources(query)}

    partial_columns = _FragmentColumns("_a")
    distinct_columns = _FragmentColumns("_d")
    partial, distinct_arg = partial_columns.column, distinct_columns.column

    def final(aggregate: exp.Expr) -> exp.Expr:
        inner = aggregate.this if isinstance(aggregate, exp.Filter) else aggregate
        filtered = isinstance(aggregate, exp.Filter)
        argument = inner.this
        if isinstance(argument, exp.Distinct):
            if filtered or len(argument.expressions) != 1:
                raise _CannotSplit
            column = distinct_arg(argument.expressions[0])
            rebuilt = inner.copy()
            rebuilt.set("this", exp.Distinct(expressions=[column]))
            return rebuilt
        if isinstance(inner, exp.Count):
            total = exp.func("SUM", partial(aggregate))
            return exp.cast(exp.func("COALESCE", total, exp.Literal.number(0)), "BIGINT")
        if isinstance(inner, exp.Avg):
            sum_part: exp.Expr = exp.Sum(this=argument.copy())
            count_part: exp.Expr = exp.Count(this=argument.copy())
            if filtered:
                sum_part = exp.Filter(this=sum_part, expression=aggregate.expression.copy())
                count_part = exp.Filter(this=count_part, expression=aggregate.expression.copy())
            return exp.paren(
                exp.Div(
                    this=exp.cast(exp.func("SUM", partial(sum_part)), "DOUBLE"),
                    expression=exp.func(
                        "NULLIF", exp.func("SUM", partial(count_part)), exp.Literal.number(0)
                    ),
                ),
                copy=False,
            )
        if isinstance(inner, _COMBINE_AS_ITSELF) and len(inner.expressions) == 0:
            rebuilt = inner.__class__(this=partial(aggregate))
            return rebuilt
        raise _CannotSplit

    group_columns = {g.sql(): f"_g{i}" for i, g in enumerate(group_exprs)}

    def rewrite(node: exp.Expr) -> exp.Expr:
        def visit(current: exp.Expr) -> exp.Expr:
            text = current.sql()
            # an ORDER BY key prints like its expression in the default dialect, which
            # leaves out NULLS FIRST: the key itself is kept, its expression is replaced
            grouped = not isinstance(current, exp.Literal | exp.Ordered)
            if grouped and text in group_columns:
                return exp.column(group_columns[text])
            if isinstance(current, exp.Filter) and a.is_aggregate(current.this):
                return final(current)
            if a.is_aggregate(current):
                return final(current)
            if isinstance(current, exp.Column) and current.table in sources:
                raise _CannotSplit  # neither grouped nor aggregated: not valid here
            return current

        return node.copy().transform(visit, copy=False)

    merge_projections = [
        rewrite(p.unalias()).as_(a.identifier(name))
        for p, name in zip(query.expressions, output_names(query), strict=True)
    ]
    merge = exp.select(*merge_projections).from_(partials())
    if group_exprs:
        merge.set("group", exp.Group(expressions=[exp.column(c) for c in group_columns.values()]))
    if query.args.get("distinct") and group is not None:
        merge.set("distinct", exp.Distinct())
    for key in ("having", "qualify"):
        if query.args.get(key) is not None:
            merge.set(key, rewrite(query.args[key]))
    if query.args.get("order") is not None:
        merge.set("order", rewrite(query.args["order"]))
    for key in ("limit", "offset"):
        if query.args.get(key) is not None:
            merge.set(key, query.args[key].copy())

    fragment = query.copy()
    for key in ("having", "qualify", "order", "limit", "offset", "distinct", "windows"):
        fragment.set(key, None)
    fragment.set(
        "expressions",
        [g.copy().as_(name) for g, name in zip(group_exprs, group_columns.values(), strict=True)]
        + distinct_columns.projections()
        + partial_columns.projections(),
    )
    if not fragment.expressions:
        fragment.set("expressions", [exp.Count(this=exp.Star()).as_("_n")])
    keys = group_exprs + [d.this for d in distinct_columns.projections()]
    fragment.set("group", group_by(keys))
    reason = "GROUP BY not on the distribution key" if group is not None else "global aggregate"
    if distinct_columns.projections():
        reason += "; DISTINCT arguments kept exact in the partial GROUP BY"
    return Finish(fragment, merge, "partial aggregate", reason)
