"""Finishing rules: how the last, non-materialized part of a query is split into a fragment
that runs on every shard and a merge over the fragments' results.

Each rule is a pure function of the same name as its module, taking the settled query, whether
it is shard-local, and why not (``"aggregate"``, ``"window"``, ``"limit"``), and returning a
:class:`Finish` or ``None`` when it does not apply. The planner tries them in order; ``gather``
applies to every query and comes last.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlglot import exp

from shardflow.sql.rules.finish import Finish
from shardflow.sql.rules.gather import gather
from shardflow.sql.rules.pushdown import pushdown
from shardflow.sql.rules.split_aggregates import split_aggregates

Rule = Callable[[exp.Expr, bool, str], Finish | None]
FINISHING_RULES: tuple[Rule, ...] = (pushdown, split_aggregates, gather)

__all__ = ["FINISHING_RULES", "Finish", "Rule", "gather", "pushdown", "split_aggregates"]
