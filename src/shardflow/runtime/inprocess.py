"""The protocol in this process: a real ``CoordinatorNode`` and real :class:`WorkerNode`
objects (real DuckDB, real files in the data directory) called directly: a cluster without
Ray for a command or script on a data directory (``connect(in_process=True)``), and the
session, the migrator and the controller tested without Ray. A call runs when it is made; its
answer, or its error, waits in the reply, which raises the same shardflow errors the Ray
implementation does. A stopped worker answers ``WorkerGone``, as a dead actor does.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import numpy as np
import pyarrow as pa

from shardflow.catalog import lease, recorded_catalog
from shardflow.config import Settings
from shardflow.errors import ClusterError, ConfigError, Error, WorkerGone
from shardflow.runtime.coordinator.node import CoordinatorNode
from shardflow.runtime.coordinator.state import CoordinatorState
from shardflow.runtime.protocol import (
    Answered,
    CatalogJson,
    ChangeSet,
    CopyResult,
    DrainReport,
    ExportPinned,
    FenceResult,
    FinalApplied,
    FragmentStats,
    LaneAddress,
    LoadReport,
    NewTable,
    NodeLoad,
    PreparedChange,
    Reply,
    ShardKey,
    SharedRows,
    WorkerInfo,
    admit_workers,
)
from shardflow.runtime.query.fragments import WorkerCalls
from shardflow.runtime.wire import PROTOCOL
from shardflow.runtime.worker.local import machine_share
from shardflow.runtime.worker.node import WorkerNode
from shardflow.storage import RowRewrite

if TYPE_CHECKING:
    from shardflow.catalog import OwnerToken, TableSpec
    from shardflow.control.migration import MovePlan
    from shardflow.telemetry.devices import NodeProfile

T = TypeVar("T")

IN_PROCESS_WORKERS = 4
"""Nodes of a new cluster in this process where none is asked for (as an embedded one)."""


def _rows(rows: pa.Table | SharedRows) -> pa.Table:
    return cast("pa.Table", rows.ref) if isinstance(rows, SharedRows) else rows


def _call(who: str, call: Callable[[], T]) -> Answered[T]:
    """Run ``call`` now; its answer or error waits in the reply (an unexpected error as
    Ray reports one raised in an actor)."""
    try:
        return Answered(call())
    except Error as error:
        return Answered(error=error)
    except Exception as error:
        return Answered(error=ClusterError(f"{who} failed: {error!r}"))


class LocalWorker:
    """One in-process worker, called through the protocol."""

    def __init__(self, node: WorkerNode, workers: LocalWorkers) -> None:
        self.node = node
        self.alive = True
        self._workers = workers

    @property
    def node_id(self) -> str:
        return self.node.node_id

    @property
    def instance(self) -> object:
        return self.node

    def _call(self, call: Callable[[], T]) -> Answered[T]:
        if not self.alive:
            return Answered(error=WorkerGone(f"worker {self.node_id} is gone"))
        answered = _call(f"worker {self.node_id}", call)
        if answered.error is not None and not self.alive:  # stopped under the call (its
            # engine closed): as Ray reports an actor that died in a call, not as its fault
            return Answered(error=WorkerGone(f"worker {self.node_id} stopped during the call"))
        return answered

    # life and reports
    def ping(self) -> Reply[bool]:
        return self._call(lambda: True)

    def fast_lane(self) -> Reply[LaneAddress | None]:
        return self._call(lambda: None)  # called directly: no lane

    def pid(self) -> Reply[int]:
        return self._call(os.getpid)

    def info(self) -> Reply[WorkerInfo]:
        return self._call(self.node.info)

    def load_report(self) -> Reply[LoadReport]:
        return self._call(self.node.load_report)

    def calibrate(self) -> Reply[NodeProfile]:
        def calibrate() -> NodeProfile:
            profile = self.node.calibrate()
            self._workers.report_profile(profile)
            return profile

        return self._call(calibrate)

    def sync(self, catalog: CatalogJson) -> Reply[int]:
        return self._call(lambda: self.node.sync(catalog))

    def follow(self, changes: Sequence[CatalogJson]) -> Reply[int]:
        return self._call(lambda: self.node.follow(changes))

    # tables: loads and inserts
    def prepare(self, spec: TableSpec, unit_ids: Sequence[int], primary: bool) -> Reply[None]:
        return self._call(lambda: self.node.prepare(spec, unit_ids, primary))

    def stage(self, table: str, parts: Mapping[int | str, pa.Table | SharedRows]) -> Reply[int]:
        return self._call(lambda: self.node.stage(table, {k: _rows(v) for k, v in parts.items()}))

    def commit_load(self, table: str) -> Reply[int]:
        return self._call(lambda: self.node.commit_load(table))

    def finish_load(self, table: str) -> Reply[None]:
        return self._call(lambda: self.node.finish_load(table))

    def abort_load(self, table: str) -> Reply[None]:
        return self._call(lambda: self.node.abort_load(table))

    def append(
        self,
        table: str,
        parts: Mapping[int, tuple[pa.Table, np.ndarray]],
        batch_id: str,
        epoch: int,
        commit: int | None = None,
    ) -> Reply[Mapping[int, int]]:
        return self._call(lambda: self.node.append(table, parts, batch_id, epoch, commit))

    def append_replica(
        self, table: str, rows: pa.Table | SharedRows, batch_id: str, commit: int | None = None
    ) -> Reply[int]:
        return self._call(lambda: self.node.append_replica(table, _rows(rows), batch_id, commit))

    # queries
    def execute(
        self,
        sql: str,
        bindings: Mapping[str, list[int]],
        epoch: int,
        profile: bool,
        inputs: Mapping[str, pa.Table],
        commits: Mapping[str, int] | None = None,
    ) -> Reply[tuple[pa.Table, FragmentStats]]:
        return self._call(lambda: self.node.execute(sql, bindings, epoch, inputs, profile, commits))

    # a move, as its source
    def unit_bytes(self, units: Sequence[int]) -> Reply[int]:
        return self._call(lambda: self.node.unit_bytes(units))

    def retire(self, move_id: str) -> Reply[float | None]:
        return self._call(lambda: self.node.source.retire(move_id))

    def drop_retired(self, move_id: str) -> Reply[bool]:
        return self._call(lambda: self.node.source.drop_retired(move_id))

    def abort_export(self, move_id: str) -> Reply[None]:
        return self._call(lambda: self.node.source.abort(move_id))

    def prepare_change(
        self,
        table: str,
        statement: str,
        commit: int,
        change: RowRewrite,
        units: Sequence[int] | None = None,
    ) -> Reply[PreparedChange]:
        return self._call(lambda: self.node.prepare_change(table, statement, commit, change, units))

    def prepare_rows(
        self,
        table: str,
        statement: str,
        commit: int,
        parts: Mapping[int, tuple[pa.Table, np.ndarray]],
    ) -> Reply[None]:
        return self._call(lambda: self.node.prepare_rows(table, statement, commit, parts))

    def abort_change(self, table: str, statement: str) -> Reply[None]:
        return self._call(lambda: self.node.abort_change(table, statement))

    # a move, as its target
    def memory_headroom(self) -> Reply[int]:
        return self._call(self.node.memory_headroom)

    def copy_snapshot(self, plan: MovePlan, bandwidth_bytes_s: float) -> Reply[CopyResult]:
        return self._call(
            lambda: self.node.target.copy_snapshot(plan, self._workers.link, bandwidth_bytes_s)
        )

    def catch_up(self, move_id: str) -> Reply[int]:
        return self._call(lambda: self.node.target.catch_up(move_id, self._workers.link))

    def finish_import(self, move_id: str) -> Reply[FinalApplied]:
        return self._call(lambda: self.node.target.finish_import(move_id, self._workers.link))

    def promote(self, move_id: str) -> Reply[None]:
        return self._call(lambda: self.node.target.promote(move_id))

    def abort_import(self, move_id: str) -> Reply[None]:
        return self._call(lambda: self.node.target.abort(move_id))

    def cancel_import(self, move_id: str) -> Reply[None]:
        return self._call(lambda: self.node.target.cancel(move_id))


class LocalSourceLink:
    """A target's link to a source worker in the same process."""

    def __init__(self, source: LocalWorker) -> None:
        self.source = source

    def pin(self, plan: MovePlan) -> ExportPinned:
        return self.source._call(lambda: self.source.node.source.pin(plan)).get()

    def chunks(self, move_id: str, key: ShardKey) -> Iterator[pa.Table]:
        while True:
            chunk = self.source._call(lambda: self.source.node.source.chunk(move_id, key)).get()
            if chunk is None:
                return
            yield chunk

    def changes(self, move_id: str, since: Mapping[ShardKey, int]) -> Reply[ChangeSet]:
        return self.source._call(lambda: self.source.node.source.changes(move_id, since))

    def fence(self, move_id: str) -> Reply[FenceResult]:
        return self.source._call(lambda: self.source.node.source.fence(move_id))


