"""The protocol's Ray implementation: the coordinator and worker actors called through typed
handles (every call a ``@ray.method`` of the actor class, so mypy checks its name, arguments
and answer), found by name (the one place that looks them up), every answer a
:class:`RayReply`. The handles are what the actors of ``actors.py`` are given to reach each
other, so they travel to them: a handle pickles as the names it looks up."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar, cast

import numpy as np
import pyarrow as pa
import ray

from shardflow.errors import Error, WorkerGone
from shardflow.runtime.fastlane import LaneBook, LaneBroken, Lanes, from_wire
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
)
from shardflow.runtime.ray.names import NAMESPACE, coordinator_actor_name, worker_actor_name
from shardflow.runtime.ray.replies import RayReply
from shardflow.storage import RowRewrite

if TYPE_CHECKING:
    import numpy as np
    from ray import ObjectRef
    from ray.actor import ActorProxy

    from shardflow.catalog import OwnerToken, TableSpec
    from shardflow.control.migration import MovePlan
    from shardflow.runtime.ray.actors import CoordinatorService, WorkerService
    from shardflow.telemetry.devices import NodeProfile

    WorkerHandle = ActorProxy[WorkerService]
    CoordinatorHandle = ActorProxy[CoordinatorService]

log = logging.getLogger(__name__)
T = TypeVar("T")


def rows_arg(rows: pa.Table | SharedRows) -> Any:
    """Rows as a call argument: shared rows travel as their object reference (Ray hands
    the worker the table behind it)."""
    return rows.ref if isinstance(rows, SharedRows) else rows


class RayWorker:
    """One worker actor, called through the protocol. With ``lanes`` (the coordinator's,
    where ``fast_lane`` is on) a move's finish and its sources' retire go over the workers'
    fast lanes: writers wait for both."""

    def __init__(self, node_id: str, handle: WorkerHandle, lanes: LaneBook | None = None) -> None:
        self._node_id = node_id
        self.handle = handle
        self._lanes = lanes

    @property
    def node_id(self) -> str:
        return self._node_id

    @property
    def instance(self) -> object:
        return self.handle

    def _reply(self, ref: ObjectRef[T]) -> RayReply[T]:
        return RayReply(ref, f"worker {self._node_id}")

    # life and reports
    def ping(self) -> Reply[bool]:
        return self._reply(self.handle.ping.remote())

    def fast_lane(self) -> Reply[LaneAddress | None]:
        return self._reply(self.handle.fast_lane.remote())

    def pid(self) -> Reply[int]:
        return self._reply(self.handle.pid.remote())

    def info(self) -> Reply[WorkerInfo]:
        return self._reply(self.handle.info.remote())

    def load_report(self) -> Reply[LoadReport]:
        return self._reply(self.handle.load_report.remote())

    def calibrate(self) -> Reply[NodeProfile]:
        return self._reply(self.handle.calibrate.remote())

    def sync(self, catalog: CatalogJson) -> Reply[int]:
        return self._reply(self.handle.sync.remote(dict(catalog)))

    def follow(self, changes: Sequence[CatalogJson]) -> Reply[int]:
        return self._reply(self.handle.follow.remote([dict(c) for c in changes]))

    # tables: loads and inserts
    def prepare(self, spec: TableSpec, unit_ids: Sequence[int], primary: bool) -> Reply[None]:
        return self._reply(self.handle.prepare.remote(spec, list(unit_ids), primary))

    def stage(self, table: str, parts: Mapping[int | str, pa.Table | SharedRows]) -> Reply[int]:
        # the parts travel as arguments of their own, so that Ray resolves shared ones
        values = [rows_arg(part) for part in parts.values()]
        return self._reply(self.handle.stage.remote(table, list(parts), *values))

    def commit_load(self, table: str) -> Reply[int]:
        return self._reply(self.handle.commit_load.remote(table))

    def finish_load(self, table: str) -> Reply[None]:
        return self._reply(self.handle.finish_load.remote(table))

    def abort_load(self, table: str) -> Reply[None]:
        return self._reply(self.handle.abort_load.remote(table))

    def append(
        self,
        table: str,
        parts: Mapping[int, tuple[pa.Table, np.ndarray]],
        batch_id: str,
        epoch: int,
        commit: int | None = None,
    ) -> Reply[Mapping[int, int]]:
        return self._reply(self.handle.append.remote(table, dict(parts), batch_id, epoch, commit))

    def append_replica(
        self, table: str, rows: pa.Table | SharedRows, batch_id: str, commit: int | None = None
    ) -> Reply[int]:
        return self._reply(
            self.handle.append_replica.remote(table, rows_arg(rows), batch_id, commit)
        )

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
        table_ref, stats_ref = self.submit(
            sql, bindings, epoch, list(inputs), profile, inputs, commits
        )
        return _Executed(self._reply(table_ref), self._reply(stats_ref))

    def submit(
        self,
        sql: str,
        bindings: Mapping[str, list[int]],
        epoch: int,
        names: list[str],
        profile: bool,
        inputs: Sequence[ObjectRef[pa.Table]] | Mapping[str, pa.Table],
        commits: Mapping[str, int] | None = None,
    ) -> tuple[ObjectRef[pa.Buffer], ObjectRef[FragmentStats]]:
        """Run a fragment whose result stays in the object store (workers of a later stage
        read it from there); ``inputs`` come in parts, each named by ``names`` (the
        fragment results of an earlier stage, or tables)."""
        parts = list(inputs.values()) if isinstance(inputs, Mapping) else list(inputs)
        table_ref, stats_ref = self.handle.execute.remote(
            sql, dict(bindings), epoch, dict(commits or {}), names, profile, *parts
        )
        return table_ref, stats_ref

    # a move, as its source
    def unit_bytes(self, units: Sequence[int]) -> Reply[int]:
        return self._reply(self.handle.unit_bytes.remote(list(units)))

    def retire(self, move_id: str) -> Reply[float | None]:
        """Over the worker's lane where its address is known already (asking for it would
        hold writers a round trip longer: the first retire of a worker goes through Ray,
        then asks, for the next)."""
        lanes, node = self._lanes, self._node_id
        retired = _on_lane(
            lanes, node, "retire", lambda lane, at: lane.retire(at, move_id), ask=False
        )
        if retired is not None and not isinstance(retired.error, LaneBroken):
            return retired
        reply = self._reply(self.handle.retire.remote(move_id))  # idempotent: asked again
        if lanes is not None and retired is None:
            lanes.address(node)  # the writers are let go by now, or soon
        return reply

    def drop_retired(self, move_id: str) -> Reply[bool]:
        return self._reply(self.handle.drop_retired.remote(move_id))

    def abort_export(self, move_id: str) -> Reply[None]:
        return self._reply(self.handle.abort_export.remote(move_id))

    def prepare_change(
        self,
        table: str,
        statement: str,
        commit: int,
        change: RowRewrite,
        units: Sequence[int] | None = None,
    ) -> Reply[PreparedChange]:
        units = list(units) if units is not None else None
        return self._reply(
            self.handle.prepare_change.remote(table, statement, commit, change, units)
        )

    def prepare_rows(
        self,
        table: str,
        statement: str,
        commit: int,
        parts: Mapping[int, tuple[pa.Table, np.ndarray]],
    ) -> Reply[None]:
        return self._reply(self.handle.prepare_rows.remote(table, statement, commit, dict(parts)))

    def abort_change(self, table: str, statement: str) -> Reply[None]:
        return self._reply(self.handle.abort_change.remote(table, statement))

    # a move, as its target
    def memory_headroom(self) -> Reply[int]:
        return self._reply(self.handle.memory_headroom.remote())

    def copy_snapshot(self, plan: MovePlan, bandwidth_bytes_s: float) -> Reply[CopyResult]:
        copying = self._reply(self.handle.copy_snapshot.remote(plan, bandwidth_bytes_s))
        if self._lanes is not None:  # the target's lane is asked for now, while the copy
            self._lanes.address(self._node_id)  # runs, not by its finish with writers held
        return copying

    def catch_up(self, move_id: str) -> Reply[int]:
        return self._reply(self.handle.catch_up.remote(move_id))

    def finish_import(self, move_id: str) -> Reply[FinalApplied]:
        finished = _on_lane(
            self._lanes, self._node_id, "finish", lambda lanes, at: lanes.finish(at, move_id)
        )
        if finished is not None:  # a lane that failed fails the move: it rolls back
            return finished
        return self._reply(self.handle.finish_import.remote(move_id))

    def promote(self, move_id: str) -> Reply[None]:
        return self._reply(self.handle.promote.remote(move_id))

    def abort_import(self, move_id: str) -> Reply[None]:
        return self._reply(self.handle.abort_import.remote(move_id))

    def cancel_import(self, move_id: str) -> Reply[None]:
        return self._reply(self.handle.cancel_import.remote(move_id))


class _Executed:
    """A fragment's result and measurements, both on their way through the object store."""

    def __init__(self, table: RayReply[pa.Buffer], stats: RayReply[FragmentStats]) -> None:
        self.table = table
        self.stats = stats

    def get(self, timeout: float | None = None) -> tuple[pa.Table, FragmentStats]:
        stats = self.stats.get(timeout)
        return from_wire(self.table.get(timeout)), stats


