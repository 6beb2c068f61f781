"""The client session: plans queries, scatters fragments straight to the workers, merges;
routes inserts to shard owners; loads tables. It caches the routing snapshot (the catalog)
and refreshes it when a worker answers ``Moved`` or dies, then retries what failed."""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import ray
from ray.exceptions import ObjectLostError, RayActorError, RayTaskError

from shardflow.catalog import Catalog, TableSpec
from shardflow.catalog.buckets import key_family
from shardflow.catalog.types import storage_schema
from shardflow.engine import DuckDBEngine
from shardflow.errors import (
    ClusterError,
    Error,
    QueryError,
    Retryable,
    SqlSyntaxError,
    TableError,
    UnknownColumnError,
    UnknownShardError,
    UnknownTableError,
)
from shardflow.runtime.cluster import ClusterHandle, start_worker
from shardflow.runtime.executor import (
    Concatenated,
    ExecutionReport,
    FragmentResult,
    Output,
    execute,
)
from shardflow.runtime.worker import REPLICA
from shardflow.sql import DistributedPlan, Stage, explain, plan
from shardflow.storage.conform import conform
from shardflow.storage.partition import buckets_for, route, split_by_unit

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_IN_FLIGHT_LOADS = 8
QUERY_ATTEMPTS = 3


@dataclass(frozen=True)
class PlannedQuery:
    plan: DistributedPlan
    schema: pa.Schema
    """The result schema DuckDB gives the query: the answer is returned with these names."""
    plan_seconds: float


class _Transient(Exception):
    """A call failed for a reason a retry with fresh routing can cure."""


class _InputLost(Exception):
    """An intermediate result in the object store was lost with its node."""


def _unwrap(call: Callable[[], T]) -> T:
    """Run a Ray call; re-raise errors of ours as themselves, transient ones as _Transient."""
    try:
        return call()
    except ObjectLostError:
        raise _InputLost() from None
    except Retryable as error:  # raised here, not by the worker: e.g. its node was drained
        raise _Transient(str(error)) from None
    except RayActorError as error:
        raise _Transient(str(error)) from None
    except RayTaskError as error:
        cause = error.cause
        if isinstance(cause, ObjectLostError):
            raise _InputLost() from None
        if isinstance(cause, Retryable):
            raise _Transient(str(cause)) from None
        if isinstance(cause, Error):
            raise cause from None
        if isinstance(cause, RayActorError):
            raise _Transient(str(cause)) from None
        raise ClusterError(f"a worker failed: {cause!r}") from None


