"""The session's runner (an ``executor.Runner``): each stage's fragments go to the workers
the session's routing names, retried with fresh routing where a worker answers ``Moved`` or
is gone. A stage whose result comes back to the client and whose inputs the client holds
asks each worker over its fast lane; any other goes through the session's
:class:`~shardflow.runtime.query.fragments.FragmentCalls` (on Ray, the results stay in the
object store for the workers of a later stage)."""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import Protocol, TypeVar

import pyarrow as pa

from shardflow.catalog import Catalog, Group
from shardflow.config import Settings
from shardflow.errors import Changed, Error, QueryError, Retryable
from shardflow.runtime.client.retry import Unfinished, submit_all
from shardflow.runtime.fastlane import LaneBook, LaneBroken
from shardflow.runtime.query.executor import FragmentResult, Materialized, Output
from shardflow.runtime.query.fragments import FragmentCalls
from shardflow.sql import Stage
from shardflow.sql.plan import WHOLE

log = logging.getLogger(__name__)
T = TypeVar("T")
LANE_INPUTS_BYTES = 8 << 20
"""Inputs the client holds (what it merged of an earlier stage) up to this size go to each
worker with the fragment over its fast lane; bigger ones go through the fragment calls
(on Ray: put in the object store once and read from there by every worker)."""


class RunnerHost(Protocol):
    """What the runner needs of its session."""

    @property
    def catalog(self) -> Catalog:
        """The routing snapshot (refreshed between attempts)."""
        ...

    @property
    def settings(self) -> Settings: ...
    @property
    def lanes(self) -> LaneBook: ...
    @property
    def profiling(self) -> bool: ...
    @property
    def results_held(self) -> threading.Event: ...
    @property
    def results_released(self) -> threading.Event: ...
    @property
    def results_held_on(self) -> list[str]: ...
    def retrying(self, what: str, attempt: Callable[[], T]) -> T:
        """Run ``attempt`` until it returns, with fresh routing between attempts."""
        ...

    def pick_node(self) -> str:
        """The node to run a step over replicated tables on (round robin)."""
        ...


