"""The Ray actors: thin wrappers that put :class:`WorkerNode` and :class:`CoordinatorState`
on the cluster. All logic lives in those classes; here only what Ray needs. Every method is a
typed actor method (``@ray.method``), so a caller's mistake is a type error, not a lost call.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time
import warnings
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import pyarrow as pa
import ray
from ray._private import state as ray_state
from ray.exceptions import RayTaskError

from shardflow.catalog import DataDir, OwnerToken, TableSpec
from shardflow.config import Settings
from shardflow.control.migration import MovePlan
from shardflow.errors import ConfigError, Error
from shardflow.runtime.executor import FragmentStats, concat
from shardflow.runtime.fastlane import LaneAddress, Lanes, LaneServer, from_wire, to_wire
from shardflow.runtime.protocol import (
    CatalogJson,
    ChangeSet,
    CopyResult,
    DrainReport,
    ExportPinned,
    FenceResult,
    FinalApplied,
    Host,
    LoadReport,
    NodeLoad,
    ShardKey,
    WorkerInfo,
)
from shardflow.runtime.ray_workers import (
    NAMESPACE,
    RaySourceLink,
    RayWorkers,
    coordinator_actor_name,
    worker_actor_name,
)
from shardflow.runtime.raynode import NAME_LABEL
from shardflow.runtime.slots import Slot, slot_options, worker_slots
from shardflow.runtime.worker import WorkerNode, check_shared
from shardflow.telemetry.devices import NodeProfile

if TYPE_CHECKING:
    from shardflow.runtime.ray_workers import CoordinatorHandle, WorkerHandle

log = logging.getLogger(__name__)
JOIN_INTERVAL_S = 2.0
"""How often a coordinator with ``auto_join`` looks for Ray nodes without workers, and for
Ray nodes being drained."""
RAY_DRAIN_DEFAULT_S = 300.0
"""How long the workers of a Ray node drained without a deadline may take to drain."""
RAY_DRAIN_MARGIN_S = 5.0
"""Drains end this long before the Ray node's own drain deadline."""

LOOPBACK = "127.0.0.1"
WORKER_CONCURRENCY = 16
COORDINATOR_CONCURRENCY = 16
SWITCH_INTERVAL_S = 0.001
"""How long a thread of a coordinator or worker process may keep the GIL while another
waits for it (Python's default is 5 ms). A control call — a move's fence, its retire —
waits for the GIL behind the fragments' and the copy's threads several times on its way:
under bench/elasticity.py's load the fence's own phase took p50 29-36 ms at 5 ms and
11-15 ms at 1 ms. The process runs nothing but its actor."""