class Session:
    def __init__(self, handle: ClusterHandle) -> None:
        self.handle = handle
        self.settings = handle.settings
        self.engine = DuckDBEngine()
        self._plans: OrderedDict[tuple[str, int], PlannedQuery] = OrderedDict()
        self._lock = threading.Lock()
        self._round_robin = itertools.count()
        self._validator: tuple[int, dict[str, pa.Table]] | None = None
        self.profiling = self.settings.profile_queries
        """Collect per-fragment timings and sizes (``db.profile`` turns it on for its query)."""
        self.catalog = Catalog()
        self.refresh()

    # -- routing ------------------------------------------------------------------------
    def refresh(self) -> Catalog:
        catalog = Catalog.from_json(self.coordinator_read("catalog"))
        with self._lock:
            if catalog.version >= self.catalog.version:
                self.catalog = catalog
            return self.catalog

    def _retrying(self, what: str, attempt: Callable[[], bool]) -> None:
        """Call ``attempt`` until it reports nothing is left, refreshing routing in between."""
        deadline = time.monotonic() + self.settings.retry_deadline_s
        delay = 0.05
        while not attempt():
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"{what}: workers did not answer within {self.settings.retry_deadline_s:g}s"
                    " (retry_deadline_s); check db.cluster.nodes()"
                )
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
            self.refresh()

    def table_spec(self, name: str) -> TableSpec:
        if not isinstance(name, str):
            raise UnknownTableError(f"a table name must be a string, not {type(name).__name__}")
        spec = self.catalog.tables.get(name)
        if spec is None:
            spec = self.refresh().tables.get(name)
        if spec is None:
            known = ", ".join(sorted(self.catalog.tables)) or "none yet"
            raise UnknownTableError(f"unknown table {name!r} (tables: {known})")
        return spec

    # -- queries ------------------------------------------------------------------------
    def plan(self, sql: str) -> PlannedQuery:
        catalog = self.catalog
        key = (sql, catalog.version)
        with self._lock:
            cached = self._plans.get(key)
            if cached is not None:
                self._plans.move_to_end(key)
                return cached
        started = time.perf_counter()
        distributed = plan(sql, catalog)
        schema = self._validate(sql, catalog)
        planned = PlannedQuery(distributed, schema, time.perf_counter() - started)
        with self._lock:
            self._plans[key] = planned
            while len(self._plans) > self.settings.plan_cache_size:
                self._plans.popitem(last=False)
        return planned

    def _validate(self, sql: str, catalog: Catalog) -> pa.Schema:
        """Bind the query in DuckDB over empty tables: type errors, unknown functions and
        the like surface here with DuckDB's own message, before any worker is asked."""
        if self._validator is None or self._validator[0] != catalog.version:
            empties = {n: s.schema.empty_table() for n, s in catalog.tables.items()}
            self._validator = (catalog.version, empties)
        try:
            return self.engine.run(sql, self._validator[1]).schema
        except duckdb.ParserException as error:
            raise SqlSyntaxError(str(error).strip()) from None
        except duckdb.BinderException as error:
            message = str(error).strip()
            if "not found" in message and "olumn" in message:
                raise UnknownColumnError(message) from None
            raise QueryError(message) from None
        except duckdb.Error as error:
            raise QueryError(str(error).strip()) from None

    def query(self, sql: str) -> tuple[pa.Table, ExecutionReport]:
        started = time.perf_counter()
        try:
            answer = self._query(sql)
        except Error:
            self.handle.coordinator.record_query.remote(time.perf_counter() - started, False)
            raise
        self.handle.coordinator.record_query.remote(time.perf_counter() - started, True)
        return answer

    def _query(self, sql: str) -> tuple[pa.Table, ExecutionReport]:
        planning_started = time.perf_counter()
        planned = self.plan(sql)
        planning = time.perf_counter() - planning_started  # ~0 when the plan was cached
        for attempt in range(QUERY_ATTEMPTS):
            try:
                result, report = execute(planned.plan, _RayRunner(self), self.engine)
                break
            except _InputLost:
                # an intermediate result died with its node: run the whole plan again
                if attempt == QUERY_ATTEMPTS - 1:
                    raise ClusterError("intermediate results were lost repeatedly") from None
                self.refresh()
        report.plan_seconds = planning
        return _as_schema(result, planned.schema), report

    def explain(self, sql: str) -> str:
        return explain(self.plan(sql).plan)

    # -- inserts ------------------------------------------------------------------------
    def insert(self, name: str, data: object) -> int:
        spec = self.table_spec(name)
        table = conform(data, spec.schema, name)
        if table.num_rows == 0:
            return 0
        batch_id = uuid.uuid4().hex
        if spec.kind == "replicated":
            self._insert_replicated(spec, table, batch_id)
        else:
            self._insert_distributed(spec, table, batch_id)
        self.handle.coordinator.record_insert.remote(table.num_rows)
        return table.num_rows

    def _insert_distributed(self, spec: TableSpec, table: pa.Table, batch_id: str) -> None:
        # every row's bucket is fixed once: a retry after a split or merge re-routes the same
        # rows with the same buckets, and each shard drops the buckets of the batch it holds
        salt = int(batch_id[:8], 16)
        pending = [(table, buckets_for(table, spec, self.catalog.n_buckets, salt))]

        def attempt() -> bool:
            catalog = self.catalog
            rows = pa.concat_tables([t for t, _ in pending])
            buckets = np.concatenate([b for _, b in pending])
            pending.clear()
            group = catalog.group_of(spec.name)
            by_node: dict[str, dict[int, tuple[pa.Table, np.ndarray]]] = defaultdict(dict)
            for unit_id, part in route(rows, buckets, catalog, group.group_id).items():
                by_node[group.unit(unit_id).node][unit_id] = part
            calls = {
                node: lambda node=node, parts=parts: self.handle.worker(node).append.remote(
                    spec.name, parts, batch_id, catalog.epoch
                )
                for node, parts in by_node.items()
            }
            submitted = _submit_all(calls)
            for node in calls.keys() - submitted.keys():  # its worker is gone: route again
                pending.extend(by_node[node].values())
            for node, ref in submitted.items():
                try:
                    _unwrap(lambda ref=ref: ray.get(ref))
                except _Transient as error:
                    log.info("insert into %s retried on %s: %s", spec.name, node, error)
                    pending.extend(by_node[node].values())
            return not pending

        self._retrying(f"insert into {spec.name}", attempt)

    def _insert_replicated(self, spec: TableSpec, table: pa.Table, batch_id: str) -> None:
        ref = ray.put(table)
        primary = self.catalog.primary
        assert primary is not None
        # The primary logs the rows durably first; then every other replica applies them.
        self._deliver_replica(spec.name, ref, batch_id, [primary])
        others = [n for n in self.catalog.nodes if n != primary]
        self._deliver_replica(spec.name, ref, batch_id, others, leavers_skipped=True)

    def _deliver_replica(
        self, table: str, ref: Any, batch_id: str, nodes: list[str], leavers_skipped: bool = False
    ) -> None:
        """Apply an insert to replicas of ``table`` on ``nodes``, retrying those that fail.
        With ``leavers_skipped``, a node that left the cluster meanwhile needs no copy (the
        primary logged the rows; a node that joins loads them from there)."""
        remaining = list(nodes)

        def attempt() -> bool:
            if leavers_skipped:
                remaining[:] = [n for n in remaining if n in self.catalog.nodes]
            calls = _submit_all(
                {
                    n: lambda n=n: self.handle.worker(n).append_replica.remote(table, ref, batch_id)
                    for n in remaining
                }
            )
            missing = [n for n in remaining if n not in calls]  # worker gone: try again
            remaining.clear()
            remaining.extend(missing)
            for node, call in calls.items():
                try:
                    _unwrap(lambda call=call: ray.get(call))
                except _Transient:
                    remaining.append(node)
            return not remaining

        self._retrying(f"insert into {table}", attempt)

    # -- tables -------------------------------------------------------------------------
    def create_table(
        self,
        name: str,
        source: object,
        distributed_by: str | None,
        replicated: bool,
        colocate_with: str | None,
        progress: Callable[[int, int], None] | None = None,
    ) -> int:
        if not isinstance(name, str):
            raise TableError(f"a table name must be a string, not {type(name).__name__}")
        if replicated and (distributed_by is not None or colocate_with is not None):
            raise TableError("a replicated table takes neither distributed_by nor colocate_with")
        if colocate_with is not None and distributed_by is None:
            raise TableError("colocate_with needs distributed_by (the column to co-locate on)")
        schema, total, batches = _open_source(source, self.settings.load_batch_rows)
        schema = storage_schema(schema)
        if distributed_by is not None:
            if schema.get_field_index(distributed_by) < 0:
                raise UnknownColumnError(
                    f"distributed_by names {distributed_by!r}, which is not a column of the "
                    f"source (columns: {schema.names})"
                )
            try:
                key_family(schema.field(distributed_by).type)
            except TypeError as error:
                raise TableError(str(error)) from None
        kind = "replicated" if replicated else "distributed"
        preview = Catalog.from_json(
            _unwrap(
                lambda: ray.get(
                    self.handle.coordinator.begin_create.remote(
                        name,
                        schema.serialize().to_pybytes(),
                        kind,
                        distributed_by or "",
                        colocate_with,
                    )
                )
            )
        )
        spec = preview.table(name)
        try:
            rows = self._load(spec, preview, batches, total, progress)
            catalog = _unwrap(
                lambda: ray.get(self.handle.coordinator.commit_create.remote(name, rows))
            )
        except pa.ArrowException as error:  # rows that do not fit the schema
            self._abort_load(spec, preview)
            raise TableError(f"cannot load {name!r}: {error}") from None
        except BaseException:
            self._abort_load(spec, preview)
            raise
        ray.get([self.handle.worker(n).finish_load.remote(name, catalog) for n in preview.nodes])
        self.refresh()
        return rows

    def _load(
        self,
        spec: TableSpec,
        preview: Catalog,
        batches: Iterator[pa.RecordBatch],
        total: int,
        progress: Callable[[int, int], None] | None,
    ) -> int:
        nodes = list(preview.nodes)
        primary = preview.primary
        units_by_node: dict[str, list[int]] = defaultdict(list)
        if spec.group is not None:
            for unit in preview.groups[spec.group].units:
                units_by_node[unit.node].append(unit.unit_id)
        targets = nodes if spec.kind == "replicated" else sorted(units_by_node)
        ray.get(
            [
                self.handle.worker(n).prepare.remote(
                    spec.to_json(), units_by_node.get(n, []), n == primary
                )
                for n in targets
            ]
        )
        in_flight: list[Any] = []
        loaded = 0
        for batch in batches:
            table = pa.Table.from_batches([batch]).cast(spec.schema)
            if spec.kind == "replicated":
                ref = ray.put(table)
                in_flight += [
                    self.handle.worker(n).stage.remote(spec.name, [REPLICA], ref) for n in nodes
                ]
            else:
                by_node: dict[str, dict[int, pa.Table]] = defaultdict(dict)
                group = preview.group_of(spec.name)
                for unit_id, part in split_by_unit(table, spec, preview).items():
                    by_node[group.unit(unit_id).node][unit_id] = part
                in_flight += [
                    self.handle.worker(n).stage.remote(spec.name, list(parts), *parts.values())
                    for n, parts in by_node.items()
                ]
            loaded += table.num_rows
            if len(in_flight) > MAX_IN_FLIGHT_LOADS * len(nodes):
                ray.get(in_flight)
                in_flight = []
            if progress is not None:
                progress(loaded, total)
        ray.get(in_flight)
        counts = ray.get([self.handle.worker(n).commit_load.remote(spec.name) for n in targets])
        return loaded if spec.kind == "replicated" else sum(counts)

    def _abort_load(self, spec: TableSpec, preview: Catalog) -> None:
        for node in preview.nodes:
            try:
                ray.get(self.handle.worker(node).abort_load.remote(spec.name))
            except Exception as error:  # the abort is best effort; files are removed below
                log.warning("abort of %s on %s failed: %s", spec.name, node, error)
        ray.get(self.handle.coordinator.abort_create.remote(spec.name))

    def drop_table(self, name: str) -> None:
        self.table_spec(name)
        catalog, uid = _unwrap(lambda: ray.get(self.handle.coordinator.drop_table.remote(name)))
        for node in Catalog.from_json(catalog).nodes:
            try:
                ray.get(self.handle.worker(node).sync.remote(catalog))
            except RayActorError:
                pass  # a restarting worker loads the new catalog anyway
        ray.get(self.handle.coordinator.delete_files.remote(uid))
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
        spec = catalog.tables.get(table)
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

    def coordinator_read(self, method: str, *args: Any) -> Any:
        """A call that only reads the coordinator's state, retried while the coordinator
        restarts (up to ``retry_deadline_s``): a restart must not fail a query or a look."""
        deadline = time.monotonic() + self.settings.retry_deadline_s
        delay = 0.05
        while True:
            call = getattr(self.handle.coordinator, method).remote(*args)
            try:
                return _unwrap(lambda call=call: ray.get(call))
            except _Transient as error:
                if time.monotonic() > deadline:
                    raise ClusterError(
                        f"the coordinator did not answer {method} within "
                        f"{self.settings.retry_deadline_s:g}s (retry_deadline_s): {error}"
                    ) from None
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def coordinator_call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        """A call that changes the coordinator's state: not retried, as a restart finishes
        or rolls back what it was doing (the error says where to look)."""
        call = getattr(self.handle.coordinator, method).remote(*args)
        try:
            result = _unwrap(lambda: ray.get(call, timeout=timeout))
        except _Transient as error:
            raise ClusterError(
                f"the coordinator restarted during {method}; it finished or rolled back what "
                f"was in progress (see db.cluster.migrations()): {error}"
            ) from None
        self.refresh()
        return result

    def add_node(self, slowdown: float = 1.0) -> str:
        node = self.coordinator_call("reserve_node")
        worker = start_worker(self.handle, node, slowdown)
        ray.get(worker.info.remote())  # started, replicated tables loaded
        ray.get(worker.calibrate.remote())
        self.coordinator_call("node_joined", node)
        return node

    def drain(self, node: str, deadline_s: float) -> dict[str, Any]:
        result: dict[str, Any] = self.coordinator_call("drain", node, deadline_s)
        if result["drained"]:
            worker = self.handle.workers.pop(node, None)
            if worker is not None:
                ray.kill(worker, no_restart=True)
        return result

    # -- reporting ----------------------------------------------------------------------
    def worker_infos(self) -> dict[str, dict[str, Any]]:
        catalog = self.refresh()
        calls = _submit_all(
            {n: lambda n=n: self.handle.worker(n).info.remote() for n in catalog.nodes}
        )
        infos: dict[str, dict[str, Any]] = {n: {} for n in catalog.nodes}  # gone: no info
        for node, call in calls.items():
            try:
                infos[node] = ray.get(call, timeout=self.settings.retry_deadline_s)
            except (RayActorError, ray.exceptions.GetTimeoutError):
                infos[node] = {}
        return infos

    def close(self) -> None:
        self.engine.close()


