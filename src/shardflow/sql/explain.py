"""Human-readable rendering of a distributed plan: per stage, where it runs and why."""

from __future__ import annotations

import sqlglot

from shardflow.sql.parse import DIALECT
from shardflow.sql.plan import DistributedPlan, Stage

_WHERE = {
    "shards": "on every worker, over its shards",
    "worker": "on one worker (replicated data)",
    "client": "on the client",
}


def explain(plan: DistributedPlan) -> str:
    lines = [f"Distributed plan: {len(plan.stages)} stage(s), pushdown: {plan.pushdown}"]
    for index, stage in enumerate(plan.stages, start=1):
        lines.extend(_stage_lines(index, stage))
    return "\n".join(lines)


def _stage_lines(index: int, stage: Stage) -> list[str]:
    target = f"-> {stage.output}" if stage.output else "-> result"
    head = f"[{index}] {stage.strategy} {_WHERE[stage.placement]} {target}"
    lines = [head]
    if stage.reason:
        lines.append(f"    why: {stage.reason}")
    if stage.tables:
        lines.append(f"    shards of: {', '.join(stage.tables)}")
    if stage.inputs:
        lines.append(f"    reads earlier results: {', '.join(stage.inputs)}")
    lines.append("    fragment:" if stage.placement == "shards" else "    sql:")
    lines.extend(_indent(stage.sql))
    if stage.merge_sql is not None:
        lines.append(f"    merge on the {stage.merge_on}:")
        lines.extend(_indent(stage.merge_sql))
    elif stage.placement == "shards":
        lines.append("    merge: concatenate")
    return lines


def _indent(sql: str) -> list[str]:
    try:
        pretty = sqlglot.transpile(sql, read=DIALECT, write=DIALECT, pretty=True)[0]
    except RecursionError:  # nested too deeply to parse again: shown as planned
        pretty = sql
    return ["      " + line for line in pretty.splitlines()]
