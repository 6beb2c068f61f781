"""The worker protocol on Ray: worker actors found by name (the one place that looks them
up), every call a typed actor method whose answer is an object reference, and Ray's errors
turned into shardflow's, so that nothing above this module needs to know about Ray."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

import pyarrow as pa
import ray
from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError, RayTaskError

from shardflow.errors import ClusterError, Error, WorkerGone, WorkerTimeout
from shardflow.runtime.fastlane import LaneAddress, Lanes
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

if TYPE_CHECKING:
    import numpy as np
    from ray import ObjectRef
    from ray.actor import ActorProxy

    from shardflow.catalog import TableSpec
    from shardflow.control.migration import MovePlan
    from shardflow.runtime.actors import CoordinatorService, WorkerService
    from shardflow.runtime.executor import FragmentStats
    from shardflow.telemetry.devices import NodeProfile

    WorkerHandle = ActorProxy[WorkerService]
    CoordinatorHandle = ActorProxy[CoordinatorService]

log = logging.getLogger(__name__)
T = TypeVar("T")

NAMESPACE = "shardflow"
"""The Ray namespace of every shardflow actor."""


def worker_actor_name(prefix: str, node: str) -> str:
    return f"{prefix}-worker-{node}"


def coordinator_actor_name(prefix: str) -> str:
    return f"{prefix}-coordinator"


class ResultLost(ClusterError):
    """Internal: a result left in the object store was lost with its node; the query that
    needs it runs again."""


def translate(error: Exception, who: str) -> Error:
    """Ray's error as shardflow's: the callee's own error as itself, a dead actor as
    ``WorkerGone``, no answer in time as ``WorkerTimeout``, a lost object as
    :class:`ResultLost`, anything else as ``ClusterError``."""
    if isinstance(error, RayTaskError):  # raised by the callee (checked first: Ray makes
        cause = error.cause  # it an instance of the cause's class too)
        if isinstance(cause, ObjectLostError):
            return ResultLost(f"{who}: an input was lost: {cause}")
        if isinstance(cause, Error):
            return cause
        if isinstance(cause, RayActorError):
            return WorkerGone(f"{who}: a worker it called is gone: {cause}")
        return ClusterError(f"{who} failed: {cause!r}")
    if isinstance(error, ObjectLostError):
        return ResultLost(f"{who}: a result was lost: {error}")
    if isinstance(error, GetTimeoutError):
        return WorkerTimeout(f"{who} did not answer in time")
    if isinstance(error, RayActorError):
        return WorkerGone(f"{who} is gone: {error}")
    if isinstance(error, Error):
        return error
    return ClusterError(f"{who} failed: {error!r}")


class RayReply(Generic[T]):
    """An answer on its way through Ray's object store."""

    def __init__(self, ref: ObjectRef[T], who: str) -> None:
        self.ref = ref
        self.who = who

    def get(self, timeout: float | None = None) -> T:
        try:
            return ray.get(self.ref, timeout=timeout)
        except Exception as error:
            raise translate(error, self.who) from None


def rows_arg(rows: pa.Table | SharedRows) -> Any:
    """Rows as a call argument: shared rows travel as their object reference (Ray hands
    the worker the table behind it)."""
    return rows.ref if isinstance(rows, SharedRows) else rows