class RayWorkers:
    """The workers of one cluster on Ray: actors named after the cluster's prefix and their
    node, looked up once and cached. The one owner of worker lookup, for the session, the
    controller and the workers themselves (a target finds its sources here; with
    ``fast_lane`` their snapshots come over the sources' lanes)."""

    def __init__(self, prefix: str, fast_lane: bool = False) -> None:
        self.prefix = prefix
        self.fast_lane = fast_lane
        self._handles: dict[str, WorkerHandle] = {}
        self._lanes: LaneBook | None = None

    def __reduce__(self) -> tuple[type[RayWorkers], tuple[str, bool]]:
        return RayWorkers, (self.prefix, self.fast_lane)  # handles and lanes are found anew

    def get(self, node: str) -> RayWorker:
        return RayWorker(node, self.handle(node), self._lane_book())

    def _lane_book(self) -> LaneBook | None:
        """The workers' lanes (addresses asked once a worker), where ``fast_lane`` is on."""
        if self.fast_lane and self._lanes is None:
            self._lanes = LaneBook(self, enabled=True)
        return self._lanes

    def handle(self, node: str) -> WorkerHandle:
        handle = self._handles.get(node)
        if handle is None:
            try:
                found = ray.get_actor(worker_actor_name(self.prefix, node), namespace=NAMESPACE)
            except ValueError:
                raise WorkerGone(f"worker {node} is not running") from None
            handle = cast("WorkerHandle", found)
            self._handles[node] = handle
        return handle

    def add(self, node: str, handle: WorkerHandle) -> RayWorker:
        self._handles[node] = handle
        return RayWorker(node, handle)

    def forget(self, node: str) -> None:
        self._handles.pop(node, None)

    def fence(self, node: str) -> None:
        try:
            self.stop(node)
        except Exception as error:  # its Ray node is gone too: nothing runs there to stop
            log.info("stopping %s after its failover: %s", node, error)
        self._handles.pop(node, None)

    def stop(self, node: str) -> None:
        """Stop ``node``'s worker (after a drain, or when the cluster shuts down), also one
        another process started."""
        try:
            handle = self.handle(node)
        except WorkerGone:
            return
        self._handles.pop(node, None)
        try:
            ray.kill(cast("ray.actor.ActorHandle[Any]", handle), no_restart=True)
        except ValueError:  # gone meanwhile
            pass

    @property
    def known(self) -> list[str]:
        """The nodes whose workers were looked up or started here."""
        return list(self._handles)

    def share(self, rows: pa.Table) -> SharedRows:
        return SharedRows(ray.put(rows))

    def link(self, node: str) -> RaySourceLink:
        return RaySourceLink(node, self.handle(node), self._lane_book())


