"""The result of a finishing rule, and helpers the rules share."""

from __future__ import annotations

from dataclasses import dataclass

from sqlglot import exp

from shardflow.sql.plan import PARTIALS


@dataclass(frozen=True)
class Finish:
    """``fragment`` runs on every shard; ``merge`` (if any) runs over their concatenation."""

    fragment: exp.Expr
    merge: exp.Expr | None
    strategy: str
    reason: str


def partials() -> exp.Table:
    return exp.Table(this=exp.to_identifier(PARTIALS))


def limit_value(node: exp.Expr | None) -> int | None:
    """The integer of a LIMIT/OFFSET clause, or None when absent or not a plain integer."""
    if node is None:
        return None
    value = node.expression if isinstance(node, exp.Limit | exp.Offset) else node
    if isinstance(value, exp.Literal) and value.is_int:
        return int(value.this)
    return None


def output_names(query: exp.Expr) -> list[str]:
    assert isinstance(query, exp.Query)
    return [p.alias_or_name for p in query.selects]
