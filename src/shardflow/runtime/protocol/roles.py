"""The roles' interfaces: what the session and the coordinator ask the workers
(:class:`Worker`), what the session and the workers ask the coordinator
(:class:`Coordinator`), what a move's target asks its sources (:class:`SourceLink`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow as pa

from shardflow.runtime.protocol.messages import (
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
from shardflow.runtime.wire import check_peer

if TYPE_CHECKING:
    import numpy as np

    from shardflow.catalog import OwnerToken, TableSpec
    from shardflow.control.migration import MovePlan
    from shardflow.storage.shard import RowRewrite
    from shardflow.telemetry.devices import NodeProfile


# -- the interfaces ------------------------------------------------------------------------
class Worker(Protocol):
    """One worker, as the session and the coordinator call it."""

    @property
    def node_id(self) -> str: ...

    @property
    def instance(self) -> object:
        """What tells this worker from a later one of the same node (a worker started
        again is asked afresh, e.g. for its fast lane)."""
        ...

    # life and reports
    def ping(self) -> Reply[bool]: ...
    def fast_lane(self) -> Reply[LaneAddress | None]:
        """Where this worker answers fragments directly; None: it has no fast lane."""
        ...

    def pid(self) -> Reply[int]: ...
    def info(self) -> Reply[WorkerInfo]: ...
    def load_report(self) -> Reply[LoadReport]: ...
    def calibrate(self) -> Reply[NodeProfile]:
        """Measure the device (a second or so) and report the profile to the coordinator."""
        ...

    def sync(self, catalog: CatalogJson) -> Reply[int]:
        """Serve what ``catalog`` assigns to this node; answers the version it serves."""
        ...

    def follow(self, changes: Sequence[CatalogJson]) -> Reply[int]:
        """Take the catalog's changes as this node is told them (``catalog/delta.for_node``);
        answers the version it serves then, or -1 where its catalog is at another version
        than the first was made to (the catalog whole follows)."""
        ...

    # tables: loads and inserts
    def prepare(self, spec: TableSpec, unit_ids: Sequence[int], primary: bool) -> Reply[None]: ...
    def stage(self, table: str, parts: Mapping[int | str, pa.Table | SharedRows]) -> Reply[int]: ...
    def commit_load(self, table: str) -> Reply[int]: ...
    def finish_load(self, table: str) -> Reply[None]:
        """Serve the committed load's shards; the catalog with the table follows from the
        coordinator (:meth:`Coordinator.announce`)."""
        ...

    def abort_load(self, table: str) -> Reply[None]: ...
    def append(
        self,
        table: str,
        parts: Mapping[int, tuple[pa.Table, np.ndarray]],
        batch_id: str,
        epoch: int,
        commit: int | None = None,
    ) -> Reply[Mapping[int, int]]:
        """Append each unit's rows (and their buckets) durably; answers each unit's LSN.
        ``commit``: the table's commit number the insert was routed at (``Changed`` where
        the table was truncated since)."""
        ...

    def append_replica(
        self, table: str, rows: pa.Table | SharedRows, batch_id: str, commit: int | None = None
    ) -> Reply[int]: ...

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
        """Run a fragment over the shards ``bindings`` names (per table, its units) at the
        routing ``epoch`` (``Moved`` where this worker no longer serves one), with ``inputs``
        readable by name; answers its rows and what was measured (more with ``profile``).
        ``commits``: each table's commit number the query was routed at (``Changed`` where
        a table was truncated since: the query runs again whole)."""
        ...

    # a move, as its source
    def unit_bytes(self, units: Sequence[int]) -> Reply[int]: ...
    def retire(self, move_id: str) -> Reply[float | None]:
        """Stop serving what moved (the switch happened); how long writers were held here
        (None: nothing to retire)."""
        ...

    def drop_retired(self, move_id: str) -> Reply[bool]: ...
    def abort_export(self, move_id: str) -> Reply[None]: ...

    # a change of rows (DELETE, UPDATE), in two phases
    def prepare_change(
        self,
        table: str,
        statement: str,
        commit: int,
        change: RowRewrite,
        units: Sequence[int] | None = None,
    ) -> Reply[PreparedChange]:
        """Prepare the change in this node's shards of ``table``, durably and not in
        effect; the rows each changes. It takes effect once the catalog holds it committed."""
        ...

    def prepare_rows(
        self,
        table: str,
        statement: str,
        commit: int,
        parts: Mapping[int, tuple[pa.Table, np.ndarray]],
    ) -> Reply[None]:
        """Prepare the rows ``statement`` moves into this node's shards (per unit, rows and
        their buckets: an UPDATE of the key), durably and not in effect."""
        ...

    def abort_change(self, table: str, statement: str) -> Reply[None]: ...

    # a move, as its target
    def memory_headroom(self) -> Reply[int]: ...
    def copy_snapshot(self, plan: MovePlan, bandwidth_bytes_s: float) -> Reply[CopyResult]:
        """Build the plan's targets on this node from the sources' pinned snapshots, pulled
        worker to worker at most ``bandwidth_bytes_s`` (0: no cap)."""
        ...

    def catch_up(self, move_id: str) -> Reply[int]:
        """Apply what the sources took in since the last pull; answers those rows."""
        ...

    def finish_import(self, move_id: str) -> Reply[FinalApplied]:
        """Fence the move's sources (worker to worker: each holds writes and hands out its
        last changes and final checksums), apply those changes, and where the copy then
        holds what they handed out, serve the new shards (promote), all in one call."""
        ...

    def promote(self, move_id: str) -> Reply[None]: ...
    def abort_import(self, move_id: str) -> Reply[None]: ...
    def cancel_import(self, move_id: str) -> Reply[None]:
        """Stop the copy of a move an operator cancelled (at its next chunk)."""
        ...


class Workers(Protocol):
    """Where the coordinator side finds the workers: the one owner of worker lookup."""

    def get(self, node: str) -> Worker:
        """The worker of ``node``; ``WorkerGone`` if none runs."""
        ...

    def forget(self, node: str) -> None:
        """``node`` left the cluster: look it up afresh should it come back."""
        ...

    def fence(self, node: str) -> None:
        """``node`` was declared dead: make sure its worker no longer runs, then forget it.
        A worker too slow to answer its pings may still be alive, holding a catalog from
        before its shards were reassigned; it must not answer a stale session's query or
        take its insert after the new owners rebuilt those shards."""
        ...

    def stop(self, node: str) -> None:
        """Stop ``node``'s worker (drained, or the cluster shuts down) and forget it."""
        ...

    def share(self, rows: pa.Table) -> SharedRows: ...
    def link(self, node: str) -> SourceLink:
        """How a move's target on this side reaches the source worker of ``node``."""
        ...


