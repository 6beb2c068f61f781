"""The client session: plans queries, scatters fragments straight to the workers, merges;
routes inserts to shard owners; loads tables. It caches the routing snapshot (the catalog)
and refreshes it when a worker answers ``Moved`` or dies, then retries what failed."""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import ray

from shardflow.catalog import Catalog, TableSpec, find_name
from shardflow.catalog.buckets import key_family
from shardflow.catalog.types import storage_schema
from shardflow.engine import DuckDBEngine
from shardflow.errors import (
    ClosedError,
    ClusterError,
    Error,
    QueryError,
    Retryable,
    TableError,
    UnknownColumnError,
    UnknownShardError,
    UnknownTableError,
    WorkerTimeout,
)
from shardflow.runtime.cluster import ClusterHandle, next_slot, start_worker
from shardflow.runtime.executor import (
    Concatenated,
    ExecutionReport,
    FragmentResult,
    FragmentStats,
    Materialized,
    Output,
    PlanOutdated,
)
from shardflow.runtime.fastlane import LaneAddress, LaneBroken, Lanes, from_wire, to_wire
from shardflow.runtime.protocol import (
    DrainReport,
    NodeLoad,
    Reply,
    ShardKey,
    SharedRows,
    WorkerInfo,
)
from shardflow.runtime.queries import Binder, PlanCache, PlannedQuery, answer
from shardflow.runtime.ray_workers import RayReply, ResultLost
from shardflow.runtime.worker import REPLICA, local_folder
from shardflow.sql import Stage, explain
from shardflow.sql.plan import WHOLE
from shardflow.storage.conform import conform
from shardflow.storage.partition import buckets_for, route, split_by_unit

if TYPE_CHECKING:
    from ray import ObjectRef

    from shardflow.runtime.ray_workers import CoordinatorHandle

log = logging.getLogger(__name__)
TALLY_INTERVAL_S = 0.25
ABANDON_WAIT_S = 1.0
"""How long a failed query waits for its other fragments' outcomes, only to collect them."""
T = TypeVar("T")
MAX_IN_FLIGHT_LOADS = 8
QUERY_ATTEMPTS = 3
FIRST_RETRY_DELAY_S = 0.05
MAX_RETRY_DELAY_S = 1.0
LANE_THREADS = 32
LANE_INPUTS_BYTES = 8 << 20
"""Inputs the client holds (what it merged of an earlier stage) up to this size go to each
worker with the fragment over its fast lane; bigger ones are put in Ray's object store once
and read from there by every worker."""


class _Again(Exception):
    """Internal: an attempt left work to do (parts whose worker moved or died)."""


def retrying(
    what: str,
    attempt: Callable[[], T],
    deadline_s: float,
    between: Callable[[], object] | None = None,
    closed: threading.Event | None = None,
) -> T:
    """The one retry loop: call ``attempt`` until it returns. What a retry can cure — a
    ``Retryable`` error (a shard moved, a worker or the coordinator gone or slow) or work
    left undone — is tried again after a back-off (50 ms, doubling up to 1 s), with
    ``between`` run before each new attempt (the session refreshes its routing there),
    until ``deadline_s`` (``retry_deadline_s``) has passed, or until ``closed`` is set (the
    session was closed under the call: :class:`ClosedError`)."""
    deadline = time.monotonic() + deadline_s
    delay = FIRST_RETRY_DELAY_S
    while True:
        try:
            return attempt()
        except (Retryable, _Again) as error:
            if closed is not None and closed.is_set():
                raise ClosedError(f"{what}: the database was closed") from error
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"{what}: no success within {deadline_s:g}s (retry_deadline_s): {error};"
                    " check db.cluster.nodes()"
                ) from None
        time.sleep(delay)
        delay = min(delay * 2, MAX_RETRY_DELAY_S)
        if between is not None:
            between()


