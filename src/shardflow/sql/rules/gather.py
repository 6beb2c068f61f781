"""The fallback that applies to every query: the shards run the FROM and WHERE clauses
(filters, joins and shard-local subqueries pushed down) and send back only the columns the
rest of the query reads; the rest runs over those rows in one place. Slower, never wrong."""

from __future__ import annotations

from sqlglot import exp

from shardflow.sql import analysis as a
from shardflow.sql.rules.finish import Finish, partials

_AFTER_FROM = ("expressions", "group", "having", "qualify", "order", "windows", "distinct")


def gather(query: exp.Expr, local: bool, reason: str) -> Finish:
    if not isinstance(query, exp.Select):
        return Finish(query, exp.select("*").from_(partials()), "gather", "set operation")
    aliases = {s.alias for s in a.sources(query)}
    columns: dict[tuple[str, str], str] = {}
    for part in a.block_parts(query, _AFTER_FROM):
        for column in part.find_all(exp.Column):
            if column.table in aliases:
                columns.setdefault((column.table, column.name), f"_x{len(columns)}")

    fragment = query.copy()
    for key in (*_AFTER_FROM, "limit", "offset"):
        fragment.set(key, None)
    fragment.set(
        "expressions",
        [exp.column(a.identifier(c), table=t).as_(name) for (t, c), name in columns.items()]
        or [exp.true().as_("_x")],
    )

    merge = query.copy()
    merge.set("from_", exp.From(this=partials()))
    for key in ("joins", "where", "with_"):
        merge.set(key, None)

    def relink(node: exp.Expr) -> exp.Expr:
        if isinstance(node, exp.Column) and (node.table, node.name) in columns:
            return exp.column(columns[(node.table, node.name)])
        return node

    relinked = merge.transform(relink, copy=False)
    why = {
        "window": "window function not partitioned by the distribution key",
        "aggregate": "aggregate that cannot be split into partial and final steps",
        "limit": "LIMIT inside the query",
    }.get(reason, reason)
    return Finish(fragment, relinked, "gather", f"{why}: rows gathered after filters and joins")
