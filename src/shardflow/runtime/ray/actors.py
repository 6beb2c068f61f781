"""The Ray actors: pass-throughs that put a :class:`WorkerNode` and a ``CoordinatorNode`` on
the cluster. All logic lives in the roles' own modules; here only what Ray needs. Every
method is a typed actor method (``@ray.method``), so a caller's mistake is a type error,
not a lost call.

An actor reaches the others through what it is given when it starts (``handles.py``'s
coordinator and workers, which find the actors by name): this module imports neither them
nor the bootstrap that starts it. Every worker process loads it, so the control plane is
imported where the coordinator starts, not here.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import ray

from shardflow.audit import AuditLog
from shardflow.catalog import OwnerToken, TableSpec
from shardflow.config import Settings
from shardflow.control.migration import MovePlan
from shardflow.errors import ConfigError
from shardflow.runtime.fastlane import LaneServer, from_wire, to_wire
from shardflow.runtime.protocol import (
    CatalogJson,
    ChangeSet,
    Coordinator,
    CopyResult,
    DrainReport,
    ExportPinned,
    FenceResult,
    FinalApplied,
    FragmentStats,
    Host,
    LaneAddress,
    LoadReport,
    NewTable,
    NodeLoad,
    PreparedChange,
    ShardKey,
    WorkerInfo,
    Workers,
)
from shardflow.runtime.query.executor import concat
from shardflow.runtime.ray.names import NAME_LABEL, SWITCH_INTERVAL_S, WORKER_CONCURRENCY
from shardflow.runtime.wire import PROTOCOL
from shardflow.runtime.worker.endpoint import PartEndpoint
from shardflow.runtime.worker.node import WorkerNode
from shardflow.storage import RowRewrite
from shardflow.telemetry.devices import NodeProfile

if TYPE_CHECKING:
    from shardflow.runtime.ray.membership import Starter


class CoordinatorService:
    """The coordinator actor: a ``CoordinatorNode`` (catalog, controller, console) and, on a
    cluster joined by address, the ``Membership`` that follows its Ray nodes."""

    def __init__(
        self,
        data_dir: str,
        settings: Settings,
        owner: str,
        description: str,
        workers: Workers,
        starter: Starter | None = None,
    ) -> None:
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        # imported here: every worker process loads this module, and none of them needs
        # the control plane (~0.1 s of CPU each at start-up)
        from shardflow.runtime.coordinator.node import CoordinatorNode
        from shardflow.runtime.ray.membership import Membership

        self.node = CoordinatorNode.open(data_dir, settings, workers, owner, description)
        self.membership = (
            Membership(self.node, starter, data_dir, settings) if starter is not None else None
        )
        with warnings.catch_warnings():  # Ray deprecates a call it makes itself here
            warnings.simplefilter("ignore", DeprecationWarning)
            restarted = ray.get_runtime_context().was_current_actor_reconstructed
        # watch workers; finish or roll back moves a crash cut short; on another node after
        # a restart, the cluster runs already: adopt its members and follow its Ray nodes
        self.node.start(restarted)
        if restarted and self.membership is not None:
            self.membership.start()

    # -- Ray nodes joining and leaving --------------------------------------------------
    @ray.method
    def start_joining(self) -> None:
        """From now on (the cluster's first workers run), watch the Ray cluster: a Ray node
        that joins gets workers (``auto_join``)."""
        if self.membership is not None:
            self.membership.start()

    @ray.method
    def join_new_nodes(self) -> list[str]:
        return self.membership.join_new_nodes() if self.membership is not None else []

    @ray.method
    def drain_host(self, host: str, deadline_s: float) -> list[DrainReport]:
        if self.membership is not None:
            return self.membership.leave(host, deadline_s)
        return self.node.drain_host(host, deadline_s)

    @ray.method
    def host(self) -> str:
        """The Ray node the coordinator runs on now."""
        return ray.get_runtime_context().get_node_id()

    # -- the catalog and its owner --------------------------------------------------------
    @ray.method
    def ping(self) -> int:
        """The version of the roles' messages it speaks (``runtime/wire.py``; a release
        before the number was asked answered True: 1)."""
        return PROTOCOL

    @ray.method
    def pid(self) -> int:
        return os.getpid()

    @ray.method
    def catalog(self, tables: list[str] | None = None) -> dict[str, Any]:
        return self.node.catalog(tables)

    @ray.method
    def owner_token(self) -> OwnerToken:
        return self.node.owner_token()

    @ray.method
    def register_nodes(self, nodes: list[str]) -> dict[str, Any]:
        return self.node.register_nodes(nodes)

    @ray.method
    def report_profile(self, profile: NodeProfile) -> None:
        self.node.report_profile(profile)

    @ray.method
    def release(self) -> None:
        self.node.release()

    # -- tables -----------------------------------------------------------------------------
    @ray.method
    def begin_create(self, table: NewTable) -> dict[str, Any]:
        return self.node.begin_create(table)

    @ray.method
    def commit_create(self, name: str, rows: int) -> dict[str, Any]:
        return self.node.commit_create(name, rows)

    @ray.method
    def announce(self, nodes: list[str]) -> None:
        self.node.announce(nodes)

    @ray.method
    def abort_create(self, name: str) -> None:
        self.node.abort_create(name)

    @ray.method
    def drop_table(self, name: str) -> tuple[dict[str, Any], str]:
        return self.node.drop_table(name)

    @ray.method
    def delete_files(self, uid: str) -> None:
        self.node.delete_files(uid)

    @ray.method
    def truncate_table(self, name: str) -> dict[str, Any]:
        return self.node.truncate_table(name)

    @ray.method
    def change_rows(
        self, name: str, statement: str, change: RowRewrite, buckets: list[int] | None
    ) -> dict[str, Any]:
        return self.node.change_rows(name, statement, change, buckets)

    @ray.method
    def set_grants(self, name: str, grants: list[list[str]]) -> dict[str, Any]:
        return self.node.set_grants(name, grants)

    # -- cluster operations -----------------------------------------------------------------
    @ray.method
    def migrate(self, unit_id: int, to: str) -> dict[str, Any]:
        return self.node.migrate(unit_id, to)

    @ray.method
    def split(self, unit_id: int) -> dict[str, Any]:
        return self.node.split(unit_id)

    @ray.method
    def merge(self, first: int, second: int) -> dict[str, Any]:
        return self.node.merge(first, second)

    @ray.method
    def rebalance(self, dry_run: bool) -> dict[str, Any]:
        return self.node.rebalance(dry_run)

    @ray.method
    def cancel(self, move_id: str) -> dict[str, Any]:
        return self.node.cancel(move_id)

    @ray.method
    def pause_balancer(self, paused: bool) -> bool:
        return self.node.pause_balancer(paused)

    @ray.method
    def reserve_node(self) -> str:
        return self.node.reserve_node()

    @ray.method
    def node_joined(self, node: str) -> dict[str, Any]:
        return self.node.node_joined(node)

    @ray.method
    def drain(self, node: str, deadline_s: float) -> DrainReport:
        return self.node.drain(node, deadline_s)

    @ray.method
    def cancel_drain(self, node: str) -> bool:
        return self.node.cancel_drain(node)

    # -- reports ----------------------------------------------------------------------------
    @ray.method
    def migrations(self) -> list[dict[str, Any]]:
        return self.node.migrations()

    @ray.method
    def failovers(self) -> list[dict[str, Any]]:
        return self.node.failovers()

    @ray.method
    def metrics_url(self) -> str:
        return self.node.metrics_url()

    @ray.method
    def node_loads(self) -> dict[str, NodeLoad]:
        return self.node.node_loads()

    @ray.method
    def shard_loads(self) -> dict[ShardKey, float]:
        return self.node.shard_loads()

    @ray.method
    def record_outcomes(self, queries: list[tuple[float, bool]], inserts: list[int]) -> None:
        self.node.record_outcomes(queries, inserts)

    @ray.method
    def record_access(self, denied_action: str | None) -> None:
        self.node.record_access(denied_action)


class WorkerService:
    """A worker actor: one :class:`WorkerNode`, its fast lane, and its links to the other
    workers (a target pulls a move's rows straight from its sources)."""

    def __init__(
        self,
        node_id: str,
        data_dir: str,
        settings: Settings,
        coordinator: Coordinator,
        workers: Workers,
        slowdown: float = 1.0,
    ) -> None:
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self.coordinator = coordinator
        self.workers = workers
        # The worker asks the coordinator what it owns and rebuilds those shards from
        # durable storage before serving.
        catalog = coordinator.catalog().get()
        owner = coordinator.owner_token().get()
        gpus = ray.get_gpu_ids()
        context = ray.get_runtime_context()
        names = context.get_node_labels().get(NAME_LABEL) or [""]
        self.host = Host(
            ray_node_id=context.get_node_id(),
            address=ray.util.get_node_ip_address(),  # type: ignore[no-untyped-call]
            name=names[0] if isinstance(names, list) else str(names),
        )
        self.node = WorkerNode(
            node_id,
            data_dir,
            settings,
            catalog,
            owner=owner,
            slowdown=slowdown,
            gpu_index=int(gpus[0]) if gpus else None,
            host_name=self.host.name,
        )
        kept = self.node.kept_calibration()
        if kept is not None:  # a known kind of node: serves calibrated, measures nothing
            coordinator.report_profile(kept).get()
        # the parts of answers that clients read straight from this worker: reserved over
        # the lane, read from the endpoint (its refusals go to the data directory's audit log)
        home = self.node.data_dir
        self.endpoint = (
            PartEndpoint(
                self.node,
                self.host.address,
                node_id,
                AuditLog(home.root) if home.local else None,
                WORKER_CONCURRENCY,
                _tls_material(settings),
                settings.endpoint_port,
            )
            if settings.fast_lane
            else None
        )
        self.lane = (
            LaneServer(
                self._run_fragment,
                self.host.address,
                node_id,
                WORKER_CONCURRENCY,
                stage=self.node.stage,
                source=self.node.source,
                finish=self._finish_import,
                reserve=self.endpoint.reserve if self.endpoint is not None else None,
                endpoint=self.endpoint.location if self.endpoint is not None else "",
                cancel=self.endpoint.cancel if self.endpoint is not None else None,
            )
            if settings.fast_lane
            else None
        )

    def _run_fragment(
        self,
        sql: str,
        bindings: Mapping[str, list[int]],
        epoch: int,
        profile: bool,
        inputs: Mapping[str, pa.Table],
        commits: Mapping[str, int],
        emit: Callable[[pa.Table], None] | None = None,
    ) -> tuple[pa.Table, FragmentStats]:
        return self.node.execute(sql, bindings, epoch, inputs, profile, commits, emit)

    @ray.method
    def calibrate(self) -> NodeProfile:
        """Measure the device and tell the coordinator (called once the cluster is up, one
        worker at a time, so that workers do not slow each other down while measuring; a
        worker that started with a kept calibration has none to make)."""
        profile = self.node.calibrate()
        self.coordinator.report_profile(profile).get()
        return profile

    @ray.method
    def info(self) -> WorkerInfo:
        return dataclasses.replace(self.node.info(), host=self.host)

    @ray.method
    def pid(self) -> int:
        return os.getpid()

    @ray.method
    def ping(self) -> bool:
        return True

    @ray.method
    def fast_lane(self) -> LaneAddress | None:
        """Where this worker answers fragments directly (None: it does not)."""
        return self.lane.address if self.lane is not None else None

    @ray.method
    def load_report(self) -> LoadReport:
        return self.node.load_report()

    @ray.method
    def sync(self, catalog: CatalogJson) -> int:
        return self.node.sync(catalog)

    @ray.method
    def follow(self, changes: list[CatalogJson]) -> int:
        return self.node.follow(changes)

    # -- tables: loads and inserts ----------------------------------------------------------
    @ray.method
    def prepare(self, spec: TableSpec, unit_ids: list[int], primary: bool) -> None:
        self.node.prepare(spec, unit_ids, primary)

    @ray.method
    def stage(self, table: str, keys: list[int | str], *parts: pa.Table) -> int:
        # parts travel as top-level arguments so that Ray resolves object references
        return self.node.stage(table, dict(zip(keys, parts, strict=True)))

    @ray.method
    def commit_load(self, table: str) -> int:
        return self.node.commit_load(table)

    @ray.method
    def finish_load(self, table: str) -> None:
        self.node.finish_load(table)

    @ray.method
    def abort_load(self, table: str) -> None:
        self.node.abort_load(table)

    @ray.method
    def append(
        self,
        table: str,
        parts: Mapping[int, tuple[pa.Table, np.ndarray]],
        batch_id: str,
        epoch: int,
        commit: int | None = None,
    ) -> dict[int, int]:
        return self.node.append(table, parts, batch_id, epoch, commit)

    @ray.method
    def append_replica(
        self, table: str, part: pa.Table, batch_id: str, commit: int | None = None
    ) -> int:
        return self.node.append_replica(table, part, batch_id, commit)

    @ray.method(num_returns=2)
    def execute(
        self,
        sql: str,
        bindings: Mapping[str, list[int]],
        epoch: int,
        commits: Mapping[str, int],
        names: list[str],
        profile: bool,
        *parts: pa.Table | pa.Buffer,
    ) -> tuple[pa.Buffer, FragmentStats]:
        """Two answers: the result (as :func:`to_wire` writes it) stays in the object store
        for whoever needs it (the client, or the workers of a later stage) while the caller
        learns what was measured. An input may come in several parts (the fragment results
        of an earlier stage)."""
        inputs: dict[str, list[pa.Table]] = {}
        for name, part in zip(names, parts, strict=True):
            inputs.setdefault(name, []).append(from_wire(part))
        tables = {name: concat(chunks) for name, chunks in inputs.items()}
        result, stats = self.node.execute(sql, bindings, epoch, tables, profile, commits)
        return to_wire(result), stats

    # -- a live move, as its source -----------------------------------------------------------
    @ray.method
    def unit_bytes(self, units: list[int]) -> int:
        return self.node.unit_bytes(units)

    @ray.method
    def export_begin(self, plan: MovePlan) -> ExportPinned:
        return self.node.source.pin(plan)

    @ray.method
    def export_chunk(self, move_id: str, key: ShardKey) -> pa.Table | None:
        return self.node.source.chunk(move_id, key)

    @ray.method
    def export_changes(self, move_id: str, since: Mapping[ShardKey, int]) -> ChangeSet:
        return self.node.source.changes(move_id, since)

    @ray.method
    def fence(self, move_id: str) -> FenceResult:
        return self.node.source.fence(move_id)

    @ray.method
    def retire(self, move_id: str) -> float | None:
        return self.node.source.retire(move_id)

    @ray.method
    def drop_retired(self, move_id: str) -> bool:
        return self.node.source.drop_retired(move_id)

    @ray.method
    def prepare_change(
        self, table: str, statement: str, commit: int, change: RowRewrite, units: list[int] | None
    ) -> PreparedChange:
        return self.node.prepare_change(table, statement, commit, change, units)

    @ray.method
    def prepare_rows(
        self,
        table: str,
        statement: str,
        commit: int,
        parts: dict[int, tuple[pa.Table, np.ndarray]],
    ) -> None:
        self.node.prepare_rows(table, statement, commit, parts)

    @ray.method
    def abort_change(self, table: str, statement: str) -> None:
        self.node.abort_change(table, statement)

    @ray.method
    def abort_export(self, move_id: str) -> None:
        self.node.source.abort(move_id)

    # -- a live move, as its target -----------------------------------------------------------
    @ray.method
    def memory_headroom(self) -> int:
        return self.node.memory_headroom()

    @ray.method
    def copy_snapshot(self, plan: MovePlan, bandwidth_bytes_s: float) -> CopyResult:
        return self.node.target.copy_snapshot(plan, self.workers.link, bandwidth_bytes_s)

    @ray.method
    def catch_up(self, move_id: str) -> int:
        return self.node.target.catch_up(move_id, self.workers.link)

    @ray.method
    def finish_import(self, move_id: str) -> FinalApplied:
        return self._finish_import(move_id)

    def _finish_import(self, move_id: str) -> FinalApplied:
        """Also asked over the fast lane (``fastlane.Finish``)."""
        return self.node.target.finish_import(move_id, self.workers.link)

    @ray.method
    def promote(self, move_id: str) -> None:
        self.node.target.promote(move_id)

    @ray.method
    def abort_import(self, move_id: str) -> None:
        self.node.target.abort(move_id)

    @ray.method
    def cancel_import(self, move_id: str) -> None:
        self.node.target.cancel(move_id)


CoordinatorActor = ray.remote(CoordinatorService)
WorkerActor = ray.remote(WorkerService)


def _tls_material(settings: Settings) -> tuple[bytes, bytes] | None:
    """The certificate and key the worker's endpoint serves TLS with (None: plain gRPC)."""
    if not settings.endpoint_tls_cert:
        return None
    try:
        with (
            open(settings.endpoint_tls_cert, "rb") as cert,
            open(settings.endpoint_tls_key, "rb") as key,
        ):
            return cert.read(), key.read()
    except OSError as error:
        raise ConfigError(f"cannot read the workers' endpoint TLS files: {error}") from None