class RoutedRunner:
    """Runs one query's fragments for a session, every one at the tables' commits of the
    routing the query began with (``Changed`` where a table was truncated since: the
    session runs the query again whole)."""

    def __init__(self, session: RunnerHost, calls: FragmentCalls) -> None:
        self.session = session
        self.calls = calls
        self.begun_at = session.catalog
        """The routing the query began with: its tables' commits hold for every stage."""

    def commits(self, stage_tables: Iterable[str]) -> dict[str, int]:
        """The commits a fragment reads at: those of its stage's tables and of every
        replicated table (any stage may read one), as the query began; ``Changed`` where
        the routing has another one now (refreshed after a ``Moved``)."""
        begun, now = self.begun_at, self.session.catalog
        names = {*stage_tables, *(s.name for s in begun.replicated_tables())}
        commits = {}
        for name in names:
            spec = begun.tables.get(name)
            if spec is None:
                continue
            current = now.tables.get(name)
            if current is not None and current.commit != spec.commit:
                raise Changed(name, spec.commit, current.commit)
            commits[name] = spec.commit
        return commits

    def scatter(
        self, stage: Stage, inputs: Mapping[str, Output], final: bool = False
    ) -> list[FragmentResult]:
        session = self.session
        # the results come here (the answer's, or partials merged here): over the lanes,
        # inputs sent along; the answer's parts of a scan came through Ray's object store
        # 2.5-4.5 times slower (TPC-H SF 1 lineitem, 4 workers: 2.2-4.6 s against ~1 s).
        # ``test_hold_results_s`` keeps every stage's results on the workers, as it says
        here = _answered_on_the_client(stage) or (
            final and not session.settings.test_hold_results_s
        )
        sent = _on_the_client(inputs) if here else None
        results: list[FragmentResult] = []
        assert stage.group is not None
        pending: set[int] | None = None

        def attempt() -> None:
            nonlocal pending
            catalog = session.catalog
            commits = self.commits(stage.tables)
            group, current = stage_units(stage, catalog)
            if pending is None or pending - current:
                # first attempt, or a split/merge replaced units still to do: the parts
                # done so far may overlap the new units, so the stage starts over
                results.clear()
                pending = current
            by_node = units_by_node(group, pending)
            direct = (
                self._direct(stage.sql, by_node, stage.tables, catalog.epoch, sent, commits)
                if sent is not None
                else None
            )
            if direct is not None:
                failed = None
                for node, outcome in direct.items():
                    if isinstance(outcome, FragmentResult):
                        results.append(outcome)
                        pending -= set(by_node[node])
                    elif isinstance(outcome, LaneBroken):  # asked the other way next attempt
                        session.lanes.broken(node, outcome)
                    elif isinstance(outcome, Retryable):
                        log.info("fragment retried after %s failed: %s", node, outcome)
                    else:  # the query's own error
                        failed = failed or outcome
                if failed is not None:
                    raise failed
                if pending:
                    raise Unfinished(f"{len(pending)} unit(s) of the stage still to run")
                return
            calls = submit_all(
                {
                    node: partial(
                        self.calls.submit,
                        node,
                        stage.sql,
                        {t: units for t in stage.tables},
                        catalog.epoch,
                        inputs,
                        session.profiling,
                        commits,
                    )
                    for node, units in by_node.items()
                }
            )
            for node, call in calls.items():
                try:
                    results.append(call.result())
                except Retryable as error:
                    log.info("fragment retried after %s failed: %s", node, error)
                    continue
                except Error:  # the query's own error: no result of this attempt is read
                    for other in calls.values():
                        other.abandon()
                    raise
                pending -= set(by_node[node])
            if pending:
                raise Unfinished(f"{len(pending)} unit(s) of the stage still to run")

        session.retrying("query", attempt)
        if session.settings.test_hold_results_s:  # tests only: results wait on the workers
            session.results_held_on[:] = sorted(  # those left on the workers, not replied
                {result.worker for result in results if not result.output.held}
            )
            session.results_held.set()
            # until the test let them go (a kill done), or the hold's end: a timer alone ran
            # out before a kill that came late on a busy machine, and nothing was recomputed
            session.results_released.wait(session.settings.test_hold_results_s)
            session.results_held.clear()
        return results

    def _direct(
        self,
        sql: str,
        work: Mapping[str, list[int]],
        tables: Iterable[str],
        epoch: int,
        inputs: Mapping[str, pa.Table],
        commits: Mapping[str, int],
    ) -> dict[str, FragmentResult | Exception] | None:
        """Each node's fragment (over its units of ``tables``, ``inputs`` sent along) asked
        over its fast lane, all at once: its result, or what it raised (the worker's own
        errors, :class:`LaneBroken` where the lane failed). None where a node has no lane:
        the stage goes through the fragment calls."""
        session = self.session
        addresses = {node: session.lanes.address(node) for node in work}
        if any(address is None for address in addresses.values()):
            return None

        def ask(node: str) -> FragmentResult:
            address = addresses[node]
            assert address is not None
            submitted = time.time()
            bindings = {table: work[node] for table in tables}
            table, stats = session.lanes.lanes.execute(
                address, sql, bindings, epoch, session.profiling, inputs, commits
            )
            output = Materialized(table)
            return FragmentResult(
                output, node, stats.seconds, stats.rows_out, stats, submitted, via="fast lane"
            )

        if len(work) == 1:
            return {node: _outcome(partial(ask, node)) for node in work}
        asked = {node: session.lanes.pool.submit(ask, node) for node in work}
        return {node: _outcome(future.result) for node, future in asked.items()}

    def run_on_worker(self, sql: str, inputs: Mapping[str, Output]) -> FragmentResult:
        session = self.session
        sent = _on_the_client(inputs)

        def attempt() -> FragmentResult:
            node = session.pick_node()
            commits = self.commits(())
            direct = None if sent is None else self._direct(sql, {node: []}, (), 0, sent, commits)
            if direct is not None:  # inputs the client holds: over the node's lane
                outcome = direct[node]
                if isinstance(outcome, FragmentResult):
                    return outcome
                if not isinstance(outcome, LaneBroken):
                    raise outcome  # retried (moved, gone), or the query's own error
                session.lanes.broken(node, outcome)
            call = self.calls.submit(node, sql, {}, 0, inputs, session.profiling, commits)
            return call.result()

        return session.retrying("query", attempt)


def stage_units(stage: Stage, catalog: Catalog) -> tuple[Group, set[int]]:
    """The group ``stage`` runs over in ``catalog`` and the units of it it runs on;
    ``QueryError`` where its tables were dropped."""
    group = catalog.groups.get(stage.group or "")
    if group is None:
        raise QueryError("a table of the query was dropped while it ran")
    return group, {u.unit_id for u in stage.units_to_run(group)}


def units_by_node(group: Group, units: set[int]) -> dict[str, list[int]]:
    """``units`` of ``group`` by the node that owns each."""
    by_node: dict[str, list[int]] = defaultdict(list)
    for unit in group.units:
        if unit.unit_id in units:
            by_node[unit.node].append(unit.unit_id)
    return by_node


def _outcome(call: Callable[[], T]) -> T | Exception:
    try:
        return call()
    except Exception as error:
        return error


def _answered_on_the_client(stage: Stage) -> bool:
    """Whether the stage's result goes to the client (a routed stage's few rows, partials
    the client merges, or the answer of a query run whole on one worker) rather than to
    workers of a later stage, which read it from where it was left."""
    if stage.buckets is not None or stage.strategy == WHOLE:
        return True
    return stage.merge_sql is not None and stage.merge_on == "client"


def _on_the_client(inputs: Mapping[str, Output]) -> dict[str, pa.Table] | None:
    """The inputs as tables, where the client holds every one and they are small enough to
    send along with the fragment (:data:`LANE_INPUTS_BYTES`); else None."""
    tables: dict[str, pa.Table] = {}
    size = 0
    for name, value in inputs.items():
        if not value.held:
            return None  # on the workers still: they read it from where it was left
        tables[name] = value.table()
        size += tables[name].nbytes
        if size > LANE_INPUTS_BYTES:
            return None
    return tables
