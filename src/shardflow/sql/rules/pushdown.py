"""Run a shard-local query whole on every shard; ORDER BY + LIMIT become a per-shard top-k
whose union is sorted and cut again on the client."""

from __future__ import annotations

from sqlglot import exp

from shardflow.sql import analysis as a
from shardflow.sql.rules.finish import Finish, limit_value, output_names, partials


def pushdown(query: exp.Expr, local: bool, reason: str) -> Finish | None:
    if not (local or reason == "limit"):
        return None
    order = query.args.get("order")
    limit = query.args.get("limit")
    offset = query.args.get("offset")
    if order is None and limit is None and offset is None:
        return Finish(query, None, "pushdown", "shard-local: the whole query runs on every shard")
    if isinstance(query, exp.SetOperation):
        return _pushdown_set_operation(query)

    assert isinstance(query, exp.Select)
    fragment = query.copy()
    for key in ("order", "limit", "offset"):
        fragment.set(key, None)
    projections = [p.unalias() for p in fragment.expressions]
    aliases = {p.alias_or_name: i for i, p in enumerate(query.expressions)}
    names = output_names(query)
    fragment.set("expressions", [p.copy().as_(f"_c{i}") for i, p in enumerate(projections)])

    keys: list[exp.Ordered] = []
    for j, ordered in enumerate(order.expressions if order is not None else []):
        target = ordered.this
        index = None
        if isinstance(target, exp.Column) and not target.table and target.name in aliases:
            index = aliases[target.name]
        else:
            index = next((i for i, p in enumerate(projections) if p == target), None)
        if index is not None:
            column = f"_c{index}"
        else:
            column = f"_o{j}"
            fragment.expressions.append(target.copy().as_(column))
        key = ordered.copy()
        key.set("this", exp.column(column))
        keys.append(key)

    limit_n, offset_n = limit_value(limit), limit_value(offset) or 0
    strategy, why = "pushdown", "shard-local; the order is restored on the client"
    if limit is not None and limit_n is not None and (offset is None or offset_n is not None):
        fragment.set("order", exp.Order(expressions=[k.copy() for k in keys]) if keys else None)
        fragment.set("limit", exp.Limit(expression=exp.Literal.number(limit_n + offset_n)))
        strategy, why = "top-k", f"each shard keeps its first {limit_n + offset_n} rows"

    merge = exp.select(
        *[exp.column(f"_c{i}").as_(a.identifier(name)) for i, name in enumerate(names)]
    ).from_(partials())
    if keys:
        merge.set("order", exp.Order(expressions=keys))
    if limit is not None:
        merge.set("limit", limit.copy())
    if offset is not None:
        merge.set("offset", offset.copy())
    return Finish(fragment, merge, strategy, why)


def _pushdown_set_operation(query: exp.SetOperation) -> Finish:
    body = query.copy()
    order, limit, offset = (body.args.get(k) for k in ("order", "limit", "offset"))
    for key in ("order", "limit", "offset"):
        body.set(key, None)
    fragment = exp.select("*").from_(body.subquery("__sf_u"))
    limit_n, offset_n = limit_value(limit), limit_value(offset) or 0
    strategy, why = "pushdown", "UNION ALL of shard-local parts; order restored on the client"
    if order is not None:
        fragment.set("order", order.copy())
    if limit is not None and limit_n is not None:
        fragment.set("limit", exp.Limit(expression=exp.Literal.number(limit_n + offset_n)))
        strategy, why = "top-k", f"each shard keeps its first {limit_n + offset_n} rows"
    merge = exp.select("*").from_(partials())
    for key, value in (("order", order), ("limit", limit), ("offset", offset)):
        if value is not None:
            merge.set(key, value.copy())
    return Finish(fragment, merge, strategy, why)