def _submit_all(submissions: Mapping[str, Callable[[], T]]) -> dict[str, T]:
    """Submit each node's call; a node whose worker is gone is left out (its part is still
    pending, and the caller retries it with fresh routing)."""
    submitted = {}
    for node, submit in submissions.items():
        try:
            submitted[node] = _unwrap(submit)
        except _Transient as error:
            log.info("%s: %s; retried with fresh routing", node, error)
    return submitted


def _fragment_result(
    node: str, table_ref: Any, stats: dict[str, Any], submitted: float
) -> FragmentResult:
    """A fragment's answer, left in the object store, with what its worker measured."""
    return FragmentResult(
        _RayOutput(table_ref), node, stats["seconds"], stats["rows_out"], stats, submitted
    )


@dataclass
class _RayOutput:
    """A fragment result left in Ray's object store until someone needs its rows."""

    ref: Any
    _table: pa.Table | None = None
    transfer_seconds: float = 0.0

    def table(self) -> pa.Table:
        if self._table is None:
            started = time.perf_counter()
            self._table = _unwrap(lambda: ray.get(self.ref))
            self.transfer_seconds = time.perf_counter() - started
        return self._table


class _RayRunner:
    """Runs fragments on the workers through Ray, retrying moved or dead ones."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self._puts: dict[int, Any] = {}

    def _refs(self, inputs: Mapping[str, Output]) -> tuple[list[str], list[Any]]:
        """Every input as object references, a name repeated once per part: results still
        on the workers travel worker to worker; client-side tables are put once per query."""
        names: list[str] = []
        refs: list[Any] = []
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
        refs: list[Any],
    ) -> tuple[Any, Any, float]:
        worker = self.session.handle.worker(node)
        submitted = time.time()
        table_ref, stats_ref = worker.execute.options(num_returns=2).remote(
            sql, bindings, epoch, names, self.session.profiling, *refs
        )
        return table_ref, stats_ref, submitted

    def scatter(self, stage: Stage, inputs: Mapping[str, Output]) -> list[FragmentResult]:
        session = self.session
        names, refs = self._refs(inputs)
        results: list[FragmentResult] = []
        assert stage.group is not None
        pending: set[int] | None = None

        def attempt() -> bool:
            nonlocal pending
            catalog = session.catalog
            group = catalog.groups.get(stage.group or "")
            if group is None:
                raise QueryError("a table of the query was dropped while it ran")
            current = {u.unit_id for u in group.units}
            if pending is None or pending - current:
                # first attempt, or a split/merge replaced units still to do: the parts
                # done so far may overlap the new units, so the stage starts over
                results.clear()
                pending = current
            by_node: dict[str, list[int]] = defaultdict(list)
            for unit in group.units:
                if unit.unit_id in pending:
                    by_node[unit.node].append(unit.unit_id)
            calls = _submit_all(
                {
                    node: lambda node=node, units=units: self._call(
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
            for node, (table_ref, stats_ref, submitted) in calls.items():
                try:
                    stats = _unwrap(lambda ref=stats_ref: ray.get(ref))
                except _Transient as error:
                    log.info("fragment retried after %s failed: %s", node, error)
                    _discard(table_ref)
                    continue
                results.append(_fragment_result(node, table_ref, stats, submitted))
                pending -= set(by_node[node])
            return not pending

        session._retrying("query", attempt)
        return results

    def run_on_worker(self, sql: str, inputs: Mapping[str, Output]) -> FragmentResult:
        session = self.session
        names, refs = self._refs(inputs)
        found: list[FragmentResult] = []

        def attempt() -> bool:
            nodes = session.catalog.nodes
            node = nodes[next(session._round_robin) % len(nodes)]
            try:
                table_ref, stats_ref, submitted = _unwrap(
                    lambda: self._call(node, sql, {}, 0, names, refs)
                )
            except _Transient:
                return False
            try:
                stats = _unwrap(lambda: ray.get(stats_ref))
            except _Transient:
                _discard(table_ref)
                return False
            found.append(_fragment_result(node, table_ref, stats, submitted))
            return True

        session._retrying("query", attempt)
        return found[0]


def _discard(ref: Any) -> None:
    """Collect the error of a failed result we will not use, so Ray does not report it."""
    try:
        ray.get(ref, timeout=0)
    except Exception:  # the error is the one already handled
        pass


def _parts(value: Output) -> list[Output]:
    if isinstance(value, Concatenated) and value._table is None:
        return [p for part in value.parts for p in _parts(part)]
    return [value]


def _as_schema(result: pa.Table, schema: pa.Schema) -> pa.Table:
    """The answer with DuckDB's column names, and its types where they convert safely."""
    if result.num_columns != len(schema):
        raise AssertionError(f"plan produced {result.num_columns} columns, query has {len(schema)}")
    result = result.rename_columns(schema.names)
    if result.schema.equals(schema):
        return result
    try:
        return result.cast(schema, safe=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return result


def _open_source(
    source: object, batch_rows: int
) -> tuple[pa.Schema, int, Iterator[pa.RecordBatch]]:
    if isinstance(source, pa.RecordBatch):
        source = pa.Table.from_batches([source])
    if isinstance(source, pa.Table):
        return source.schema, source.num_rows, iter(source.to_batches(max_chunksize=batch_rows))
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
        "a table source is a Parquet file or directory (path or URI) or a pyarrow.Table, "
        f"not {type(source).__name__}"
    )


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


def _read_batches(
    path: str, dataset: ds.FileSystemDataset, batch_rows: int
) -> Iterator[pa.RecordBatch]:
    try:
        yield from dataset.to_batches(batch_size=batch_rows)
    except (pa.ArrowInvalid, OSError) as error:
        raise TableError(f"cannot read Parquet from {path!r}: {error}") from None
