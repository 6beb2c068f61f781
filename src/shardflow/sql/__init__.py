"""Pure planning: SQL text -> a distributed plan of fragments per shard and merge steps."""

from shardflow.sql.explain import explain
from shardflow.sql.plan import PARTIALS, DistributedPlan, Stage
from shardflow.sql.planner import gather_plan, plan

__all__ = ["PARTIALS", "DistributedPlan", "Stage", "explain", "gather_plan", "plan"]