class CoordinatorService:
    """The coordinator actor: the control plane (:class:`CoordinatorState`, the
    :class:`Controller`), its Prometheus endpoint and the read-only console page beside it."""

    def __init__(
        self,
        data_dir: str,
        settings: Settings,
        prefix: str,
        owner: str,
        description: str,
        detached: bool = False,
    ) -> None:
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        # imported here: every worker process loads this module, and none of them needs
        # the control plane (~0.1 s of CPU each at start-up)
        from shardflow.runtime.controller import Controller
        from shardflow.runtime.coordinator import CoordinatorState
        from shardflow.telemetry.console import ConsoleServer
        from shardflow.telemetry.metrics import registry_for

        self.state = CoordinatorState(data_dir, settings, owner, description)
        self.workers = RayWorkers(prefix)
        self.controller = Controller(self.state, self.workers, settings)
        registry, self.controller.recorder = registry_for(self.controller.gauges)
        self.console = ConsoleServer(
            settings.metrics_port, registry, self.controller.console_state, host=LOOPBACK
        )
        self.metrics_port = self.console.port
        self.prefix = prefix
        self.data_dir = data_dir
        self.settings = settings
        self.detached = detached
        self._hosts: dict[str, str] = {}
        """The Ray node of every worker seen (a node's worker never moves)."""
        self._leaving: set[str] = set()
        """Ray nodes being drained to leave: no worker is started on them again."""
        self._refused: dict[str, str] = {}
        """Ray nodes that cannot serve (they do not reach the data directory), and why."""
        self._joining = threading.Lock()
        self.controller.start()  # watch workers; finish or roll back moves a crash cut short
        with warnings.catch_warnings():  # Ray deprecates a call it makes itself here
            warnings.simplefilter("ignore", DeprecationWarning)
            restarted = ray.get_runtime_context().was_current_actor_reconstructed
        if restarted:  # on another node: the cluster runs already
            self.controller.adopt()
            self._start_joining()

    # -- Ray nodes joining and leaving --------------------------------------------------
    @ray.method
    def start_joining(self) -> None:
        """From now on (the cluster's first workers run), watch the Ray cluster: a Ray node
        that joins gets workers (``auto_join``)."""
        self._start_joining()

    def _start_joining(self) -> None:
        if self.detached and self.settings.auto_join:
            threading.Thread(target=self._join_loop, name="join", daemon=True).start()

    def _join_loop(self) -> None:
        while not self.controller.stopped.wait(JOIN_INTERVAL_S):
            try:
                self._follow_ray_drains()
                self._join_new_nodes()
            except Exception:  # the next round tries again; the loop must not die
                log.exception("following the Ray nodes failed")

    def _follow_ray_drains(self) -> None:
        """A Ray node being drained (``ray drain-node``, the autoscaler, KubeRay scaling
        down) is leaving gracefully: drain its workers before its deadline."""
        draining: dict[str, int] = ray_state.state.get_draining_nodes()
        for ray_node_id, deadline_ms in draining.items():
            with self._joining:
                if ray_node_id in self._leaving:
                    continue
                self._leaving.add(ray_node_id)
            left = deadline_ms / 1000 - time.time() if deadline_ms else RAY_DRAIN_DEFAULT_S
            deadline_s = max(1.0, left - RAY_DRAIN_MARGIN_S)
            log.info("Ray node %s is draining: draining its workers (%.0fs)", ray_node_id, left)
            threading.Thread(
                target=self._leave, args=(ray_node_id, deadline_s), daemon=True
            ).start()

    @ray.method
    def join_new_nodes(self) -> list[str]:
        """Start a worker on every slot of an alive Ray node that has none (a node that
        joined, or one whose worker died); returns the nodes that joined."""
        return self._join_new_nodes()

    def _join_new_nodes(self) -> list[str]:
        with self._joining:
            held = Counter(self._live_hosts().values())
            joined = []
            for slot in worker_slots(ray.nodes()):  # type: ignore[no-untyped-call]
                if slot.ray_node_id in self._leaving or slot.ray_node_id in self._refused:
                    continue
                if held[slot.ray_node_id] > 0:
                    held[slot.ray_node_id] -= 1
                    continue
                node = self._join(slot)
                if node is not None:
                    joined.append(node)
            return joined

    def _live_hosts(self) -> dict[str, str]:
        """The Ray node of every member (a member whose worker died counts until the watch
        loop fails it over: its Ray node gets a new worker in the round after that). A
        member's node is asked once; one that does not answer is not counted."""
        hosts = {}
        for node in self.state.catalog.nodes:
            if node not in self._hosts:
                try:
                    info = self.workers.get(node).info().get(timeout=self.settings.retry_deadline_s)
                except Error:
                    continue
                self._hosts[node] = info.host.ray_node_id
            hosts[node] = self._hosts[node]
        return hosts

    def _answers(self, node: str) -> bool:
        try:
            return self.workers.get(node).ping().get(timeout=self.settings.retry_deadline_s)
        except Error:
            return False

    def _join(self, slot: Slot) -> str | None:
        try:
            check_storage_on([slot], self.data_dir, self.state.owner)
        except ConfigError as error:  # it will not reach it later either: never asked again
            log.warning("Ray node %s gets no worker: %s", slot.name, error)
            self._refused[slot.ray_node_id] = str(error)
            return None
        node = self.state.reserve_node()
        actor = spawn_worker(self.prefix, node, self.data_dir, self.settings, slot, detached=True)
        worker = self.workers.add(node, actor)
        try:
            worker.info().get(timeout=self.settings.retry_deadline_s)
            worker.calibrate().get(timeout=self.settings.retry_deadline_s)
        except Error as error:  # its Ray node went away meanwhile
            log.warning("%s did not start on Ray node %s: %s", node, slot.name, error)
            self.workers.kill(node)
            return None
        self._hosts[node] = slot.ray_node_id
        self.controller.broadcast(self.state.node_joined(node), wait=False)
        log.info("%s joined on Ray node %s (%s)", node, slot.name, slot.ray_node_id)
        return node

    @ray.method
    def leave(self, ray_node_id: str, deadline_s: float) -> list[DrainReport]:
        """Drain every worker on a Ray node that is about to leave, and stop them; no
        worker starts there again."""
        return self._leave(ray_node_id, deadline_s)

    def _leave(self, ray_node_id: str, deadline_s: float) -> list[DrainReport]:
        with self._joining:
            self._leaving.add(ray_node_id)
        reports = []
        for node, host in self._live_hosts().items():
            if host == ray_node_id and self._answers(node):  # a dead one is failed over
                report = self.controller.drain(node, deadline_s)
                if report.drained:
                    self.workers.kill(node)
                reports.append(report)
        return reports

    @ray.method
    def metrics_url(self) -> str:
        return f"http://{LOOPBACK}:{self.metrics_port}/metrics"

    @ray.method
    def record_outcomes(self, queries: list[tuple[float, bool]], inserts: list[int]) -> None:
        """Queries' (seconds, succeeded) and inserts' row counts, sent in batches by each
        session."""
        if self.controller.recorder is not None:
            for seconds, ok in queries:
                self.controller.recorder.query(seconds, ok)
            for rows in inserts:
                self.controller.recorder.insert(rows)

    @ray.method
    def record_access(self, denied_action: str | None) -> None:
        if self.controller.recorder is not None:
            self.controller.recorder.access(denied_action)

    @ray.method
    def ping(self) -> bool:
        return True

    @ray.method
    def pid(self) -> int:
        return os.getpid()

    @ray.method
    def ray_node_id(self) -> str:
        """The Ray node the coordinator runs on now."""
        return ray.get_runtime_context().get_node_id()

    @ray.method
    def owner_token(self) -> OwnerToken:
        """The token every durable write of this cluster carries."""
        return self.state.owner

    @ray.method
    def release(self) -> None:
        """Stop the control loops and give the data directory up (before the actors stop)."""
        self.controller.stop()
        self.state.release_lease()

    # -- cluster operations -------------------------------------------------------------
    @ray.method
    def migrate(self, unit_id: int, to: str) -> dict[str, Any]:
        return self.controller.run_move(self.state.plan_move(unit_id, to))

    @ray.method
    def split(self, unit_id: int) -> dict[str, Any]:
        return self.controller.run_move(self.state.plan_split(unit_id))

    @ray.method
    def merge(self, first: int, second: int) -> dict[str, Any]:
        return self.controller.run_move(self.state.plan_merge(first, second))

    @ray.method
    def migrations(self) -> list[dict[str, Any]]:
        return self.controller.history()

    @ray.method
    def drain(self, node: str, deadline_s: float) -> DrainReport:
        return self.controller.drain(node, deadline_s)

    @ray.method
    def reserve_node(self) -> str:
        return self.state.reserve_node()

    @ray.method
    def node_joined(self, node: str) -> dict[str, Any]:
        return self.state.node_joined(node)

    @ray.method
    def rebalance(self, dry_run: bool) -> dict[str, Any]:
        return self.controller.rebalance(dry_run)

    @ray.method
    def node_loads(self) -> dict[str, NodeLoad]:
        return self.controller.node_loads()

    @ray.method
    def shard_loads(self) -> dict[ShardKey, float]:
        return dict(self.controller.shard_load)

    @ray.method
    def failovers(self) -> list[dict[str, Any]]:
        return [vars(f) for f in self.controller.failovers]

    @ray.method
    def stop(self) -> None:
        self.controller.stop()

    @ray.method
    def catalog(self) -> dict[str, Any]:
        return self.state.catalog_json()

    @ray.method
    def register_nodes(self, nodes: list[str]) -> dict[str, Any]:
        return self.state.register_nodes(nodes)

    @ray.method
    def report_profile(self, profile: NodeProfile) -> None:
        self.state.report_profile(profile)

    @ray.method
    def begin_create(
        self,
        name: str,
        schema: bytes,
        kind: str,
        key: str | None,
        colocate_with: str | None,
        key_index: bool = False,
        size_bytes: int | None = None,
    ) -> dict[str, Any]:
        return self.state.begin_create(
            name, schema, kind, key, colocate_with, key_index, size_bytes
        )

    @ray.method
    def commit_create(self, name: str, rows: int) -> dict[str, Any]:
        return self.state.commit_create(name, rows)

    @ray.method
    def abort_create(self, name: str) -> None:
        self.state.abort_create(name)

    @ray.method
    def drop_table(self, name: str) -> tuple[dict[str, Any], str]:
        return self.state.drop_table(name)

    @ray.method
    def delete_files(self, uid: str) -> None:
        self.state.delete_files(uid)


