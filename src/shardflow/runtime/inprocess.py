"""The worker protocol in this process: real :class:`WorkerNode` objects (real DuckDB, real
files in the data directory) called directly, so that the migrator and the controller are
tested without Ray. A call runs when it is made; its answer, or its error, waits in the
reply, which raises the same shardflow errors the Ray implementation does. A stopped worker
answers ``WorkerGone``, as a dead actor does.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar, cast

import numpy as np
import pyarrow as pa

from shardflow.config import Settings
from shardflow.errors import ClusterError, Error, WorkerGone
from shardflow.runtime.executor import FragmentResult, Materialized, Output
from shardflow.runtime.protocol import (
    CatalogJson,
    ChangeSet,
    CopyResult,
    ExportPinned,
    FenceResult,
    FinalApplied,
    LoadReport,
    Reply,
    ShardKey,
    SharedRows,
    WorkerInfo,
)
from shardflow.runtime.worker import WorkerNode

if TYPE_CHECKING:
    from shardflow.catalog import Catalog, TableSpec
    from shardflow.control.migration import MovePlan
    from shardflow.sql import Stage
    from shardflow.telemetry.devices import NodeProfile

T = TypeVar("T")


@dataclass(frozen=True)
class Answered(Generic[T]):
    """A call that already ran: its value, or the error ``get`` raises."""

    value: T | None = None
    error: Error | None = None

    def get(self, timeout: float | None = None) -> T:
        if self.error is not None:
            raise self.error
        return cast("T", self.value)


def _rows(rows: pa.Table | SharedRows) -> pa.Table:
    return rows.ref if isinstance(rows, SharedRows) else rows


class LocalWorker:
    """One in-process worker, called through the protocol."""

    def __init__(self, node: WorkerNode, workers: LocalWorkers) -> None:
        self.node = node
        self.alive = True
        self._workers = workers

    @property
    def node_id(self) -> str:
        return self.node.node_id

    def _call(self, call: Callable[[], T]) -> Answered[T]:
        if not self.alive:
            return Answered(error=WorkerGone(f"worker {self.node_id} is gone"))
        try:
            return Answered(call())
        except Error as error:
            return Answered(error=error)
        except Exception as error:  # what Ray reports of an unexpected error in an actor
            return Answered(error=ClusterError(f"worker {self.node_id} failed: {error!r}"))

    # life and reports
    def ping(self) -> Reply[bool]:
        return self._call(lambda: True)

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

    # tables: loads and inserts
    def prepare(self, spec: TableSpec, unit_ids: Sequence[int], primary: bool) -> Reply[None]:
        return self._call(lambda: self.node.prepare(spec, unit_ids, primary))

    def stage(self, table: str, parts: Mapping[int | str, pa.Table | SharedRows]) -> Reply[int]:
        return self._call(lambda: self.node.stage(table, {k: _rows(v) for k, v in parts.items()}))

    def commit_load(self, table: str) -> Reply[int]:
        return self._call(lambda: self.node.commit_load(table))

    def finish_load(self, table: str, catalog: CatalogJson) -> Reply[None]:
        return self._call(lambda: self.node.finish_load(table, catalog))

    def abort_load(self, table: str) -> Reply[None]:
        return self._call(lambda: self.node.abort_load(table))

    def append(
        self,
        table: str,
        parts: Mapping[int, tuple[pa.Table, np.ndarray]],
        batch_id: str,
        epoch: int,
    ) -> Reply[Mapping[int, int]]:
        return self._call(lambda: self.node.append(table, parts, batch_id, epoch))

    def append_replica(self, table: str, rows: pa.Table | SharedRows, batch_id: str) -> Reply[int]:
        return self._call(lambda: self.node.append_replica(table, _rows(rows), batch_id))

    # a move, as its source
    def unit_bytes(self, units: Sequence[int]) -> Reply[int]:
        return self._call(lambda: self.node.unit_bytes(units))

    def fence(self, move_id: str) -> Reply[FenceResult]:
        return self._call(lambda: self.node.source.fence(move_id))

    def retire(self, move_id: str) -> Reply[None]:
        return self._call(lambda: self.node.source.retire(move_id))

    def drop_retired(self, move_id: str) -> Reply[bool]:
        return self._call(lambda: self.node.source.drop_retired(move_id))

    def abort_export(self, move_id: str) -> Reply[None]:
        return self._call(lambda: self.node.source.abort(move_id))

    # a move, as its target
    def memory_headroom(self) -> Reply[int]:
        return self._call(self.node.memory_headroom)

    def copy_snapshot(self, plan: MovePlan, bandwidth_bytes_s: float) -> Reply[CopyResult]:
        return self._call(
            lambda: self.node.target.copy_snapshot(plan, self._workers.link, bandwidth_bytes_s)
        )

    def catch_up(self, move_id: str) -> Reply[int]:
        return self._call(lambda: self.node.target.catch_up(move_id, self._workers.link))

    def apply_final(self, move_id: str, fenced: Sequence[FenceResult]) -> Reply[FinalApplied]:
        return self._call(lambda: self.node.target.apply_final(move_id, fenced))

    def promote(self, move_id: str) -> Reply[None]:
        return self._call(lambda: self.node.target.promote(move_id))

    def abort_import(self, move_id: str) -> Reply[None]:
        return self._call(lambda: self.node.target.abort(move_id))


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
        self, node: str, catalog: CatalogJson, settings: Settings | None = None
    ) -> LocalWorker:
        """A worker for ``node`` that serves what ``catalog`` assigns it (rebuilt from the
        data directory); ``settings`` replace the cluster's for this worker."""
        worker_node = WorkerNode(node, self.data_dir, settings or self.settings, catalog)
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


class LocalRunner:
    """Runs a plan's fragments on in-process workers (an ``executor.Runner``): each worker
    over the shards the catalog routes to it, at the catalog's epoch."""

    def __init__(self, workers: LocalWorkers, catalog: Catalog) -> None:
        self.workers = workers
        self.catalog = catalog

    def scatter(self, stage: Stage, inputs: Mapping[str, Output]) -> list[FragmentResult]:
        assert stage.group is not None
        by_node: dict[str, list[int]] = defaultdict(list)
        for unit in self.catalog.groups[stage.group].units:
            by_node[unit.node].append(unit.unit_id)
        tables = {name: value.table() for name, value in inputs.items()}
        return [
            self._run(node, stage.sql, {t: units for t in stage.tables}, tables)
            for node, units in sorted(by_node.items())
        ]

    def run_on_worker(self, sql: str, inputs: Mapping[str, Output]) -> FragmentResult:
        tables = {name: value.table() for name, value in inputs.items()}
        return self._run(self.catalog.nodes[0], sql, {}, tables)

    def _run(
        self,
        node: str,
        sql: str,
        bindings: Mapping[str, list[int]],
        tables: Mapping[str, pa.Table],
    ) -> FragmentResult:
        submitted = time.time()
        worker = self.workers.get(node).node
        result, stats = worker.execute(sql, bindings, self.catalog.epoch, tables, True)
        return FragmentResult(
            Materialized(result), node, stats.seconds, stats.rows_out, stats, submitted
        )
