"""Runs a distributed plan stage by stage; where fragments run is an injected :class:`Runner`
(Ray workers in a session, in-memory shards in tests)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import pyarrow as pa

from shardflow.engine import DuckDBEngine
from shardflow.sql import PARTIALS, DistributedPlan, Stage


@dataclass(frozen=True)
class FragmentResult:
    table: pa.Table
    worker: str
    seconds: float
    """Execution time of the fragment on the worker (queue wait and transfer excluded)."""


class Runner(Protocol):
    def scatter(self, stage: Stage, inputs: Mapping[str, pa.Table]) -> list[FragmentResult]:
        """Run ``stage.sql`` on every worker owning units of ``stage.group``."""
        ...

    def run_on_worker(self, sql: str, inputs: Mapping[str, pa.Table]) -> FragmentResult:
        """Run ``sql`` on one worker, which sees replicated tables and ``inputs``."""
        ...


@dataclass
class StageReport:
    strategy: str
    placement: str
    fragments: list[FragmentResult] = field(default_factory=list)
    merge_seconds: float = 0.0
    wall_seconds: float = 0.0
    rows: int = 0

    @property
    def shard_seconds(self) -> float:
        return sum(f.seconds for f in self.fragments)


@dataclass
class ExecutionReport:
    pushdown: str = ""
    """How much of the plan runs next to the data: "full", "partial" or "replicated"."""
    plan_seconds: float = 0.0
    stages: list[StageReport] = field(default_factory=list)
    wall_seconds: float = 0.0

    @property
    def worker_share(self) -> float:
        """Fraction of execution time spent on the workers, next to the data (fragments on
        shards and steps over replicated tables), rather than in merges on the client."""
        on_workers = sum(s.shard_seconds for s in self.stages)
        on_client = sum(s.merge_seconds for s in self.stages)
        total = on_workers + on_client
        return on_workers / total if total > 0 else 0.0


def concat(tables: list[pa.Table]) -> pa.Table:
    if len(tables) == 1:
        return tables[0]
    return pa.concat_tables(tables, promote_options="permissive")


def execute(
    plan: DistributedPlan, runner: Runner, engine: DuckDBEngine
) -> tuple[pa.Table, ExecutionReport]:
    report = ExecutionReport(pushdown=plan.pushdown)
    results: dict[str, pa.Table] = {}
    started = time.perf_counter()
    for stage in plan.stages:
        stage_started = time.perf_counter()
        inputs = {name: results[name] for name in stage.inputs}
        stage_report = StageReport(stage.strategy, stage.placement)
        if stage.placement == "shards":
            fragments = runner.scatter(stage, inputs)
            stage_report.fragments = fragments
            output = concat([f.table for f in fragments])
            if stage.merge_sql is not None:
                merge_started = time.perf_counter()
                tables = {PARTIALS: output, **inputs}
                if stage.merge_on == "client":
                    output = engine.run(stage.merge_sql, tables)
                else:
                    output = runner.run_on_worker(stage.merge_sql, tables).table
                stage_report.merge_seconds = time.perf_counter() - merge_started
        elif stage.placement == "worker":
            fragment = runner.run_on_worker(stage.sql, inputs)
            stage_report.fragments = [fragment]
            output = fragment.table
        else:
            merge_started = time.perf_counter()
            output = engine.run(stage.sql, inputs)
            stage_report.merge_seconds = time.perf_counter() - merge_started
        stage_report.rows = output.num_rows
        stage_report.wall_seconds = time.perf_counter() - stage_started
        report.stages.append(stage_report)
        results[stage.output] = output
    report.wall_seconds = time.perf_counter() - started
    return results[plan.result.output], report
