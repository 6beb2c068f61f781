"""The client session: plans queries, scatters their fragments straight to the workers,
merges; routes inserts to shard owners; loads and drops tables; asks the coordinator for
cluster operations and reports. It caches the routing of the tables it uses (a partial
catalog, ``Catalog.routing``), learns a table's the first time a query or insert names it,
refreshes it when a worker answers ``Moved`` or dies, then retries what failed.

It speaks to the coordinator and the workers through the protocol only
(``runtime/protocol/``), over whatever :class:`Backend` it is given: Ray
(``client/backend.py``) or this process (``runtime/inprocess.py``)."""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any, Protocol, TypeVar

import numpy as np
import pyarrow as pa

from shardflow.catalog import Catalog, TableSpec
from shardflow.catalog.grants import Grant
from shardflow.config import Settings
from shardflow.engine import DuckDBEngine
from shardflow.errors import (
    Changed,
    ClusterError,
    Error,
    ResultLost,
    Retryable,
    UnknownShardError,
    UnknownTableError,
)
from shardflow.records import AnswerPart
from shardflow.runtime import wire
from shardflow.runtime.client.changes import RowChanger
from shardflow.runtime.client.endpoints import reserve_parts
from shardflow.runtime.client.loads import Loader, Progress
from shardflow.runtime.client.retry import Unfinished, retrying, submit_all
from shardflow.runtime.client.runner import RoutedRunner
from shardflow.runtime.client.streams import AnswerStream, open_stream
from shardflow.runtime.client.tally import Tally
from shardflow.runtime.fastlane import LaneBook
from shardflow.runtime.protocol import (
    Coordinator,
    DrainReport,
    NodeLoad,
    Reply,
    ShardKey,
    SharedRows,
    Worker,
    WorkerInfo,
    Workers,
    admit_workers,
)
from shardflow.runtime.query.executor import ExecutionReport, PlanOutdated
from shardflow.runtime.query.fragments import FragmentCalls
from shardflow.runtime.query.planning import Binder, PlanCache, PlannedQuery, answer
from shardflow.runtime.wire import check_peer
from shardflow.runtime.worker.local import local_folder
from shardflow.sql import explain
from shardflow.sql.parse import named_tables
from shardflow.sql.statements import (
    ChangeRows,
)
from shardflow.storage.conform import conform
from shardflow.storage.partition import buckets_for, route, tagged_with_units

log = logging.getLogger(__name__)
T = TypeVar("T")
QUERY_ATTEMPTS = 3
"""Times a query runs again when its intermediate results were lost, or when it is planned
again because its shards moved under a plan made for one worker."""


class Backend(Protocol):
    """What a session runs on: the coordinator and workers of one cluster, how a query's
    fragments reach them, and how a worker is started."""

    @property
    def settings(self) -> Settings: ...
    @property
    def coordinator(self) -> Coordinator: ...
    @property
    def workers(self) -> Workers: ...
    def fragment_calls(self) -> FragmentCalls:
        """How one query's fragments reach the workers when not over a fast lane."""
        ...

    def start_worker(self, node: str, slowdown: float) -> Worker:
        """Start a worker for the new node ``node`` (``slowdown`` above 1: a simulated slower
        device)."""
        ...


