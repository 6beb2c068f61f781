"""Runs a distributed plan stage by stage; where fragments run is an injected :class:`Runner`
(the session's, over Ray or in-process workers; in-memory shards in tests).

Stage results are :class:`Output` objects that fetch their rows only when asked: a stage whose
result only feeds later stages on the workers never passes through the client.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import duckdb
import pyarrow as pa

from shardflow.engine import DuckDBEngine, query_error
from shardflow.runtime.protocol import FragmentStats
from shardflow.sql import PARTIALS, DistributedPlan, Stage
from shardflow.sql.plan import WHOLE


class Output(Protocol):
    """A stage's (or fragment's) result, wherever it lives."""

    def table(self) -> pa.Table:
        """Its rows (fetched from where they live, the first time)."""
        ...

    @property
    def held(self) -> bool:
        """Whether this process holds its rows already."""
        ...


@dataclass(frozen=True)
class Materialized:
    """A result held by the client."""

    rows: pa.Table

    def table(self) -> pa.Table:
        return self.rows

    @property
    def held(self) -> bool:
        return True


@dataclass
class Concatenated:
    """The union of fragment results, fetched and concatenated on first use."""

    parts: list[Output]
    _table: pa.Table | None = None

    def table(self) -> pa.Table:
        if self._table is None:
            self._table = concat([part.table() for part in self.parts])
        return self._table

    @property
    def held(self) -> bool:
        return self._table is not None or all(part.held for part in self.parts)


@dataclass(frozen=True)
class FragmentResult:
    output: Output
    worker: str
    seconds: float
    """Execution time of the fragment on the worker (queue wait and transfer excluded)."""
    rows: int
    stats: FragmentStats | None = None
    """What the worker measured (None where nothing was)."""
    submitted_at: float = 0.0
    via: str = ""
    """How the fragment was asked: "ray", "fast lane" ("" in process)."""


class PlanOutdated(Exception):
    """A :data:`~shardflow.sql.plan.WHOLE` stage ran in more than one fragment: its shards
    were no longer on one worker (moved or failed over while the query ran), so its answer
    would be wrong. The caller plans the query again with the catalog as it is now."""


class Runner(Protocol):
    def scatter(
        self, stage: Stage, inputs: Mapping[str, Output], final: bool = False
    ) -> list[FragmentResult]:
        """Run ``stage.sql`` on every worker owning units of ``stage.group`` (``final``:
        the stage's results are the answer, read here, not by a later stage's workers)."""
        ...

    def run_on_worker(self, sql: str, inputs: Mapping[str, Output]) -> FragmentResult:
        """Run ``sql`` on one worker, which sees replicated tables and ``inputs``."""
        ...


@dataclass
class StageReport:
    strategy: str
    placement: str
    fragments: list[FragmentResult] = field(default_factory=list)
    merge_seconds: float = 0.0
    wall_seconds: float = 0.0
    started_at: float = 0.0
    merge_started_at: float | None = None
    merge_on: str | None = None
    rows: int = 0
    sql: str = ""
    """The SQL each fragment of the stage ran (on its own shards)."""
    merge_sql: str = ""

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
    started_at: float = 0.0
    """Wall clock (time.time) when execution began; planning came just before."""
    rows: int = 0
    reruns: int = 0
    """Times the plan ran again because an intermediate result was lost with its node."""
    replans: int = 0
    """Times the query was planned again because the shards of a query planned whole on one
    worker were on several by the time it ran (:class:`PlanOutdated`)."""

    @property
    def worker_share(self) -> float:
        """Fraction of execution time spent on the workers, next to the data (fragments on
        shards and steps over replicated tables), rather than in merges on the client."""
        on_workers = sum(s.shard_seconds for s in self.stages)
        on_client = sum(s.merge_seconds for s in self.stages)
        total = on_workers + on_client
        return on_workers / total if total > 0 else 0.0


def concat(tables: list[pa.Table]) -> pa.Table:
    """The rows of ``tables`` in one table (the one place fragment results are joined up:
    the client's merges and a worker's inputs that came in parts)."""
    if len(tables) == 1:
        return tables[0]
    return pa.concat_tables(tables, promote_options="permissive")


def execute(
    plan: DistributedPlan, runner: Runner, engine: DuckDBEngine
) -> tuple[pa.Table, ExecutionReport]:
    report = ExecutionReport(pushdown=plan.pushdown, started_at=time.time())
    results: dict[str, Output] = {}
    started = time.perf_counter()
    for stage in plan.stages:
        stage_started = time.perf_counter()
        inputs = {name: results[name] for name in stage.inputs}
        stage_report = StageReport(
            stage.strategy,
            stage.placement,
            started_at=time.time(),
            sql=stage.sql,
            merge_sql=stage.merge_sql or "",
        )
        output: Output
        if stage.placement == "shards":
            fragments = runner.scatter(stage, inputs, stage is plan.result)
            if stage.strategy == WHOLE and len(fragments) != 1:
                raise PlanOutdated(f"{len(fragments)} fragments ran a query planned whole")
            stage_report.fragments = fragments
            output = Concatenated([f.output for f in fragments])
            if stage.merge_sql is not None:
                merge_started = time.perf_counter()
                stage_report.merge_started_at = time.time()
                stage_report.merge_on = stage.merge_on
                if stage.merge_on == "client":
                    tables = {PARTIALS: output.table()}
                    tables.update({name: value.table() for name, value in inputs.items()})
                    output = Materialized(_run(engine, stage.merge_sql, tables))
                else:
                    merged = runner.run_on_worker(stage.merge_sql, {PARTIALS: output, **inputs})
                    output = merged.output
                stage_report.merge_seconds = time.perf_counter() - merge_started
        elif stage.placement == "worker":
            fragment = runner.run_on_worker(stage.sql, inputs)
            stage_report.fragments = [fragment]
            output = fragment.output
        else:
            merge_started = time.perf_counter()
            stage_report.merge_started_at = time.time()
            stage_report.merge_on = "client"
            tables = {name: value.table() for name, value in inputs.items()}
            output = Materialized(_run(engine, stage.sql, tables))
            stage_report.merge_seconds = time.perf_counter() - merge_started
        stage_report.wall_seconds = time.perf_counter() - stage_started
        if isinstance(output, Materialized):
            stage_report.rows = output.rows.num_rows
        elif stage.placement == "shards":
            stage_report.rows = sum(f.rows for f in stage_report.fragments)
        else:
            stage_report.rows = stage_report.fragments[0].rows if stage_report.fragments else 0
        report.stages.append(stage_report)
        results[stage.output] = output
    answer = results[plan.result.output].table()
    report.wall_seconds = time.perf_counter() - started
    report.rows = answer.num_rows
    return answer, report


def _run(engine: DuckDBEngine, sql: str, tables: dict[str, pa.Table]) -> pa.Table:
    try:
        return engine.run(sql, tables)
    except duckdb.Error as error:
        raise query_error(error) from None
