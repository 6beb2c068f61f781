"""The planner's output: a distributed plan as plain, serialisable data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shardflow.catalog.model import Group, Unit

Placement = Literal["shards", "worker", "client"]
"""Where a stage's SQL runs: on every worker over its shards, on one worker, on the client."""

PARTIALS = "__sf_partials"
"""The name under which a merge sees the concatenated fragment results."""

TEMP_PREFIX = "__sf_t"

WHOLE = "whole query"
"""The strategy of a stage that runs a query as written on the one worker holding every
shard it reads: exact only while that worker runs it in one fragment, so the executor
refuses its answer if the shards were on more than one worker by then
(:class:`shardflow.runtime.query.executor.PlanOutdated`)."""


@dataclass(frozen=True)
class KeyTerm:
    """A conjunct of a fragment's WHERE that compares ``table``'s distribution key with
    constants: every row has one of ``values`` (each the constant's text and whether it is
    a string literal). Kept in the plan so a plan bound to other constants
    (:mod:`shardflow.sql.shapes`) recomputes its buckets without parsing."""

    table: str
    values: tuple[tuple[str, bool], ...]


@dataclass(frozen=True)
class Stage:
    """One step of a plan.

    ``sql`` runs where ``placement`` says. For ``"shards"`` it runs on every worker owning
    units of ``group`` with the worker's shards of ``tables`` bound under their table names;
    the results are concatenated and, when ``merge_sql`` is set, finished by it over
    :data:`PARTIALS` (on the client, or on one worker when ``merge_on == "worker"`` because
    the merge reads replicated tables). Every stage sees replicated tables and the outputs of
    the earlier stages it lists in ``inputs``. Its own result is visible to later stages as
    ``output``; the last stage's result is the query's answer.
    """

    output: str
    sql: str
    placement: Placement
    strategy: str
    reason: str = ""
    group: str | None = None
    tables: tuple[str, ...] = ()
    inputs: tuple[str, ...] = ()
    merge_sql: str | None = None
    merge_on: Literal["client", "worker"] = "client"
    buckets: tuple[int, ...] | None = None
    """For ``"shards"``: the only buckets its rows can come from (the key equals constants,
    :mod:`shardflow.sql.pruning`); None: any bucket."""
    key_terms: tuple[KeyTerm, ...] = ()
    """The comparisons of a key with constants that ``buckets`` was computed from."""

    def units_to_run(self, group: Group) -> list[Unit]:
        """The units of ``group`` this stage runs on: every one, or those owning
        ``buckets`` (a routed query)."""
        if self.buckets is None:
            return list(group.units)
        return [u for u in group.units if any(u.lo <= b < u.hi for b in self.buckets)]


@dataclass(frozen=True)
class DistributedPlan:
    sql: str
    stages: tuple[Stage, ...]

    @property
    def result(self) -> Stage:
        return self.stages[-1]

    @property
    def pushdown(self) -> str:
        """A one-word summary of how much of the query runs on the shards."""
        strategies = {s.strategy for s in self.stages}
        if strategies <= {"replicated"}:
            return "replicated"
        if "gather" in strategies:
            return "partial"
        return "full"