class RaySourceLink:
    """A target's link to one source worker of a move (worker to worker). With ``lanes``
    the snapshot's chunks come over the source's fast lane where it has one: Arrow IPC on a
    socket, not an actor call whose result passes through the object store, whose pages
    stay mapped in the target afterwards. (The copy's rate hardly changes: it is bound by
    the source's DuckDB read and the target's staging, not by either transport.)"""

    def __init__(self, node: str, handle: WorkerHandle, lanes: LaneBook | None = None) -> None:
        self.node = node
        self.handle = handle
        self.lanes = lanes

    def _reply(self, ref: ObjectRef[T]) -> RayReply[T]:
        return RayReply(ref, f"source worker {self.node}")

    def pin(self, plan: MovePlan) -> ExportPinned:
        pinned = self._reply(self.handle.export_begin.remote(plan)).get()
        self._lane()  # asked for now: a move that copies files, not chunks, would otherwise
        return pinned  # ask it at its fence, with the source's writers held

    def chunks(self, move_id: str, key: ShardKey) -> Iterator[pa.Table]:
        """The next chunk is on its way while this one is loaded."""
        address = self._lane()
        if address is not None:
            yield from self._lane_chunks(address, move_id, key)
            return
        pending = self._reply(self.handle.export_chunk.remote(move_id, key))
        while True:
            chunk = pending.get()
            if chunk is None:
                return
            pending = self._reply(self.handle.export_chunk.remote(move_id, key))
            yield chunk

    def _lane(self) -> LaneAddress | None:
        return None if self.lanes is None else self.lanes.address(self.node)

    def _lane_chunks(self, address: LaneAddress, move_id: str, key: ShardKey) -> Iterator[pa.Table]:
        assert self.lanes is not None
        lanes = self.lanes.lanes
        with ThreadPoolExecutor(1, thread_name_prefix="shardflow-move-chunk") as ahead:
            pending = ahead.submit(lanes.chunk, address, move_id, key)
            while True:
                chunk = pending.result()  # LaneBroken: the move fails and is rolled back
                if chunk is None:
                    return
                pending = ahead.submit(lanes.chunk, address, move_id, key)
                yield chunk

    def changes(self, move_id: str, since: Mapping[ShardKey, int]) -> Reply[ChangeSet]:
        return self._reply(self.handle.export_changes.remote(move_id, dict(since)))

    def fence(self, move_id: str) -> Reply[FenceResult]:
        """Over the source's lane where it has one (writers wait for the answer); a lane
        that failed fails the move, which rolls back (the source may have fenced)."""
        fenced = _on_lane(
            self.lanes, self.node, "fence", lambda lanes, at: lanes.fence(at, move_id)
        )
        if fenced is not None:
            return fenced
        return self._reply(self.handle.fence.remote(move_id))