class Session:
    """One client of the cluster: it plans and runs queries, inserts, loads and drops tables
    through the workers, and asks the coordinator for cluster operations and reports."""

    def __init__(self, handle: ClusterHandle) -> None:
        self.handle = handle
        self.workers = handle.workers
        self.settings = handle.settings
        self.engine = DuckDBEngine(temp_directory=local_folder(self.settings.local_dir, "client"))
        """Merges stage results; big merges spill to ``local_dir`` (never the current
        directory)."""
        self._lock = threading.Lock()
        self._round_robin = itertools.count()
        self._plans = PlanCache(Binder(self.engine), self.settings.plan_cache_size)
        self._tally = Tally(handle.coordinator.record_outcomes.remote)
        self.closed = threading.Event()
        """Set by :meth:`close`: retries stop, and calls in flight end."""
        self.results_held = threading.Event()
        """Tests only (``test_hold_results_s``): set while a stage's results wait on the
        workers, so a test kills a node holding them at the right moment."""
        self.profiling = self.settings.profile_queries
        """Collect per-fragment timings and sizes (``db.profile`` turns it on for its query)."""
        self.lanes = Lanes()
        """Connections to the workers' fast lanes (``fast_lane``)."""
        self.lane_pool = ThreadPoolExecutor(LANE_THREADS, thread_name_prefix="shardflow-lane")
        """Asks the workers of a stage at once over their lanes."""
        self._lane_of: dict[str, tuple[object, LaneAddress | None]] = {}
        self.catalog = Catalog()
        self.refresh()

    # -- routing ------------------------------------------------------------------------
    def refresh(self) -> Catalog:
        found: dict[str, Any] = self._read("the catalog", lambda c: c.catalog.remote())
        catalog = Catalog.from_json(found)
        with self._lock:
            if catalog.version >= self.catalog.version:
                self.catalog = catalog
            return self.catalog

    def _retrying(self, what: str, attempt: Callable[[], T]) -> T:
        """Work on the workers, retried with fresh routing (see :func:`retrying`)."""
        return retrying(what, attempt, self.settings.retry_deadline_s, self.refresh, self.closed)

    def table_spec(self, name: str) -> TableSpec:
        if not isinstance(name, str):
            raise UnknownTableError(f"a table name must be a string, not {type(name).__name__}")
        spec = self.catalog.find_table(name)
        if spec is None:
            spec = self.refresh().find_table(name)
        if spec is None:
            known = ", ".join(sorted(self.catalog.tables)) or "none yet"
            raise UnknownTableError(f"unknown table {name!r} (tables: {known})")
        return spec

    # -- the coordinator ----------------------------------------------------------------
    def _read(self, what: str, call: Callable[[CoordinatorHandle], ObjectRef[T]]) -> T:
        """A call that only reads the coordinator's state, retried while the coordinator
        restarts (up to ``retry_deadline_s``): a restart must not fail a query or a look."""

        def attempt() -> T:
            return RayReply(call(self.handle.coordinator), "the coordinator").get()

        return retrying(
            f"reading {what}", attempt, self.settings.retry_deadline_s, closed=self.closed
        )

    def _change(
        self,
        what: str,
        call: Callable[[CoordinatorHandle], ObjectRef[T]],
        timeout: float | None = None,
    ) -> T:
        """A call that changes the coordinator's state: not retried, as a restart finishes
        or rolls back what it was doing (the error says where to look)."""
        try:
            result = RayReply(call(self.handle.coordinator), "the coordinator").get(timeout)
        except Retryable as error:
            raise ClusterError(
                f"the coordinator restarted during {what}; it finished or rolled back what "
                f"was in progress (see db.cluster.migrations()): {error}"
            ) from None
        self.refresh()
        return result

    # -- queries ------------------------------------------------------------------------
    def plan(self, sql: str) -> PlannedQuery:
        return self._plans.plan(sql, self.catalog)

    def query(self, sql: str) -> tuple[pa.Table, ExecutionReport]:
        started = time.perf_counter()
        try:
            answer = self._query(sql)
        except Error:
            self._tally.query(time.perf_counter() - started, False)
            raise
        self._tally.query(time.perf_counter() - started, True)
        return answer

    def _query(self, sql: str) -> tuple[pa.Table, ExecutionReport]:
        planning_started = time.perf_counter()
        planned = self.plan(sql)
        planning = time.perf_counter() - planning_started  # ~0 when the plan was cached
        lost = outdated = 0
        while True:
            try:
                catalog = self.catalog
                result, report, answered = answer(
                    sql, planned, catalog, _RayRunner(self), self.engine
                )
                if answered is not planned:  # gathered whole from now on
                    self._plans.replace(sql, catalog, answered)
                break
            except ResultLost:
                # an intermediate result died with its node: run the whole plan again
                lost += 1
                if lost == QUERY_ATTEMPTS:
                    raise ClusterError("intermediate results were lost repeatedly") from None
                self.refresh()
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
        """Count a refused service call in the coordinator's /metrics."""
        self.handle.coordinator.record_access.remote(denied_action)

    def _insert_distributed(self, spec: TableSpec, table: pa.Table, batch_id: str) -> None:
        # every row's bucket is fixed once: a retry after a split or merge re-routes the same
        # rows with the same buckets, and each shard drops the buckets of the batch it holds
        salt = int(batch_id[:8], 16)
        pending = [(table, buckets_for(table, spec, self.catalog.n_buckets, salt))]

        def attempt() -> None:
            catalog = self.catalog
            rows = pa.concat_tables([t for t, _ in pending])
            buckets = np.concatenate([b for _, b in pending])
            pending.clear()
            group = catalog.group_of(spec.name)
            by_node: dict[str, dict[int, tuple[pa.Table, np.ndarray]]] = defaultdict(dict)
            for unit_id, part in route(rows, buckets, catalog, group.group_id).items():
                by_node[group.unit(unit_id).node][unit_id] = part
            replies = _submit_all(
                {
                    node: partial(self._append, node, spec.name, parts, batch_id, catalog.epoch)
                    for node, parts in by_node.items()
                }
            )
            for node in by_node.keys() - replies.keys():  # its worker is gone: route again
                pending.extend(by_node[node].values())
            for node, reply in replies.items():
                try:
                    reply.get()
                except Retryable as error:
                    log.info("insert into %s retried on %s: %s", spec.name, node, error)
                    pending.extend(by_node[node].values())
            if pending:
                raise _Again(f"{len(pending)} part(s) of the insert to place again")

        self._retrying(f"insert into {spec.name}", attempt)

    def _append(
        self,
        node: str,
        table: str,
        parts: Mapping[int, tuple[pa.Table, np.ndarray]],
        batch_id: str,
        epoch: int,
    ) -> Reply[Mapping[int, int]]:
        return self.workers.get(node).append(table, parts, batch_id, epoch)

    def _insert_replicated(self, spec: TableSpec, table: pa.Table, batch_id: str) -> None:
        rows = self.workers.share(table)
        primary = self.catalog.primary
        assert primary is not None
        # The primary logs the rows durably first; then every other replica applies them.
        self._deliver_replica(spec.name, rows, batch_id, [primary])
        others = [n for n in self.catalog.nodes if n != primary]
        self._deliver_replica(spec.name, rows, batch_id, others, leavers_skipped=True)

    def _deliver_replica(
        self,
        table: str,
        rows: SharedRows,
        batch_id: str,
        nodes: list[str],
        leavers_skipped: bool = False,
    ) -> None:
        """Apply an insert to replicas of ``table`` on ``nodes``, retrying those that fail.
        With ``leavers_skipped``, a node that left the cluster meanwhile needs no copy (the
        primary logged the rows; a node that joins loads them from there)."""
        remaining = list(nodes)

        def attempt() -> None:
            if leavers_skipped:
                remaining[:] = [n for n in remaining if n in self.catalog.nodes]
            replies = _submit_all(
                {n: partial(self._append_replica, n, table, rows, batch_id) for n in remaining}
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
                raise _Again(f"replicas on {', '.join(remaining)} still to update")

        self._retrying(f"insert into {table}", attempt)

    def _append_replica(self, node: str, table: str, rows: SharedRows, batch_id: str) -> Reply[int]:
        return self.workers.get(node).append_replica(table, rows, batch_id)

    # -- tables -------------------------------------------------------------------------
    def create_table(
        self,
        name: str,
        source: object,
        distributed_by: str | None,
        replicated: bool,
        colocate_with: str | None,
        progress: Callable[[int, int | None], None] | None = None,
        key_index: bool = False,
    ) -> int:
        if not isinstance(name, str):
            raise TableError(f"a table name must be a string, not {type(name).__name__}")
        if replicated and (distributed_by is not None or colocate_with is not None):
            raise TableError("a replicated table takes neither distributed_by nor colocate_with")
        if colocate_with is not None and distributed_by is None:
            raise TableError("colocate_with needs distributed_by (the column to co-locate on)")
        if key_index and distributed_by is None:
            raise TableError("key_index needs distributed_by (the column to index)")
        schema, total, batches = _open_source(source, self.settings.load_batch_rows)
        schema = storage_schema(schema)
        if distributed_by is not None:
            distributed_by = find_name(schema.names, distributed_by) or distributed_by
            if schema.get_field_index(distributed_by) < 0:
                raise UnknownColumnError(
                    f"distributed_by names {distributed_by!r}, which is not a column of the "
                    f"source (columns: {schema.names})"
                )
            try:
                key_family(schema.field(distributed_by).type)
            except TypeError as error:
                raise TableError(str(error)) from None
            if key_index and pa.types.is_duration(schema.field(distributed_by).type):
                raise TableError(
                    f"key_index cannot index {distributed_by!r}: DuckDB keeps no index on a "
                    "duration (INTERVAL) column"
                )
        kind = "replicated" if replicated else "distributed"
        size, batches = _arrow_size(source, total, batches) if not replicated else (None, batches)
        schema_bytes = schema.serialize().to_pybytes()
        planned: dict[str, Any] = self._coordinator(
            lambda c: c.begin_create.remote(
                name,
                schema_bytes,
                kind,
                distributed_by or "",
                colocate_with,
                bool(key_index),
                size,
            )
        )
        preview = Catalog.from_json(planned)
        spec = preview.table(name)
        try:
            rows = self._load(spec, preview, batches, total, progress)
            catalog = self._coordinator(lambda c: c.commit_create.remote(name, rows))
        except pa.ArrowException as error:  # rows that do not fit the schema
            self._abort_load(spec, preview)
            raise TableError(f"cannot load {name!r}: {error}") from None
        except BaseException:
            self._abort_load(spec, preview)
            raise
        for finished in [self.workers.get(n).finish_load(name, catalog) for n in preview.nodes]:
            finished.get()
        self.refresh()
        return rows

    def _coordinator(self, call: Callable[[CoordinatorHandle], ObjectRef[T]]) -> T:
        """A step of a load or a drop: its errors are the coordinator's own."""
        return RayReply(call(self.handle.coordinator), "the coordinator").get()

    def _load(
        self,
        spec: TableSpec,
        preview: Catalog,
        batches: Iterator[pa.RecordBatch],
        total: int | None,
        progress: Callable[[int, int | None], None] | None,
    ) -> int:
        nodes = list(preview.nodes)
        primary = preview.primary
        units_by_node: dict[str, list[int]] = defaultdict(list)
        if spec.group is not None:
            for unit in preview.groups[spec.group].units:
                units_by_node[unit.node].append(unit.unit_id)
        targets = nodes if spec.kind == "replicated" else sorted(units_by_node)
        prepared = [
            self.workers.get(n).prepare(spec, units_by_node.get(n, []), n == primary)
            for n in targets
        ]
        for ready in prepared:
            ready.get()
        in_flight: list[Reply[int]] = []
        loaded = 0
        for batch in batches:
            table = pa.Table.from_batches([batch]).cast(spec.schema)
            if spec.kind == "replicated":
                in_flight += self._stage(spec.name, {n: {REPLICA: table} for n in nodes})
            else:
                by_node: dict[str, dict[int | str, pa.Table]] = defaultdict(dict)
                group = preview.group_of(spec.name)
                for unit_id, part in split_by_unit(table, spec, preview).items():
                    by_node[group.unit(unit_id).node][unit_id] = part
                in_flight += self._stage(spec.name, by_node)
            loaded += table.num_rows
            if len(in_flight) > MAX_IN_FLIGHT_LOADS * len(nodes):
                for reply in in_flight:
                    reply.get()
                in_flight = []
            if progress is not None:
                progress(loaded, total)
        for reply in in_flight:
            reply.get()
        committed = [self.workers.get(n).commit_load(spec.name) for n in targets]
        counts = [reply.get() for reply in committed]
        return loaded if spec.kind == "replicated" else sum(counts)

    def _stage(
        self, table: str, by_node: Mapping[str, Mapping[int | str, pa.Table]]
    ) -> list[Reply[int]]:
        """Hand each node its parts of a load batch: over its fast lane where it has one
        (Arrow IPC straight into the worker), else through Ray (rows the same for every
        node, a replicated table's, put in the object store once)."""
        sends = Counter(id(part) for parts in by_node.values() for part in parts.values())
        wire: dict[int, pa.Buffer] = {}
        shared: dict[int, SharedRows] = {}

        def encoded(part: pa.Table) -> pa.Buffer:
            if id(part) not in wire:
                wire[id(part)] = to_wire(part)
            return wire[id(part)]

        def through_ray(part: pa.Table) -> pa.Table | SharedRows:
            if sends[id(part)] == 1:
                return part
            if id(part) not in shared:
                shared[id(part)] = self.workers.share(part)
            return shared[id(part)]

        if self.closed.is_set():  # the lanes are closed, and Ray is stopping
            raise ClosedError(f"loading {table}: the database was closed")
        replies: list[Reply[int]] = []
        for node, parts in by_node.items():
            address = self.lane(node)
            if address is not None:
                wired = {unit: encoded(part) for unit, part in parts.items()}
                sent = self.lane_pool.submit(self.lanes.stage, address, table, wired)
                replies.append(_LaneStage(self, node, sent))
            else:
                ray_parts = {unit: through_ray(part) for unit, part in parts.items()}
                replies.append(self.workers.get(node).stage(table, ray_parts))
        return replies

    def _abort_load(self, spec: TableSpec, preview: Catalog) -> None:
        for node in preview.nodes:
            try:
                self.workers.get(node).abort_load(spec.name).get()
            except Exception as error:  # the abort is best effort; files are removed below
                log.warning("abort of %s on %s failed: %s", spec.name, node, error)
        self._coordinator(lambda c: c.abort_create.remote(spec.name))

    def drop_table(self, name: str) -> None:
        self.table_spec(name)
        catalog, uid = self._change(f"drop_table {name}", lambda c: c.drop_table.remote(name))
        for node in Catalog.from_json(catalog).nodes:
            try:
                self.workers.get(node).sync(catalog).get()
            except Retryable:
                pass  # a restarting worker loads the new catalog anyway
        self._coordinator(lambda c: c.delete_files.remote(uid))
        self.refresh()

    # -- cluster operations -------------------------------------------------------------
    def unit_of(self, shard: str | int) -> int:
        """The unit of a shard named like ``lineitem#3``, checked whole: the table exists, is
        distributed, and unit 3 is one of its shards (a bare unit id must exist)."""
        catalog = self.refresh()
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
        return self._change("migrate", lambda c: c.migrate.remote(unit_id, to))

    def split(self, unit_id: int) -> dict[str, Any]:
        return self._change("split", lambda c: c.split.remote(unit_id))

    def merge(self, first: int, second: int) -> dict[str, Any]:
        return self._change("merge", lambda c: c.merge.remote(first, second))

    def rebalance(self, dry_run: bool) -> dict[str, Any]:
        if dry_run:  # only looks: retried while the coordinator restarts
            return self._read("a rebalancing plan", lambda c: c.rebalance.remote(True))
        return self._change("rebalance", lambda c: c.rebalance.remote(False))

    def add_node(self, slowdown: float = 1.0) -> str:
        node = self._change("reserve_node", lambda c: c.reserve_node.remote())
        worker = start_worker(self.handle, node, next_slot(self.handle), slowdown)
        worker.info().get()  # started, replicated tables loaded
        worker.calibrate().get()
        self._change("node_joined", lambda c: c.node_joined.remote(node))
        return node

    def drain(self, node: str, deadline_s: float) -> DrainReport:
        result = self._change("drain", lambda c: c.drain.remote(node, deadline_s))
        if result.drained:
            self.workers.kill(node)
        return result

    def coordinator_host(self) -> str:
        return self._read("the coordinator's node", lambda c: c.ray_node_id.remote())

    def drain_host(self, ray_node_id: str, deadline_s: float) -> list[DrainReport]:
        return self._change("drain_host", lambda c: c.leave.remote(ray_node_id, deadline_s))

    # -- reporting ----------------------------------------------------------------------
    def migrations(self) -> list[dict[str, Any]]:
        return self._read("the migrations", lambda c: c.migrations.remote())

    def failovers(self) -> list[dict[str, Any]]:
        return self._read("the failovers", lambda c: c.failovers.remote())

    def metrics_url(self) -> str:
        return self._read("the metrics address", lambda c: c.metrics_url.remote())

    def node_loads(self) -> dict[str, NodeLoad]:
        return self._read("the node loads", lambda c: c.node_loads.remote())

    def shard_loads(self) -> dict[ShardKey, float]:
        return self._read("the shard loads", lambda c: c.shard_loads.remote())

    def worker_infos(self) -> dict[str, WorkerInfo | None]:
        """Every node's report; None for a node whose worker does not answer."""
        catalog = self.refresh()
        replies = _submit_all({n: partial(self._info, n) for n in catalog.nodes})
        infos: dict[str, WorkerInfo | None] = {n: None for n in catalog.nodes}
        for node, reply in replies.items():
            try:
                infos[node] = reply.get(timeout=self.settings.retry_deadline_s)
            except Retryable:
                infos[node] = None
        return infos

    def _info(self, node: str) -> Reply[WorkerInfo]:
        return self.workers.get(node).info()

    def lane(self, node: str) -> LaneAddress | None:
        """Where ``node``'s worker answers fragments directly: asked through Ray once per
        worker (a new worker of the node is asked again); None without a fast lane."""
        if not self.settings.fast_lane:
            return None
        worker = self.workers.get(node)
        known = self._lane_of.get(node)
        if known is None or known[0] is not worker.handle:
            try:
                address = worker.fast_lane().get()
            except Error as error:  # gone (a new worker gets asked), or one without a lane
                log.info("%s has no fast lane: %s", node, error)
                address = None
            known = self._lane_of[node] = (worker.handle, address)
        return known[1]

    def lane_broken(self, node: str, error: Exception) -> None:
        """``node``'s lane failed: its worker is asked through Ray from now on (a worker
        that died is then seen as gone; a new worker of the node gets a lane again)."""
        log.info("the fast lane to %s failed (%s); asking it through Ray", node, error)
        known = self._lane_of.get(node)
        if known is not None:
            self._lane_of[node] = (known[0], None)

    def close(self) -> None:
        self.closed.set()
        self._tally.close()
        self.lane_pool.shutdown(wait=False)
        self.lanes.close()
        self.engine.close()


class Tally:
    """Queries' outcomes and inserts' row counts for the coordinator's metrics, sent in
    batches: at most every :data:`TALLY_INTERVAL_S` (one call instead of one per query or
    insert, which at hundreds a second costs the coordinator and the client more than the
    work). Nothing is sent once :meth:`close` returns (Ray may be gone then)."""

    def __init__(self, send: Callable[[list[tuple[float, bool]], list[int]], object]) -> None:
        self._send = send
        self._lock = threading.Lock()
        self._queries: list[tuple[float, bool]] = []
        self._inserts: list[int] = []
        self._timer: threading.Timer | None = None
        self._closed = False

    def query(self, seconds: float, ok: bool) -> None:
        with self._lock:
            if not self._closed:
                self._queries.append((seconds, ok))
                self._soon()

    def insert(self, rows: int) -> None:
        with self._lock:
            if not self._closed:
                self._inserts.append(rows)
                self._soon()

    def _soon(self) -> None:
        if self._timer is None:
            self._timer = threading.Timer(TALLY_INTERVAL_S, self.flush)
            self._timer.daemon = True
            self._timer.start()

    def flush(self) -> None:
        """Send what is pending (sent under the lock, so never after :meth:`close`)."""
        with self._lock:
            self._send_locked()

    def close(self) -> None:
        """Send what is pending, and nothing after."""
        with self._lock:
            self._send_locked()
            self._closed = True

    def _send_locked(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        queries, inserts = self._queries, self._inserts
        self._queries, self._inserts = [], []
        if queries or inserts:
            try:
                self._send(queries, inserts)
            except Exception as error:  # metrics only: a query never fails for them
                log.debug("outcomes not recorded: %s", error)


def _hex_id(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class _LaneStage:
    """A load's parts on their way over a fast lane (a :class:`Reply` of the rows staged)."""

    def __init__(self, session: Session, node: str, sent: Future[int]) -> None:
        self.session = session
        self.node = node
        self.sent = sent

    def get(self, timeout: float | None = None) -> int:
        try:
            return self.sent.result(timeout)
        except TimeoutError:
            raise WorkerTimeout(f"{self.node} staged no rows within {timeout} s") from None
        except LaneBroken as error:  # the rows may be staged or not: the load fails
            if self.session.closed.is_set():  # the lanes were closed with the session
                raise ClosedError(f"{self.node}: the database was closed") from error
            self.session.lane_broken(self.node, error)
            self.session.workers.get(self.node).ping().get()  # gone: said as through Ray
            raise


def _submit_all(submissions: Mapping[str, Callable[[], T]]) -> dict[str, T]:
    """Submit each node's call; a node whose worker is gone is left out (its part is still
    pending, and the caller retries it with fresh routing)."""
    submitted = {}
    for node, submit in submissions.items():
        try:
            submitted[node] = submit()
        except Retryable as error:
            log.info("%s: %s; retried with fresh routing", node, error)
    return submitted


@dataclass
class _RayOutput:
    """A fragment result left in Ray's object store until someone needs its rows."""

    ref: ObjectRef[pa.Table]
    _table: pa.Table | None = None
    transfer_seconds: float = 0.0

    def table(self) -> pa.Table:
        if self._table is None:
            started = time.perf_counter()
            self._table = from_wire(RayReply(self.ref, "a fragment result").get())
            self.transfer_seconds = time.perf_counter() - started
        return self._table


class _RayRunner:
    """Runs fragments on the workers through Ray, retrying moved or dead ones."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self._puts: dict[int, ObjectRef[pa.Table]] = {}

    def _refs(self, inputs: Mapping[str, Output]) -> tuple[list[str], list[ObjectRef[pa.Table]]]:
        """Every input as object references, a name repeated once per part: results still
        on the workers travel worker to worker; client-side tables are put once per query."""
        names: list[str] = []
        refs: list[ObjectRef[pa.Table]] = []
        for name, value in inputs.items():
            for part in _parts(value):
                if isinstance(part, _RayOutput):
                    ref = part.ref
                else:
                    key = id(part)
                    if key not in self._puts:
                        self._puts[key] = ray.put(part.table())
                    ref = self._puts[key]
                names.append(name)
                refs.append(ref)
        return names, refs

    def _call(
        self,
        node: str,
        sql: str,
        bindings: dict[str, list[int]],
        epoch: int,
        names: list[str],
        refs: list[ObjectRef[pa.Table]],
    ) -> tuple[ObjectRef[pa.Table], Reply[FragmentStats], float]:
        worker = self.session.workers.get(node)
        submitted = time.time()
        table_ref, stats = worker.execute(sql, bindings, epoch, names, self.session.profiling, refs)
        return table_ref, stats, submitted

    def _on_the_client(self, inputs: Mapping[str, Output]) -> dict[str, pa.Table] | None:
        """The inputs as tables, where the client holds every one and they are small
        enough to send along with the fragment (:data:`LANE_INPUTS_BYTES`); else None."""
        tables: dict[str, pa.Table] = {}
        size = 0
        for name, value in inputs.items():
            if any(isinstance(p, _RayOutput) and p._table is None for p in _parts(value)):
                return None  # on the workers still: they read it from the object store
            tables[name] = value.table()
            size += tables[name].nbytes
            if size > LANE_INPUTS_BYTES:
                return None
        return tables

    def scatter(self, stage: Stage, inputs: Mapping[str, Output]) -> list[FragmentResult]:
        session = self.session
        # inputs go along over the lanes only where the results come back here too
        sent = self._on_the_client(inputs) if _answered_on_the_client(stage) else None
        results: list[FragmentResult] = []
        assert stage.group is not None
        pending: set[int] | None = None

        def attempt() -> None:
            nonlocal pending
            catalog = session.catalog
            group = catalog.groups.get(stage.group or "")
            if group is None:
                raise QueryError("a table of the query was dropped while it ran")
            current = {u.unit_id for u in stage.units_to_run(group)}
            if pending is None or pending - current:
                # first attempt, or a split/merge replaced units still to do: the parts
                # done so far may overlap the new units, so the stage starts over
                results.clear()
                pending = current
            by_node: dict[str, list[int]] = defaultdict(list)
            for unit in group.units:
                if unit.unit_id in pending:
                    by_node[unit.node].append(unit.unit_id)
            direct = (
                self._direct(stage.sql, by_node, stage.tables, catalog.epoch, sent)
                if sent is not None
                else None
            )
            if direct is not None:
                failed = None
                for node, outcome in direct.items():
                    if isinstance(outcome, FragmentResult):
                        results.append(outcome)
                        pending -= set(by_node[node])
                    elif isinstance(outcome, LaneBroken):  # Ray is asked on the next attempt
                        session.lane_broken(node, outcome)
                    elif isinstance(outcome, Retryable):
                        log.info("fragment retried after %s failed: %s", node, outcome)
                    else:  # the query's own error
                        failed = failed or outcome
                if failed is not None:
                    raise failed
                if pending:
                    raise _Again(f"{len(pending)} unit(s) of the stage still to run")
                return
            names, refs = self._refs(inputs)  # each client-held input put once a query
            calls = _submit_all(
                {
                    node: partial(
                        self._call,
                        node,
                        stage.sql,
                        {t: units for t in stage.tables},
                        catalog.epoch,
                        names,
                        refs,
                    )
                    for node, units in by_node.items()
                }
            )
            for node, (table_ref, stats_reply, submitted) in calls.items():
                try:
                    stats = stats_reply.get()
                except Retryable as error:
                    log.info("fragment retried after %s failed: %s", node, error)
                    _discard(table_ref)
                    continue
                except Error:  # the query's own error: no result of this attempt is read
                    _abandon(calls.values())
                    raise
                results.append(_fragment_result(node, table_ref, stats, submitted))
                pending -= set(by_node[node])
            if pending:
                raise _Again(f"{len(pending)} unit(s) of the stage still to run")

        session._retrying("query", attempt)
        if session.settings.test_hold_results_s:  # tests only: results wait on the workers
            session.results_held.set()
            time.sleep(session.settings.test_hold_results_s)
            session.results_held.clear()
        return results

    def _direct(
        self,
        sql: str,
        work: Mapping[str, list[int]],
        tables: Iterable[str],
        epoch: int,
        inputs: Mapping[str, pa.Table],
    ) -> dict[str, FragmentResult | Exception] | None:
        """Each node's fragment (over its units of ``tables``, ``inputs`` sent along) asked
        over its fast lane, all at once: its result, or what it raised (the worker's own
        errors as through Ray, :class:`LaneBroken` where the lane failed). None where a node
        has no lane: the stage goes through Ray."""
        session = self.session
        addresses = {node: session.lane(node) for node in work}
        if any(address is None for address in addresses.values()):
            return None

        def ask(node: str) -> FragmentResult:
            address = addresses[node]
            assert address is not None
            submitted = time.time()
            bindings = {table: work[node] for table in tables}
            table, stats = session.lanes.execute(
                address, sql, bindings, epoch, session.profiling, inputs
            )
            output = Materialized(table)
            return FragmentResult(
                output, node, stats.seconds, stats.rows_out, stats, submitted, via="fast lane"
            )

        if len(work) == 1:
            return {node: _outcome(partial(ask, node)) for node in work}
        asked = {node: session.lane_pool.submit(ask, node) for node in work}
        return {node: _outcome(future.result) for node, future in asked.items()}

    def run_on_worker(self, sql: str, inputs: Mapping[str, Output]) -> FragmentResult:
        session = self.session
        sent = self._on_the_client(inputs)

        def attempt() -> FragmentResult:
            nodes = session.catalog.serving
            node = nodes[next(session._round_robin) % len(nodes)]
            direct = None if sent is None else self._direct(sql, {node: []}, (), 0, sent)
            if direct is not None:  # inputs the client holds: over the node's lane
                outcome = direct[node]
                if isinstance(outcome, FragmentResult):
                    return outcome
                if not isinstance(outcome, LaneBroken):
                    raise outcome  # retried (moved, gone), or the query's own error
                session.lane_broken(node, outcome)
            names, refs = self._refs(inputs)
            table_ref, stats_reply, submitted = self._call(node, sql, {}, 0, names, refs)
            try:
                stats = stats_reply.get()
            except Error:  # retried, or the query's own error: its result is never read
                _discard(table_ref)
                raise
            return _fragment_result(node, table_ref, stats, submitted)

        return session._retrying("query", attempt)


def _outcome(call: Callable[[], T]) -> T | Exception:
    try:
        return call()
    except Exception as error:
        return error


def _answered_on_the_client(stage: Stage) -> bool:
    """Whether the stage's result goes to the client (a routed stage's few rows, partials
    the client merges, or the answer of a query run whole on one worker) rather than to
    workers of a later stage, which read it from Ray's object store."""
    if stage.buckets is not None or stage.strategy == WHOLE:
        return True
    return stage.merge_sql is not None and stage.merge_on == "client"


def _fragment_result(
    node: str, table_ref: ObjectRef[pa.Table], stats: FragmentStats, submitted: float
) -> FragmentResult:
    """A fragment's answer, left in the object store, with what its worker measured."""
    return FragmentResult(
        _RayOutput(table_ref), node, stats.seconds, stats.rows_out, stats, submitted, via="ray"
    )


def _abandon(
    calls: Iterable[tuple[ObjectRef[pa.Table], Reply[FragmentStats], float]],
) -> None:
    """Collect the outcomes of fragments whose query failed elsewhere (waiting a moment
    for those still running), so that Ray reports none of their errors as unhandled."""
    for table_ref, stats_reply, _ in calls:
        try:
            stats_reply.get(ABANDON_WAIT_S)
        except Error:
            pass
        _discard(table_ref)


def _discard(ref: ObjectRef[pa.Table]) -> None:
    """Collect the error of a failed result we will not use, so Ray does not report it."""
    try:
        ray.get(ref, timeout=0)
    except Exception:  # the error is the one already handled
        pass


def _parts(value: Output) -> list[Output]:
    if isinstance(value, Concatenated) and value._table is None:
        return [p for part in value.parts for p in _parts(part)]
    return [value]


def _open_source(
    source: object, batch_rows: int
) -> tuple[pa.Schema, int | None, Iterator[pa.RecordBatch]]:
    """The source's schema, its row count where known before reading (a stream's is not),
    and its rows in batches of at most ``batch_rows``."""
    if isinstance(source, pa.RecordBatch):
        source = pa.Table.from_batches([source])
    if isinstance(source, pa.Table):
        return source.schema, source.num_rows, iter(source.to_batches(max_chunksize=batch_rows))
    if hasattr(source, "__arrow_c_stream__"):  # a RecordBatchReader, DuckDB, Polars, ...
        try:
            reader = (
                source
                if isinstance(source, pa.RecordBatchReader)
                else pa.RecordBatchReader.from_stream(source)
            )
        except (pa.ArrowException, TypeError, ValueError) as error:
            raise TableError(f"cannot read an Arrow stream from the source: {error}") from None
        return reader.schema, None, _stream_batches(reader, batch_rows)
    if isinstance(source, str | os.PathLike):
        path = os.fspath(source)
        if "://" not in path and not Path(path).exists():
            raise TableError(f"source {path!r} does not exist")
        try:
            dataset = ds.dataset(path, format="parquet")
            schema = _one_schema(path, dataset)
            total = dataset.count_rows()
        except (pa.ArrowInvalid, OSError) as error:
            raise TableError(f"cannot read Parquet from {path!r}: {error}") from None
        return schema, total, _read_batches(path, dataset, batch_rows)
    raise TableError(
        "a table source is a Parquet file or directory (path or URI), a pyarrow.Table or an "
        f"Arrow stream (a RecordBatchReader, a DuckDB relation, ...), not {type(source).__name__}"
    )


def _arrow_size(
    source: object, total: int | None, batches: Iterator[pa.RecordBatch]
) -> tuple[int | None, Iterator[pa.RecordBatch]]:
    """The source's size in Arrow bytes where it can be told before the load (None for a
    stream), and its batches again: a Parquet source's is its row count times the bytes a
    row of its first batch takes, the one batch read ahead for it."""
    if isinstance(source, pa.RecordBatch | pa.Table):
        return source.nbytes, batches
    if total is None:
        return None, batches
    first = next(batches, None)
    if first is None:
        return 0, batches
    size = total * first.nbytes // max(first.num_rows, 1)
    return size, itertools.chain([first], batches)


def _one_schema(path: str, dataset: ds.FileSystemDataset) -> pa.Schema:
    """The schema every file of the source has; a source without files, or whose files
    disagree, is refused before anything is written."""
    fragments = list(dataset.get_fragments())
    if not fragments:
        raise TableError(f"source {path!r} holds no Parquet files")
    first = fragments[0].physical_schema.remove_metadata()
    for fragment in fragments[1:]:
        other = fragment.physical_schema.remove_metadata()
        if not other.equals(first):
            differ = sorted(
                {f"{f.name} {f.type}" for f in first} ^ {f"{f.name} {f.type}" for f in other}
            )
            raise TableError(
                f"the files of source {path!r} have different schemas: {fragments[0].path} and "
                f"{fragment.path} differ in {', '.join(differ)}"
            )
    return first


def _stream_batches(reader: pa.RecordBatchReader, batch_rows: int) -> Iterator[pa.RecordBatch]:
    """A stream's batches cut to at most ``batch_rows`` (a producer may send one batch of
    millions of rows); small batches pass as they come, so a slow producer's rows are sent
    as they arrive. A batch must have the stream's schema (pyarrow does not check what a
    Python producer yields)."""
    with reader:
        for batch in reader:
            if not batch.schema.equals(reader.schema):
                raise TableError(
                    f"a batch of the stream does not have the stream's schema: {batch.schema} "
                    f"(the stream's: {reader.schema})".replace("\n", ", ")
                )
            for start in range(0, batch.num_rows, batch_rows):
                yield batch.slice(start, batch_rows)


def _read_batches(
    path: str, dataset: ds.FileSystemDataset, batch_rows: int
) -> Iterator[pa.RecordBatch]:
    try:
        yield from dataset.to_batches(batch_size=batch_rows)
    except (pa.ArrowInvalid, OSError) as error:
        raise TableError(f"cannot read Parquet from {path!r}: {error}") from None