class LocalWorkers:
    """In-process workers over one data directory: start them, stop them (they answer
    ``WorkerGone`` from then on, as a killed actor does), look them up."""

    def __init__(
        self,
        data_dir: str,
        settings: Settings,
        report_profile: Callable[[NodeProfile], None] | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.settings = settings
        self._report_profile = report_profile
        self._workers: dict[str, LocalWorker] = {}

    def start(
        self,
        node: str,
        catalog: CatalogJson,
        settings: Settings | None = None,
        slowdown: float = 1.0,
    ) -> LocalWorker:
        """A worker for ``node`` that serves what ``catalog`` assigns it (rebuilt from the
        data directory); ``settings`` replace the cluster's for this worker."""
        worker_node = WorkerNode(
            node, self.data_dir, settings or self.settings, catalog, slowdown=slowdown
        )
        worker = self._workers[node] = LocalWorker(worker_node, self)
        return worker

    def stop(self, node: str) -> None:
        worker = self._workers.pop(node, None)
        if worker is not None:
            worker.alive = False
            worker.node.engine.close()

    def close(self) -> None:
        for node in list(self._workers):
            self.stop(node)

    def get(self, node: str) -> LocalWorker:
        worker = self._workers.get(node)
        if worker is None:
            raise WorkerGone(f"worker {node} is not running")
        return worker

    def forget(self, node: str) -> None:
        """Nothing is cached here: a stopped worker is gone, a started one is found."""

    def fence(self, node: str) -> None:
        if node in self._workers:
            self.stop(node)

    def share(self, rows: pa.Table) -> SharedRows:
        return SharedRows(rows)

    def link(self, node: str) -> LocalSourceLink:
        return LocalSourceLink(self.get(node))

    def report_profile(self, profile: NodeProfile) -> None:
        if self._report_profile is not None:
            self._report_profile(profile)


class LocalCoordinator:
    """The coordinator in this process, called through the protocol."""

    def __init__(self, node: CoordinatorNode) -> None:
        self.node = node

    def _call(self, call: Callable[[], T]) -> Answered[T]:
        return _call("the coordinator", call)

    # the catalog and its owner
    def ping(self) -> Reply[int]:
        return self._call(lambda: PROTOCOL)

    def catalog(self, tables: Sequence[str] | None = None) -> Reply[CatalogJson]:
        return self._call(lambda: self.node.catalog(None if tables is None else list(tables)))

    def owner_token(self) -> Reply[OwnerToken]:
        return self._call(self.node.owner_token)

    def register_nodes(self, nodes: list[str]) -> Reply[CatalogJson]:
        return self._call(lambda: self.node.register_nodes(nodes))

    def report_profile(self, profile: NodeProfile) -> Reply[None]:
        return self._call(lambda: self.node.report_profile(profile))

    def release(self) -> Reply[None]:
        return self._call(self.node.release)

    # tables
    def begin_create(self, table: NewTable) -> Reply[CatalogJson]:
        return self._call(lambda: self.node.begin_create(table))

    def commit_create(self, name: str, rows: int) -> Reply[CatalogJson]:
        return self._call(lambda: self.node.commit_create(name, rows))

    def announce(self, nodes: Sequence[str]) -> Reply[None]:
        return self._call(lambda: self.node.announce(nodes))

    def abort_create(self, name: str) -> Reply[None]:
        return self._call(lambda: self.node.abort_create(name))

    def drop_table(self, name: str) -> Reply[tuple[CatalogJson, str]]:
        return self._call(lambda: self.node.drop_table(name))

    def delete_files(self, uid: str) -> Reply[None]:
        return self._call(lambda: self.node.delete_files(uid))

    def truncate_table(self, name: str) -> Reply[CatalogJson]:
        return self._call(lambda: self.node.truncate_table(name))

    def change_rows(
        self,
        name: str,
        statement: str,
        change: RowRewrite,
        buckets: Sequence[int] | None = None,
    ) -> Reply[dict[str, Any]]:
        return self._call(lambda: self.node.change_rows(name, statement, change, buckets))

    def set_grants(self, name: str, grants: Sequence[Sequence[str]]) -> Reply[CatalogJson]:
        return self._call(lambda: self.node.set_grants(name, [list(g) for g in grants]))

    # cluster operations
    def migrate(self, unit_id: int, to: str) -> Reply[dict[str, Any]]:
        return self._call(lambda: self.node.migrate(unit_id, to))

    def split(self, unit_id: int) -> Reply[dict[str, Any]]:
        return self._call(lambda: self.node.split(unit_id))

    def merge(self, first: int, second: int) -> Reply[dict[str, Any]]:
        return self._call(lambda: self.node.merge(first, second))

    def rebalance(self, dry_run: bool) -> Reply[dict[str, Any]]:
        return self._call(lambda: self.node.rebalance(dry_run))

    def cancel(self, move_id: str) -> Reply[dict[str, Any]]:
        return self._call(lambda: self.node.cancel(move_id))

    def pause_balancer(self, paused: bool) -> Reply[bool]:
        return self._call(lambda: self.node.pause_balancer(paused))

    def reserve_node(self) -> Reply[str]:
        return self._call(self.node.reserve_node)

    def node_joined(self, node: str) -> Reply[CatalogJson]:
        return self._call(lambda: self.node.node_joined(node))

    def drain(self, node: str, deadline_s: float) -> Reply[DrainReport]:
        return self._call(lambda: self.node.drain(node, deadline_s))

    def cancel_drain(self, node: str) -> Reply[bool]:
        return self._call(lambda: self.node.cancel_drain(node))

    def host(self) -> Reply[str]:
        return self._call(lambda: "")  # no Ray node: this process

    def drain_host(self, host: str, deadline_s: float) -> Reply[list[DrainReport]]:
        return self._call(lambda: self.node.drain_host(host, deadline_s))

    # reports
    def migrations(self) -> Reply[list[dict[str, Any]]]:
        return self._call(self.node.migrations)

    def failovers(self) -> Reply[list[dict[str, Any]]]:
        return self._call(self.node.failovers)

    def metrics_url(self) -> Reply[str]:
        return self._call(self.node.metrics_url)

    def node_loads(self) -> Reply[dict[str, NodeLoad]]:
        return self._call(self.node.node_loads)

    def shard_loads(self) -> Reply[dict[ShardKey, float]]:
        return self._call(self.node.shard_loads)

    def record_outcomes(self, queries: list[tuple[float, bool]], inserts: list[int]) -> Reply[None]:
        return self._call(lambda: self.node.record_outcomes(queries, inserts))

    def record_access(self, denied_action: str | None) -> Reply[None]:
        return self._call(lambda: self.node.record_access(denied_action))


class LocalBackend:
    """A whole cluster in this process, as a session uses it: the coordinator (catalog,
    controller, migrator, console) over in-process workers of one data directory."""

    def __init__(
        self, data_dir: str, settings: Settings, nodes: int | Sequence[str], description: str = ""
    ) -> None:
        self.data_dir = data_dir
        self.settings = settings
        state = CoordinatorState(data_dir, settings, description=description)
        self.local_workers = LocalWorkers(data_dir, settings, self._report_profile)
        self.node = CoordinatorNode(state, self.local_workers, settings)
        self.local_coordinator = LocalCoordinator(self.node)
        try:
            names = [f"node-{i}" for i in range(nodes)] if isinstance(nodes, int) else nodes
            catalog = state.register_nodes(list(names))
            for node in state.catalog.nodes:
                self.local_workers.start(node, catalog)
        except BaseException:
            self.close()  # nothing half-started stays behind, the lease included
            raise

    def _report_profile(self, profile: NodeProfile) -> None:
        self.node.report_profile(profile)

    def restart_coordinator(self) -> CoordinatorNode:
        """A new coordinator over the same data directory and workers, as Ray restarts a
        coordinator actor that died: it takes the lease again as the same owner and reads
        the catalog; the moves the old one left are finished or rolled back by its
        controller's ``resume``. The old one's loops and console stop."""
        old = self.node
        old.close()
        state = CoordinatorState(self.data_dir, self.settings, owner=old.state.owner.owner)
        self.node = CoordinatorNode(state, self.local_workers, self.settings)
        self.local_coordinator.node = self.node
        return self.node

    @property
    def coordinator(self) -> LocalCoordinator:
        return self.local_coordinator

    @property
    def workers(self) -> LocalWorkers:
        return self.local_workers

    def fragment_calls(self) -> WorkerCalls:
        return WorkerCalls(self.local_workers)

    def start_worker(self, node: str, slowdown: float) -> LocalWorker:
        return self.local_workers.start(node, self.node.catalog(), slowdown=slowdown)

    def leave_running(self) -> None:
        raise ConfigError(
            "a cluster in this process stops with it; only a cluster on a Ray cluster "
            "joined by address (connect(address=...)) keeps running"
        )

    def close(self) -> None:
        """Stop the coordinator's loops and console and every worker, then give the data
        directory up: the next cluster on it takes it over at once."""
        self.node.close()
        self.local_workers.close()
        self.node.state.release_lease()


def launch_in_process(data_dir: str, workers: int | None, settings: Settings) -> LocalBackend:
    """The cluster of ``data_dir`` in this process, without Ray: the cluster the data
    directory last had (its nodes under their ids, so that no unit moves), or ``workers``
    nodes for a new one (4 by default). The workers share this machine's cores and memory
    as an embedded cluster's do; those without a kept calibration calibrate first."""
    recorded = recorded_catalog(data_dir)
    count = workers or len(recorded.nodes) or IN_PROCESS_WORKERS
    settings = machine_share(settings, count)
    description = lease.this_process("in-process cluster")
    backend = LocalBackend(data_dir, settings, recorded.node_ids(count), description)
    try:
        catalog = backend.node.catalog()
        admit_workers(
            [backend.workers.get(n) for n in backend.node.state.catalog.nodes], None, catalog
        )
    except BaseException:
        backend.close()
        raise
    return backend
