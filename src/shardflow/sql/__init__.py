"""Pure planning: SQL text -> a distributed plan of fragments per shard and merge steps.

The planner and ``explain`` (and SQLGlot behind them) are imported on first use: a worker
reads plans (:mod:`shardflow.sql.plan`, plain data) but never plans, and each of the five
processes of an embedded cluster starting on two cores paid ~0.2 s to import them."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from shardflow.sql.plan import PARTIALS, DistributedPlan, Stage

del globals()["plan"]  # the submodule just loaded: ``shardflow.sql.plan`` is the planner's
# function (below), as it always was; the module is still ``sys.modules["shardflow.sql.plan"]``

if TYPE_CHECKING:
    from shardflow.sql.explain import explain
    from shardflow.sql.planner import gather_plan, plan

_LAZY = {
    "explain": "shardflow.sql.explain",
    "gather_plan": "shardflow.sql.planner",
    "plan": "shardflow.sql.planner",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shardflow.sql' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = ["PARTIALS", "DistributedPlan", "Stage", "explain", "gather_plan", "plan"]