class Session:
    """One client of the cluster: it plans and runs queries, inserts, loads and drops tables
    through the workers, and asks the coordinator for cluster operations and reports."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.coordinator = backend.coordinator
        self.workers = backend.workers
        self.settings = backend.settings
        self.engine = DuckDBEngine(temp_directory=local_folder(self.settings.local_dir, "client"))
        """Merges stage results; big merges spill to ``local_dir`` (never the current
        directory)."""
        self._lock = threading.Lock()
        self._round_robin = itertools.count()
        self._binder = Binder(self.engine)
        self._plans = PlanCache(self._binder, self.settings.plan_cache_size)
        self._tally = Tally(self.coordinator.record_outcomes)
        self.closed = threading.Event()
        """Set by :meth:`close`: retries stop, and calls in flight end."""
        self.results_held = threading.Event()
        """Tests only (``test_hold_results_s``): set while a stage's results wait on the
        workers, so a test kills a node holding them at the right moment."""
        self.results_held_on: list[str] = []
        """Tests only: the nodes whose workers hold the results while ``results_held``."""
        self.results_released = threading.Event()
        """Tests only: set by the test once it killed the node; the results held are read
        then (or at the end of ``test_hold_results_s``, whichever comes first)."""
        self.profiling = self.settings.profile_queries
        """Collect per-fragment timings and sizes (``db.profile`` turns it on for its query)."""
        self.lanes = LaneBook(self.workers, self.settings.fast_lane)
        """The workers' fast lanes (``fast_lane``)."""
        self._loader = Loader(
            self.coordinator, self.workers, self.lanes, self.settings, self.closed
        )
        self.catalog = Catalog()
        """The routing of the tables this session has used (not every table's)."""
        self._changer = RowChanger(self, self._binder)
        self._fetching = threading.Lock()
        self._fetches = (0, 0)
        """Routing fetches started, and the number of the last one answered."""
        self.refresh()
        # the coordinator's release must be one this session serves beside (N and N-1)
        speaks = int(self._read("the coordinator's protocol", lambda c: c.ping()))
        check_peer(speaks, "the coordinator", here="session", ours=wire.PROTOCOL)

    # -- routing ------------------------------------------------------------------------
    def refresh(self, more: Iterable[str] = ()) -> Catalog:
        """Fetch the routing of the tables this session uses, and of ``more`` (names as a
        user wrote them; those the cluster does not have are left out). One fetch at a
        time: each asks for every table learned before it, and a caller that waited while
        a fetch started after it asked takes that one's answer."""
        more = list(more)
        with self._lock:
            ticket = self._fetches[0]
        with self._fetching:
            with self._lock:
                started, answered = self._fetches
                if answered > ticket and all(self.catalog.find_table(n) for n in more):
                    return self.catalog
                self._fetches = (started + 1, answered)
                wanted = sorted({*self.catalog.tables, *more})
            found = self._read("the routing", lambda c: c.catalog(wanted))
            catalog = Catalog.from_json(found)
            with self._lock:
                self._fetches = (self._fetches[0], started + 1)
                if catalog.version >= self.catalog.version:
                    self.catalog = catalog
                return self.catalog

    def whole(self) -> Catalog:
        """The catalog with every table: for listings (``db.tables()``, shards, nodes) and
        checks of names, not kept for routing."""
        return Catalog.from_json(self._read("the catalog", lambda c: c.catalog()))

    def retrying(self, what: str, attempt: Callable[[], T]) -> T:
        """Work on the workers, retried with fresh routing (see :func:`retry.retrying`)."""
        return retrying(
            what,
            attempt,
            self.settings.retry_deadline_s,
            self.refresh,
            self.closed,
            lambda: self.catalog.version,
        )

    def pick_node(self) -> str:
        """A serving node, round robin (for steps over replicated tables)."""
        nodes = self.catalog.serving
        return nodes[next(self._round_robin) % len(nodes)]

    def table_spec(self, name: str) -> TableSpec:
        if not isinstance(name, str):
            raise UnknownTableError(f"a table name must be a string, not {type(name).__name__}")
        spec = self.catalog.find_table(name)
        if spec is None:
            spec = self.refresh([name]).find_table(name)
        if spec is None:
            known = ", ".join(sorted(self.whole().tables)) or "none yet"
            raise UnknownTableError(f"unknown table {name!r} (tables: {known})")
        return spec

    # -- the coordinator ----------------------------------------------------------------
    def _read(self, what: str, call: Callable[[Coordinator], Reply[T]]) -> T:
        """A call that only reads the coordinator's state, retried while the coordinator
        restarts (up to ``retry_deadline_s``): a restart must not fail a query or a look."""

        def attempt() -> T:
            return call(self.coordinator).get()

        return retrying(
            f"reading {what}", attempt, self.settings.retry_deadline_s, closed=self.closed
        )

    def _change(
        self, what: str, call: Callable[[Coordinator], Reply[T]], timeout: float | None = None
    ) -> T:
        """A call that changes the coordinator's state: not retried, as a restart finishes
        or rolls back what it was doing (the error says where to look)."""
        try:
            result = call(self.coordinator).get(timeout)
        except Retryable as error:
            raise ClusterError(
                f"the coordinator restarted during {what}; it finished or rolled back what "
                f"was in progress (see db.cluster.migrations()): {error}"
            ) from None
        self.refresh()
        return result

    # -- queries ------------------------------------------------------------------------
    def plan(self, sql: str) -> PlannedQuery:
        """``sql``'s plan; the routing of a table it names that this session has not used
        yet is fetched first (a name the cluster does not have either is the error it was,
        said against every table)."""
        for _ in range(QUERY_ATTEMPTS):
            try:
                return self._plans.plan(sql, self.catalog)
            except UnknownTableError as error:
                known = set(self.catalog.tables)
                if set(self.refresh(named_tables(sql, error)).tables) == known:
                    # the cluster has no such table either: the error, naming every table
                    # (or a plan, if it was made just now: then its routing is fetched)
                    self._plans.plan(sql, self.whole())
        return self._plans.plan(sql, self.catalog)

    def query(
        self, sql: str, planned: PlannedQuery | None = None
    ) -> tuple[pa.Table, ExecutionReport]:
        """``sql``'s answer (``planned``: its plan, made just before by the caller)."""
        started = time.perf_counter()
        try:
            answer = self._query(sql, planned)
        except Error:
            self._tally.query(time.perf_counter() - started, False)
            raise
        self._tally.query(time.perf_counter() - started, True)
        return answer

    def endpoints(
        self, sql: str, user: str, credential: str, tls: bool
    ) -> tuple[pa.Schema, list[AnswerPart]] | None:
        """``sql``'s answer reserved in parts on the workers (``runtime/client/endpoints.py``)."""
        return reserve_parts(self, sql, user, credential, tls)

    def stream(self, sql: str) -> AnswerStream:
        """``sql``'s answer as it arrives (``runtime/client/streams.py``)."""
        return open_stream(self, sql)

    def fragment_calls(self) -> FragmentCalls:
        return self.backend.fragment_calls()

    def tally_query(self, seconds: float, ok: bool) -> None:
        """Count a query's outcome in the coordinator's metrics."""
        self._tally.query(seconds, ok)

    def _query(
        self, sql: str, planned: PlannedQuery | None = None
    ) -> tuple[pa.Table, ExecutionReport]:
        planning_started = time.perf_counter()
        if planned is None:
            planned = self.plan(sql)
        planning = time.perf_counter() - planning_started  # ~0 when the plan was cached
        lost = outdated = changed = 0
        while True:
            try:
                catalog = self.catalog
                runner = RoutedRunner(self, self.backend.fragment_calls())
                result, report, answered = answer(sql, planned, catalog, runner, self.engine)
                if answered is not planned:  # gathered whole from now on
                    self._plans.replace(sql, catalog, answered)
                break
            except ResultLost:
                # an intermediate result died with its node: run the whole plan again
                lost += 1
                if lost == QUERY_ATTEMPTS:
                    raise ClusterError("intermediate results were lost repeatedly") from None
                self.refresh()
            except Changed as error:
                # a table was truncated while the query ran: parts read before it must not
                # meet parts read after it, so the whole query runs again at the new commit
                changed += 1
                if changed == QUERY_ATTEMPTS:
                    raise ClusterError(f"the query's tables kept changing: {error}") from None
                self.refresh([error.table])
            except PlanOutdated:
                # planned whole on one worker, its shards were on several by the time it ran
                outdated += 1
                if outdated == QUERY_ATTEMPTS:
                    raise ClusterError("the query's shards kept moving while it ran") from None
                self.refresh()
                planned = self.plan(sql)
        report.plan_seconds = planning
        report.reruns = lost
        report.replans = outdated
        return result, report

    def explain(self, sql: str) -> str:
        return explain(self.plan(sql).plan, self.catalog)

    # -- inserts ------------------------------------------------------------------------
    def insert(self, name: str, data: object, batch_id: str | None = None) -> int:
        spec = self.table_spec(name)
        table = conform(data, spec.schema, name)
        if table.num_rows == 0:
            return 0
        # a caller's batch id (any text) becomes a hex id: the same id is the same batch
        batch_id = uuid.uuid4().hex if batch_id is None else _hex_id(batch_id)
        if spec.kind == "replicated":
            self._insert_replicated(spec, table, batch_id)
        else:
            self._insert_distributed(spec, table, batch_id)
        rows = int(table.num_rows)
        self._tally.insert(rows)
        return rows

    def record_access(self, denied_action: str | None) -> None:
        """Count a refused service call in the coordinator's /metrics (not waited for)."""
        self.coordinator.record_access(denied_action)

    def _insert_distributed(self, spec: TableSpec, table: pa.Table, batch_id: str) -> None:
        # every row's bucket is fixed once: a retry after a split or merge re-routes the same
        # rows with the same buckets, and each shard drops the buckets of the batch it holds
        salt = int(batch_id[:8], 16)
        whole = (table, buckets_for(table, spec, self.catalog.n_buckets, salt))
        pending = [whole]
        placed_at = spec.commit
        """The table's commit the parts placed so far went to: where it changes (the table
        was truncated) every part is placed again, or only some of the batch would stay."""

        def attempt() -> None:
            nonlocal placed_at
            catalog = self.catalog
            now = catalog.table(spec.name).commit
            if now != placed_at:
                pending[:] = [whole]
                placed_at = now
            rows = pa.concat_tables([t for t, _ in pending])
            buckets = np.concatenate([b for _, b in pending])
            pending.clear()
            group = catalog.group_of(spec.name)
            by_node: dict[str, dict[int, tuple[pa.Table, np.ndarray]]] = defaultdict(dict)
            routed = tagged_with_units(route(rows, buckets, catalog, group.group_id))
            for unit_id, part in routed.items():
                by_node[group.unit(unit_id).node][unit_id] = part
            append = partial(self._append, table=spec.name, batch_id=batch_id,
                             epoch=catalog.epoch, commit=now)  # fmt: skip
            replies = submit_all(
                {node: partial(append, node, parts=parts) for node, parts in by_node.items()}
            )
            for node in by_node.keys() - replies.keys():  # its worker is gone: route again
                pending.extend(by_node[node].values())
            failed: Exception | None = None
            changed = False
            for node, reply in replies.items():  # every reply read, whatever the first says
                try:
                    reply.get()
                except Retryable as error:
                    log.info("insert into %s retried on %s: %s", spec.name, node, error)
                    pending.extend(by_node[node].values())
                except Changed as error:  # truncated meanwhile: the whole batch again
                    log.info("insert into %s placed again: %s", spec.name, error)
                    changed = True
                except Exception as error:  # the insert's own error (a full disk): raised
                    failed = failed or error  # once the other parts have answered
            if failed is not None:
                raise failed
            if changed:  # placed again, at the commit the refreshed routing has
                pending[:] = [whole]
                raise Unfinished(f"{spec.name} was truncated under the insert")
            if pending:
                raise Unfinished(f"{len(pending)} part(s) of the insert to place again")

        self.retrying(f"insert into {spec.name}", attempt)

    def _append(
        self,
        node: str,
        table: str,
        parts: Mapping[int, tuple[pa.Table, np.ndarray]],
        batch_id: str,
        epoch: int,
        commit: int,
    ) -> Reply[Mapping[int, int]]:
        return self.workers.get(node).append(table, parts, batch_id, epoch, commit)

    def _insert_replicated(self, spec: TableSpec, table: pa.Table, batch_id: str) -> None:
        rows = self.workers.share(table)
        for _ in range(QUERY_ATTEMPTS):
            commit = self.catalog.table(spec.name).commit
            primary = self.catalog.primary
            assert primary is not None
            # The primary logs the rows durably first; then every other replica applies them.
            try:
                self._deliver_replica(spec.name, rows, batch_id, [primary], commit)
                others = [n for n in self.catalog.nodes if n != primary]
                self._deliver_replica(spec.name, rows, batch_id, others, commit, True)
                return
            except Changed as error:  # truncated meanwhile: every replica again
                log.info("insert into %s placed again: %s", spec.name, error)
                self.refresh([spec.name])
        raise ClusterError(f"insert into {spec.name}: the table kept being truncated under it")

    def _deliver_replica(
        self,
        table: str,
        rows: SharedRows,
        batch_id: str,
        nodes: list[str],
        commit: int,
        leavers_skipped: bool = False,
    ) -> None:
        """Apply an insert to replicas of ``table`` on ``nodes``, retrying those that fail.
        With ``leavers_skipped``, a node that left the cluster meanwhile needs no copy (the
        primary logged the rows; a node that joins loads them from there)."""
        remaining = list(nodes)

        def attempt() -> None:
            if leavers_skipped:
                remaining[:] = [n for n in remaining if n in self.catalog.nodes]
            replies = submit_all(
                {
                    n: partial(self._append_replica, n, table, rows, batch_id, commit)
                    for n in remaining
                }
            )
            missing = [n for n in remaining if n not in replies]  # worker gone: try again
            remaining.clear()
            remaining.extend(missing)
            for node, reply in replies.items():
                try:
                    reply.get()
                except Retryable:
                    remaining.append(node)
            if remaining:
                raise Unfinished(f"replicas on {', '.join(remaining)} still to update")

        self.retrying(f"insert into {table}", attempt)

    def _append_replica(
        self, node: str, table: str, rows: SharedRows, batch_id: str, commit: int
    ) -> Reply[int]:
        return self.workers.get(node).append_replica(table, rows, batch_id, commit)

    # -- tables -------------------------------------------------------------------------
    def create_table(
        self,
        name: str,
        source: object,
        distributed_by: str | None,
        replicated: bool,
        colocate_with: str | None,
        progress: Progress | None = None,
        key_index: bool = False,
        grants: Sequence[Grant] | None = None,
    ) -> int:
        rows = self._loader.create(
            name, source, distributed_by, replicated, colocate_with, progress, key_index, grants
        )
        self.refresh([name])  # a table made here is one this session will use
        return rows

    def set_grants(self, name: str, grants: Sequence[Grant]) -> None:
        spec = self.table_spec(name)
        catalog = self._change(f"grants of {name}", lambda c: c.set_grants(spec.name, grants))
        # the nodes are told the change as for any table's (a version each must follow)
        self.coordinator.announce(list(catalog["nodes"])).get()

    def access(self, name: str) -> TableSpec | None:
        """The table ``name`` as the coordinator has it now, its owner and grants among
        it (not this session's routing, which may be older): what the service checks a
        call against. None where there is no such table."""
        found = self._read(f"the grants of {name}", lambda c: c.catalog([name]))
        return Catalog.from_json(found).find_table(name)

    def drop_table(self, name: str) -> None:
        self.table_spec(name)
        catalog, uid = self._change(f"drop_table {name}", lambda c: c.drop_table(name))
        # every node is told the change (it lets the table's shards go) before the files go;
        # one that does not answer is sent the catalog whole later, or loads it restarting
        self.coordinator.announce(list(catalog["nodes"])).get()
        self.coordinator.delete_files(uid).get()
        self.refresh()

    def truncate_table(self, name: str) -> int:
        """Empty the table ``name`` at once on every node (``TRUNCATE``); answers the rows
        it held as the truncate began (inserts that race it are emptied too, uncounted).
        A query sees the table whole or empty, never part of each: one that read some of
        it before runs again whole (``Changed``)."""
        spec = self.table_spec(name)
        counted, _ = self.query(f'SELECT count(*) FROM "{spec.name}"')
        self._change(f"truncate {spec.name}", lambda c: c.truncate_table(spec.name))
        return int(counted.column(0)[0].as_py())

    def change_rows(
        self, change: ChangeRows, statement: str | None = None
    ) -> tuple[int, pa.Table | None]:
        """Delete or update rows of a table (``DELETE``, ``UPDATE``) all or nothing across
        its shards (:class:`~shardflow.runtime.client.changes.RowChanger`)."""
        return self._changer.change_rows(change, statement)

    # -- cluster operations -------------------------------------------------------------
    def unit_of(self, shard: str | int) -> int:
        """The unit of a shard named like ``lineitem#3``, checked whole: the table exists, is
        distributed, and unit 3 is one of its shards (a bare unit id must exist)."""
        catalog = self.whole()
        units = {u.unit_id for g in catalog.groups.values() for u in g.units}
        if isinstance(shard, int) and not isinstance(shard, bool):
            if shard not in units:
                raise UnknownShardError(f"no shard unit {shard}; see db.cluster.shards()")
            return shard
        table, _, unit = shard.rpartition("#") if isinstance(shard, str) else ("", "", "")
        if not table or not unit.isdigit():
            raise UnknownShardError(
                f"{shard!r} is not a shard id: use a name like 'lineitem#3' from "
                "db.cluster.shards()"
            )
        spec = catalog.find_table(table)
        if spec is None:
            raise UnknownShardError(f"{shard!r} names no table: there is no table {table!r}")
        if spec.group is None:
            raise UnknownShardError(
                f"{shard!r}: {table} is replicated (a copy on every node); it has no shards"
            )
        own = sorted(u.unit_id for u in catalog.groups[spec.group].units)
        if int(unit) not in own:
            listed = ", ".join(f"{table}#{u}" for u in own)
            raise UnknownShardError(f"{table} has no shard #{unit}; its shards are {listed}")
        return int(unit)

    def migrate(self, unit_id: int, to: str) -> dict[str, Any]:
        return self._change("migrate", lambda c: c.migrate(unit_id, to))

    def split(self, unit_id: int) -> dict[str, Any]:
        return self._change("split", lambda c: c.split(unit_id))

    def merge(self, first: int, second: int) -> dict[str, Any]:
        return self._change("merge", lambda c: c.merge(first, second))

    def cancel(self, move_id: str) -> dict[str, Any]:
        return self._change("cancel", lambda c: c.cancel(move_id))

    def pause_balancer(self, paused: bool) -> bool:
        return self._change("pause_balancer", lambda c: c.pause_balancer(paused))

    def rebalance(self, dry_run: bool) -> dict[str, Any]:
        if dry_run:  # only looks: retried while the coordinator restarts
            return self._read("a rebalancing plan", lambda c: c.rebalance(True))
        return self._change("rebalance", lambda c: c.rebalance(False))

    def add_node(self, slowdown: float = 1.0) -> str:
        node = self._change("reserve_node", lambda c: c.reserve_node())
        worker = self.backend.start_worker(node, slowdown)
        try:
            admit_workers([worker], None)  # started, replicated tables loaded, calibrated
        except BaseException:  # it never serves (one of another release, refused)
            self.workers.stop(node)
            raise
        self._change("node_joined", lambda c: c.node_joined(node))
        return node

    def drain(self, node: str, deadline_s: float) -> DrainReport:
        result = self._change("drain", lambda c: c.drain(node, deadline_s))
        if result.drained:
            self.workers.stop(node)
        return result

    def cancel_drain(self, node: str) -> bool:
        return self._change("cancel_drain", lambda c: c.cancel_drain(node))

    def coordinator_host(self) -> str:
        return self._read("the coordinator's node", lambda c: c.host())

    def drain_host(self, ray_node_id: str, deadline_s: float) -> list[DrainReport]:
        return self._change("drain_host", lambda c: c.drain_host(ray_node_id, deadline_s))

    # -- reporting ----------------------------------------------------------------------
    def migrations(self) -> list[dict[str, Any]]:
        return self._read("the migrations", lambda c: c.migrations())

    def failovers(self) -> list[dict[str, Any]]:
        return self._read("the failovers", lambda c: c.failovers())

    def metrics_url(self) -> str:
        return self._read("the metrics address", lambda c: c.metrics_url())

    def node_loads(self) -> dict[str, NodeLoad]:
        return self._read("the node loads", lambda c: c.node_loads())

    def shard_loads(self) -> dict[ShardKey, float]:
        return self._read("the shard loads", lambda c: c.shard_loads())

    def worker_infos(self) -> dict[str, WorkerInfo | None]:
        """Every node's report; None for a node whose worker does not answer."""
        catalog = self.refresh()
        replies = submit_all({n: partial(self._info, n) for n in catalog.nodes})
        infos: dict[str, WorkerInfo | None] = {n: None for n in catalog.nodes}
        for node, reply in replies.items():
            try:
                infos[node] = reply.get(timeout=self.settings.retry_deadline_s)
            except Retryable:
                infos[node] = None
        return infos

    def _info(self, node: str) -> Reply[WorkerInfo]:
        return self.workers.get(node).info()

    def close(self) -> None:
        self.closed.set()
        self._tally.close()
        self.lanes.close()
        self.engine.close()


def _hex_id(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]