def admit_workers(
    workers: Sequence[Worker], timeout: float | None, catalog: CatalogJson | None = None
) -> None:
    """Make started workers ready to serve, the one way every starter does (a new cluster's
    workers, a node added by hand, a Ray node that joined): wait until they answer (each has
    loaded what the catalog assigned it when it started), give ``catalog`` to those that
    started with an older one, and have those without a kept calibration calibrate, one at
    a time (measuring at once, they would slow each other down). Raises ``WorkerGone`` or
    ``WorkerTimeout`` where one did not come up within ``timeout`` seconds a call."""
    asked = [(worker, worker.info()) for worker in workers]  # all at once
    answered = [(worker, reply.get(timeout)) for worker, reply in asked]
    for worker, info in answered:  # one that speaks too far from this release never serves
        check_peer(info.protocol, f"worker {worker.node_id}")
    if catalog is not None:
        version = int(catalog["version"])
        behind = [w.sync(catalog) for w, info in answered if info.catalog_version < version]
        for reply in behind:
            reply.get(timeout)
    for worker, info in answered:
        if not info.profile.calibration:
            worker.calibrate().get(timeout)


class SourceLink(Protocol):
    """What the target of a move reads from one source, worker to worker."""

    def pin(self, plan: MovePlan) -> ExportPinned: ...
    def chunks(self, move_id: str, key: ShardKey) -> Iterator[pa.Table]:
        """The shard's pinned snapshot, a chunk at a time."""
        ...

    def changes(self, move_id: str, since: Mapping[ShardKey, int]) -> Reply[ChangeSet]:
        """The inserts each shard took in after LSN ``since[shard]``."""
        ...

    def fence(self, move_id: str) -> Reply[FenceResult]:
        """Hold new writes to the move's shards; hand out the last changes and the final
        checksums in one answer."""
        ...