def _on_lane(
    book: LaneBook | None,
    node: str,
    step: str,
    call: Callable[[Lanes, LaneAddress], T],
    *,
    ask: bool = True,
) -> Answered[T] | None:
    """``call``, the move's ``step``, made over ``node``'s fast lane, answered (the worker's
    error, or :class:`LaneBroken` where the lane failed, as the reply's error); None where
    the worker has no lane or takes no such step on it (a worker of 0.2.0), or, without
    ``ask``, where its address was not asked for yet. A lane that failed is not used again
    for that worker."""
    if book is None:
        return None
    address = book.address(node) if ask else book.known(node)
    if address is None or step not in address.steps:
        return None
    try:
        return Answered(call(book.lanes, address))
    except LaneBroken as error:
        book.broken(node, error)
        return Answered(error=error)
    except Error as error:
        return Answered(error=error)


class RayCoordinator:
    """The coordinator actor of one cluster, called through the protocol; found by name
    when first called (so workers and sessions of any process reach the same one, also
    after Ray restarted it elsewhere)."""

    def __init__(self, prefix: str, handle: CoordinatorHandle | None = None) -> None:
        self.prefix = prefix
        self._handle = handle

    def __reduce__(self) -> tuple[type[RayCoordinator], tuple[str]]:
        return RayCoordinator, (self.prefix,)

    @property
    def handle(self) -> CoordinatorHandle:
        if self._handle is None:
            try:
                found = ray.get_actor(coordinator_actor_name(self.prefix), namespace=NAMESPACE)
            except ValueError:
                raise WorkerGone(f"the coordinator of {self.prefix} is not running") from None
            self._handle = cast("CoordinatorHandle", found)
        return self._handle

    def _reply(self, ref: ObjectRef[T]) -> RayReply[T]:
        return RayReply(ref, "the coordinator")

    # the catalog and its owner
    def ping(self) -> Reply[int]:
        return self._reply(self.handle.ping.remote())

    def pid(self) -> Reply[int]:
        return self._reply(self.handle.pid.remote())

    def catalog(self, tables: Sequence[str] | None = None) -> Reply[CatalogJson]:
        return self._reply(self.handle.catalog.remote(None if tables is None else list(tables)))

    def owner_token(self) -> Reply[OwnerToken]:
        return self._reply(self.handle.owner_token.remote())

    def register_nodes(self, nodes: list[str]) -> Reply[CatalogJson]:
        return self._reply(self.handle.register_nodes.remote(nodes))

    def report_profile(self, profile: NodeProfile) -> Reply[None]:
        return self._reply(self.handle.report_profile.remote(profile))

    def release(self) -> Reply[None]:
        return self._reply(self.handle.release.remote())

    # tables
    def begin_create(self, table: NewTable) -> Reply[CatalogJson]:
        return self._reply(self.handle.begin_create.remote(table))

    def commit_create(self, name: str, rows: int) -> Reply[CatalogJson]:
        return self._reply(self.handle.commit_create.remote(name, rows))

    def announce(self, nodes: Sequence[str]) -> Reply[None]:
        return self._reply(self.handle.announce.remote(list(nodes)))

    def abort_create(self, name: str) -> Reply[None]:
        return self._reply(self.handle.abort_create.remote(name))

    def drop_table(self, name: str) -> Reply[tuple[CatalogJson, str]]:
        return self._reply(self.handle.drop_table.remote(name))

    def delete_files(self, uid: str) -> Reply[None]:
        return self._reply(self.handle.delete_files.remote(uid))

    def truncate_table(self, name: str) -> Reply[CatalogJson]:
        return self._reply(self.handle.truncate_table.remote(name))

    def change_rows(
        self,
        name: str,
        statement: str,
        change: RowRewrite,
        buckets: Sequence[int] | None = None,
    ) -> Reply[dict[str, Any]]:
        buckets = list(buckets) if buckets is not None else None
        return self._reply(self.handle.change_rows.remote(name, statement, change, buckets))

    def set_grants(self, name: str, grants: Sequence[Sequence[str]]) -> Reply[CatalogJson]:
        return self._reply(self.handle.set_grants.remote(name, [list(g) for g in grants]))

    # cluster operations
    def migrate(self, unit_id: int, to: str) -> Reply[dict[str, Any]]:
        return self._reply(self.handle.migrate.remote(unit_id, to))

    def split(self, unit_id: int) -> Reply[dict[str, Any]]:
        return self._reply(self.handle.split.remote(unit_id))

    def merge(self, first: int, second: int) -> Reply[dict[str, Any]]:
        return self._reply(self.handle.merge.remote(first, second))

    def rebalance(self, dry_run: bool) -> Reply[dict[str, Any]]:
        return self._reply(self.handle.rebalance.remote(dry_run))

    def cancel(self, move_id: str) -> Reply[dict[str, Any]]:
        return self._reply(self.handle.cancel.remote(move_id))

    def pause_balancer(self, paused: bool) -> Reply[bool]:
        return self._reply(self.handle.pause_balancer.remote(paused))

    def reserve_node(self) -> Reply[str]:
        return self._reply(self.handle.reserve_node.remote())

    def node_joined(self, node: str) -> Reply[CatalogJson]:
        return self._reply(self.handle.node_joined.remote(node))

    def drain(self, node: str, deadline_s: float) -> Reply[DrainReport]:
        return self._reply(self.handle.drain.remote(node, deadline_s))

    def cancel_drain(self, node: str) -> Reply[bool]:
        return self._reply(self.handle.cancel_drain.remote(node))

    def host(self) -> Reply[str]:
        return self._reply(self.handle.host.remote())

    def drain_host(self, host: str, deadline_s: float) -> Reply[list[DrainReport]]:
        return self._reply(self.handle.drain_host.remote(host, deadline_s))

    # reports
    def migrations(self) -> Reply[list[dict[str, Any]]]:
        return self._reply(self.handle.migrations.remote())

    def failovers(self) -> Reply[list[dict[str, Any]]]:
        return self._reply(self.handle.failovers.remote())

    def metrics_url(self) -> Reply[str]:
        return self._reply(self.handle.metrics_url.remote())

    def node_loads(self) -> Reply[dict[str, NodeLoad]]:
        return self._reply(self.handle.node_loads.remote())

    def shard_loads(self) -> Reply[dict[ShardKey, float]]:
        return self._reply(self.handle.shard_loads.remote())

    def record_outcomes(self, queries: list[tuple[float, bool]], inserts: list[int]) -> Reply[None]:
        return self._reply(self.handle.record_outcomes.remote(queries, inserts))

    def record_access(self, denied_action: str | None) -> Reply[None]:
        return self._reply(self.handle.record_access.remote(denied_action))

    # Ray nodes joining (a cluster joined by address)
    def start_joining(self) -> Reply[None]:
        """From now on, watch the Ray cluster: a Ray node that joins gets workers."""
        return self._reply(self.handle.start_joining.remote())

    def join_new_nodes(self) -> Reply[list[str]]:
        """Start a worker on every slot of an alive Ray node that has none, now."""
        return self._reply(self.handle.join_new_nodes.remote())

    def stop(self) -> None:
        """Stop the coordinator actor for good (its data directory given up first)."""
        try:
            ray.kill(cast("ray.actor.ActorHandle[Any]", self.handle), no_restart=True)
        except (ValueError, WorkerGone):  # gone already
            pass
