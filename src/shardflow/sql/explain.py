"""Human-readable rendering of a distributed plan: per stage, where it runs and why."""

from __future__ import annotations

import sqlglot

from shardflow.catalog import Catalog
from shardflow.sql.parse import DIALECT
from shardflow.sql.plan import WHOLE, DistributedPlan, Stage

_WHERE = {
    "shards": "on every worker, over its shards",
    "worker": "on one worker (replicated data)",
    "client": "on the client",
}


def explain(plan: DistributedPlan, catalog: Catalog | None = None) -> str:
    """The plan as text; with ``catalog``, a routed stage names the shards it runs on now."""
    lines = [f"Distributed plan: {len(plan.stages)} stage(s), pushdown: {plan.pushdown}"]
    for index, stage in enumerate(plan.stages, start=1):
        lines.extend(_stage_lines(index, stage, catalog))
    return "\n".join(lines)


def _router(stage: Stage, catalog: Catalog | None) -> str:
    assert stage.buckets is not None
    group = catalog.groups.get(stage.group or "") if catalog is not None else None
    if group is None:
        return f"    router: bucket(s) {', '.join(map(str, stage.buckets))} only"
    units = stage.units_to_run(group)
    nodes = ", ".join(sorted({u.node for u in units}))
    return f"    router: {len(units)} shard{'s' if len(units) != 1 else ''} ({nodes})"


def _stage_lines(index: int, stage: Stage, catalog: Catalog | None = None) -> list[str]:
    target = f"-> {stage.output}" if stage.output else "-> result"
    where = _WHERE[stage.placement] if stage.strategy != WHOLE else "on the worker of its shards"
    head = f"[{index}] {stage.strategy} {where} {target}"
    lines = [head]
    if stage.reason:
        lines.append(f"    why: {stage.reason}")
    if stage.tables:
        lines.append(f"    shards of: {', '.join(stage.tables)}")
    if stage.buckets is not None:
        lines.append(_router(stage, catalog))
    if stage.inputs:
        lines.append(f"    reads earlier results: {', '.join(stage.inputs)}")
    lines.append("    fragment:" if stage.placement == "shards" else "    sql:")
    lines.extend(_indent(stage.sql))
    if stage.merge_sql is not None:
        lines.append(f"    merge on the {stage.merge_on}:")
        lines.extend(_indent(stage.merge_sql))
    elif stage.placement == "shards" and stage.strategy != WHOLE:
        lines.append("    merge: concatenate")
    return lines


def _indent(sql: str) -> list[str]:
    try:
        pretty = sqlglot.transpile(sql, read=DIALECT, write=DIALECT, pretty=True)[0]
    except RecursionError:  # nested too deeply to parse again: shown as planned
        pretty = sql
    return ["      " + line for line in pretty.splitlines()]