class RayWorker:
    """One worker actor, called through the protocol."""

    def __init__(self, node_id: str, handle: WorkerHandle) -> None:
        self._node_id = node_id
        self.handle = handle

    @property
    def node_id(self) -> str:
        return self._node_id

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

    # tables: loads and inserts
    def prepare(self, spec: TableSpec, unit_ids: Sequence[int], primary: bool) -> Reply[None]:
        return self._reply(self.handle.prepare.remote(spec, list(unit_ids), primary))

    def stage(self, table: str, parts: Mapping[int | str, pa.Table | SharedRows]) -> Reply[int]:
        # the parts travel as arguments of their own, so that Ray resolves shared ones
        values = [rows_arg(part) for part in parts.values()]
        return self._reply(self.handle.stage.remote(table, list(parts), *values))

    def commit_load(self, table: str) -> Reply[int]:
        return self._reply(self.handle.commit_load.remote(table))

    def finish_load(self, table: str, catalog: CatalogJson) -> Reply[None]:
        return self._reply(self.handle.finish_load.remote(table, dict(catalog)))

    def abort_load(self, table: str) -> Reply[None]:
        return self._reply(self.handle.abort_load.remote(table))

    def append(
        self,
        table: str,
        parts: Mapping[int, tuple[pa.Table, np.ndarray]],
        batch_id: str,
        epoch: int,
    ) -> Reply[Mapping[int, int]]:
        return self._reply(self.handle.append.remote(table, dict(parts), batch_id, epoch))

    def append_replica(self, table: str, rows: pa.Table | SharedRows, batch_id: str) -> Reply[int]:
        return self._reply(self.handle.append_replica.remote(table, rows_arg(rows), batch_id))

    # a move, as its source
    def unit_bytes(self, units: Sequence[int]) -> Reply[int]:
        return self._reply(self.handle.unit_bytes.remote(list(units)))

    def fence(self, move_id: str) -> Reply[FenceResult]:
        return self._reply(self.handle.fence.remote(move_id))

    def retire(self, move_id: str) -> Reply[None]:
        return self._reply(self.handle.retire.remote(move_id))

    def drop_retired(self, move_id: str) -> Reply[bool]:
        return self._reply(self.handle.drop_retired.remote(move_id))

    def abort_export(self, move_id: str) -> Reply[None]:
        return self._reply(self.handle.abort_export.remote(move_id))

    # a move, as its target
    def memory_headroom(self) -> Reply[int]:
        return self._reply(self.handle.memory_headroom.remote())

    def copy_snapshot(self, plan: MovePlan, bandwidth_bytes_s: float) -> Reply[CopyResult]:
        return self._reply(self.handle.copy_snapshot.remote(plan, bandwidth_bytes_s))

    def catch_up(self, move_id: str) -> Reply[int]:
        return self._reply(self.handle.catch_up.remote(move_id))

    def apply_final(self, move_id: str, fenced: Sequence[FenceResult]) -> Reply[FinalApplied]:
        return self._reply(self.handle.apply_final.remote(move_id, list(fenced)))

    def promote(self, move_id: str) -> Reply[None]:
        return self._reply(self.handle.promote.remote(move_id))

    def abort_import(self, move_id: str) -> Reply[None]:
        return self._reply(self.handle.abort_import.remote(move_id))

    # queries (Ray only: results stay in the object store for whoever needs them)
    def execute(
        self,
        sql: str,
        bindings: Mapping[str, list[int]],
        epoch: int,
        names: list[str],
        profile: bool,
        inputs: list[ObjectRef[pa.Table]],
    ) -> tuple[ObjectRef[pa.Table], RayReply[FragmentStats]]:
        """Run a fragment; the result stays in the object store (workers of a later stage
        read it from there), the caller learns what was measured."""
        table_ref, stats_ref = self.handle.execute.remote(
            sql, dict(bindings), epoch, names, profile, *inputs
        )
        return table_ref, self._reply(stats_ref)


class RayWorkers:
    """The workers of one cluster on Ray: actors named after the cluster's prefix and their
    node, looked up once and cached. The one owner of worker lookup, for the session, the
    controller and the workers themselves (a target finds its sources here)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._handles: dict[str, WorkerHandle] = {}

    def get(self, node: str) -> RayWorker:
        return RayWorker(node, self.handle(node))

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
            self.kill(node)
        except Exception as error:  # its Ray node is gone too: nothing runs there to stop
            log.info("stopping %s after its failover: %s", node, error)
        self._handles.pop(node, None)

    def kill(self, node: str) -> None:
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


class RaySourceLink:
    """A target's link to one source worker of a move (worker to worker). With ``lanes``
    the snapshot's chunks come over the source's fast lane where it has one: Arrow IPC on a
    socket, not an actor call whose result passes through the object store, whose pages
    stay mapped in the target afterwards. (The copy's rate hardly changes: it is bound by
    the source's DuckDB read and the target's staging, not by either transport.)"""

    def __init__(self, node: str, handle: WorkerHandle, lanes: Lanes | None = None) -> None:
        self.node = node
        self.handle = handle
        self.lanes = lanes

    def _reply(self, ref: ObjectRef[T]) -> RayReply[T]:
        return RayReply(ref, f"source worker {self.node}")

    def pin(self, plan: MovePlan) -> ExportPinned:
        return self._reply(self.handle.export_begin.remote(plan)).get()

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
        if self.lanes is None:
            return None
        return self._reply(self.handle.fast_lane.remote()).get()

    def _lane_chunks(self, address: LaneAddress, move_id: str, key: ShardKey) -> Iterator[pa.Table]:
        assert self.lanes is not None
        with ThreadPoolExecutor(1, thread_name_prefix="shardflow-move-chunk") as ahead:
            pending = ahead.submit(self.lanes.chunk, address, move_id, key)
            while True:
                chunk = pending.result()  # LaneBroken: the move fails and is rolled back
                if chunk is None:
                    return
                pending = ahead.submit(self.lanes.chunk, address, move_id, key)
                yield chunk

    def changes(self, move_id: str, since: Mapping[ShardKey, int]) -> Reply[ChangeSet]:
        return self._reply(self.handle.export_changes.remote(move_id, dict(since)))