class WorkerService:
    """A worker actor: one :class:`WorkerNode`, and its links to the other workers (a target
    pulls a move's rows straight from its sources)."""

    def __init__(
        self,
        node_id: str,
        data_dir: str,
        settings: Settings,
        prefix: str,
        slowdown: float = 1.0,
    ) -> None:
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        # The worker asks the coordinator what it owns and rebuilds those shards from
        # durable storage before serving.
        self.coordinator = cast(
            "CoordinatorHandle",
            ray.get_actor(coordinator_actor_name(prefix), namespace=NAMESPACE),
        )
        self.workers = RayWorkers(prefix)
        catalog = ray.get(self.coordinator.catalog.remote())
        owner = ray.get(self.coordinator.owner_token.remote())
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
        )
        kept = self.node.kept_calibration()
        if kept is not None:  # a known kind of node: serves calibrated, measures nothing
            ray.get(self.coordinator.report_profile.remote(kept))
        self.lane = (
            LaneServer(
                self._run_fragment,
                self.host.address,
                node_id,
                WORKER_CONCURRENCY,
                stage=self.node.stage,
                export=self.node.source.chunk,
            )
            if settings.fast_lane
            else None
        )
        self.lanes = Lanes() if settings.fast_lane else None
        """Connections to other workers' lanes (a move's rows come from its sources so)."""

    def _run_fragment(
        self,
        sql: str,
        bindings: Mapping[str, list[int]],
        epoch: int,
        profile: bool,
        inputs: Mapping[str, pa.Table],
    ) -> tuple[pa.Table, FragmentStats]:
        return self.node.execute(sql, bindings, epoch, inputs, profile)

    def _link(self, node: str) -> RaySourceLink:
        return RaySourceLink(node, self.workers.handle(node), self.lanes)

    @ray.method
    def calibrate(self) -> NodeProfile:
        """Measure the device and tell the coordinator (called once the cluster is up, one
        worker at a time, so that workers do not slow each other down while measuring; a
        worker that started with a kept calibration has none to make)."""
        profile = self.node.calibrate()
        ray.get(self.coordinator.report_profile.remote(profile))
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
    def finish_load(self, table: str, catalog: CatalogJson) -> None:
        self.node.finish_load(table, catalog)

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
    ) -> dict[int, int]:
        return self.node.append(table, parts, batch_id, epoch)

    @ray.method
    def append_replica(self, table: str, part: pa.Table, batch_id: str) -> int:
        return self.node.append_replica(table, part, batch_id)

    @ray.method(num_returns=2)
    def execute(
        self,
        sql: str,
        bindings: Mapping[str, list[int]],
        epoch: int,
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
        result, stats = self.node.execute(sql, bindings, epoch, tables, profile)
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
    def retire(self, move_id: str) -> None:
        self.node.source.retire(move_id)

    @ray.method
    def drop_retired(self, move_id: str) -> bool:
        return self.node.source.drop_retired(move_id)

    @ray.method
    def abort_export(self, move_id: str) -> None:
        self.node.source.abort(move_id)

    # -- a live move, as its target -----------------------------------------------------------
    @ray.method
    def memory_headroom(self) -> int:
        return self.node.memory_headroom()

    @ray.method
    def copy_snapshot(self, plan: MovePlan, bandwidth_bytes_s: float) -> CopyResult:
        return self.node.target.copy_snapshot(plan, self._link, bandwidth_bytes_s)

    @ray.method
    def catch_up(self, move_id: str) -> int:
        return self.node.target.catch_up(move_id, self._link)

    @ray.method
    def apply_final(self, move_id: str, fenced: list[FenceResult]) -> FinalApplied:
        return self.node.target.apply_final(move_id, fenced)

    @ray.method
    def promote(self, move_id: str) -> None:
        self.node.target.promote(move_id)

    @ray.method
    def abort_import(self, move_id: str) -> None:
        self.node.target.abort(move_id)


CoordinatorActor = ray.remote(CoordinatorService)
WorkerActor = ray.remote(WorkerService)


def check_storage_on(slots: list[Slot], data_dir: str, owner: OwnerToken) -> None:
    """Every Ray node of ``slots`` must read the lease the coordinator wrote in
    ``data_dir``: a cluster of several machines needs the data directory on shared storage.
    Raises ``ConfigError`` naming a node that cannot (checked by a small task there)."""
    checks = [
        _storage_check.options(**slot_options(slot.cpu_only(), False)).remote(
            data_dir, owner, slot.name or slot.ray_node_id
        )
        for slot in {s.ray_node_id: s for s in slots}.values()
    ]
    for ref in checks:
        try:
            ray.get(ref)
        except RayTaskError as error:
            cause = error.cause
            raise cause if isinstance(cause, ConfigError) else error from None


@ray.remote(num_cpus=0, max_retries=0)
def _storage_check(data_dir: str, owner: OwnerToken, node: str) -> None:
    check_shared(DataDir.resolve(data_dir), owner, f"Ray node {node}")


def spawn_worker(
    prefix: str,
    node: str,
    data_dir: str,
    settings: Settings,
    slot: Slot,
    detached: bool,
    slowdown: float = 1.0,
) -> WorkerHandle:
    """Create the worker actor of ``node`` on ``slot``; it loads what the catalog assigns
    it. A ``slowdown`` above 1 makes it a simulated slower device (tests and demos)."""
    return WorkerActor.options(
        name=worker_actor_name(prefix, node),
        namespace=NAMESPACE,
        max_restarts=0,  # a dead worker stays dead: the coordinator reassigns its shards
        max_concurrency=WORKER_CONCURRENCY,
        **slot_options(slot, detached),
    ).remote(node, data_dir, settings, prefix, slowdown)