class Coordinator(Protocol):
    """The coordinator, as the session, the workers and the bootstrap call it: the catalog's
    owner (tables, units, routing), cluster operations, and the reports behind
    ``db.cluster``. A call that changes the catalog answers the new catalog (or what it
    did); ``get`` raises the coordinator's own error (``TableExistsError``,
    ``MoveRefusedError``, ...) or ``Retryable`` where it restarted or did not answer."""

    # the catalog and its owner
    def ping(self) -> Reply[int]:
        """The version of the roles' messages it speaks (``runtime/wire.py``)."""
        ...

    def catalog(self, tables: Sequence[str] | None = None) -> Reply[CatalogJson]:
        """The catalog whole (None), or only what routing ``tables`` takes
        (``Catalog.routing``): what a session asks for."""
        ...

    def owner_token(self) -> Reply[OwnerToken]:
        """The token every durable write of this cluster carries."""
        ...

    def register_nodes(self, nodes: list[str]) -> Reply[CatalogJson]:
        """Declare the live nodes; units on nodes that are gone get new owners."""
        ...

    def report_profile(self, profile: NodeProfile) -> Reply[None]: ...
    def release(self) -> Reply[None]:
        """Stop the control loops and give the data directory up (a clean shutdown)."""
        ...

    # tables
    def begin_create(self, table: NewTable) -> Reply[CatalogJson]:
        """Reserve the table's name and plan its units; answers the catalog as it will be
        once the load is committed (nothing is visible before)."""
        ...

    def commit_create(self, name: str, rows: int) -> Reply[CatalogJson]: ...
    def announce(self, nodes: Sequence[str]) -> Reply[None]:
        """Tell ``nodes`` of the catalog's changes since what each serves (as it is told
        them: ``runtime/coordinator/announce.py``), once they answer."""
        ...

    def abort_create(self, name: str) -> Reply[None]: ...
    def drop_table(self, name: str) -> Reply[tuple[CatalogJson, str]]:
        """Drop ``name`` from the catalog; answers the new catalog and the table's uid (its
        files are deleted once the workers no longer serve it: :meth:`delete_files`)."""
        ...

    def delete_files(self, uid: str) -> Reply[None]: ...
    def truncate_table(self, name: str) -> Reply[CatalogJson]:
        """Empty ``name``: new files and the next commit number, every node told before
        the answer (the table's routing); its old files are deleted."""
        ...

    def change_rows(
        self,
        name: str,
        statement: str,
        change: RowRewrite,
        buckets: Sequence[int] | None = None,
    ) -> Reply[dict[str, Any]]:
        """Change rows of ``name`` all or nothing (``DELETE``, ``UPDATE``), once per
        ``statement`` id: prepared on every shard (owning ``buckets``, the buckets its
        ``WHERE`` fixes; None: all), the decision
        logged in the catalog, every node told before the answer: ``rows`` changed, the
        table's ``routing``. A statement already committed is answered as it was."""
        ...

    def set_grants(self, name: str, grants: Sequence[Sequence[str]]) -> Reply[CatalogJson]:
        """Replace a table's grants (``catalog/grants.py``); answers its routing."""
        ...

    # cluster operations
    def migrate(self, unit_id: int, to: str) -> Reply[dict[str, Any]]: ...
    def split(self, unit_id: int) -> Reply[dict[str, Any]]: ...
    def merge(self, first: int, second: int) -> Reply[dict[str, Any]]: ...
    def rebalance(self, dry_run: bool) -> Reply[dict[str, Any]]: ...
    def cancel(self, move_id: str) -> Reply[dict[str, Any]]:
        """Roll a running move back; answers the move as it stands (it ends cancelled)."""
        ...

    def pause_balancer(self, paused: bool) -> Reply[bool]:
        """Start no balancing move while ``paused``; answers whether it was paused before."""
        ...

    def reserve_node(self) -> Reply[str]:
        """A new node id (never reused); the node joins with :meth:`node_joined`."""
        ...

    def node_joined(self, node: str) -> Reply[CatalogJson]: ...
    def drain(self, node: str, deadline_s: float) -> Reply[DrainReport]: ...
    def cancel_drain(self, node: str) -> Reply[bool]:
        """Stop a running drain of ``node`` (its running move rolls back); answers whether
        one was running."""
        ...

    def host(self) -> Reply[str]:
        """The Ray node the coordinator runs on ("" where it runs on none)."""
        ...

    def drain_host(self, host: str, deadline_s: float) -> Reply[list[DrainReport]]:
        """Drain every worker on the Ray node ``host`` and stop them; none starts there
        again."""
        ...

    # reports
    def migrations(self) -> Reply[list[dict[str, Any]]]: ...
    def failovers(self) -> Reply[list[dict[str, Any]]]: ...
    def metrics_url(self) -> Reply[str]: ...
    def node_loads(self) -> Reply[dict[str, NodeLoad]]: ...
    def shard_loads(self) -> Reply[dict[ShardKey, float]]: ...
    def record_outcomes(self, queries: list[tuple[float, bool]], inserts: list[int]) -> Reply[None]:
        """Queries' (seconds, succeeded) and inserts' row counts, sent in batches by each
        session, for the metrics."""
        ...

    def record_access(self, denied_action: str | None) -> Reply[None]:
        """A service call refused for its role (``denied_action``) or (None) for a wrong
        password or token, for the metrics."""
        ...
