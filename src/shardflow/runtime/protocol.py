"""Every wire type and interface between the roles: what the session and the coordinator
ask the workers (:class:`Worker`), what the session and the workers ask the coordinator
(:class:`Coordinator`), what a move's target asks its sources (:class:`SourceLink`), each
call's arguments and answers as frozen dataclasses.

Two implementations of each: on Ray (``runtime/ray/handles.py``, calling the actors of
``runtime/ray/actors.py``) and in this process (``runtime/inprocess.py``: real coordinator
and workers, real DuckDB, real files), which unit tests drive without Ray. Every answer is a
:class:`Reply`, so a caller can have many calls in flight; ``get`` raises shardflow errors
only, whatever carried it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, cast

import pyarrow as pa

from shardflow.errors import Error
from shardflow.runtime.wire import check_peer

if TYPE_CHECKING:
    import numpy as np

    from shardflow.catalog import OwnerToken, TableSpec
    from shardflow.control.migration import Checksum, MovePlan, SourceChecksums
    from shardflow.storage.shard import Change, RowRewrite
    from shardflow.storage.shard_store import Applied
    from shardflow.telemetry.devices import DeviceState, MemoryState, NodeProfile


T_co = TypeVar("T_co", covariant=True)
T = TypeVar("T")

ShardKey = tuple[str, int]
"""A shard of a distributed table: (table, unit id)."""

CatalogJson = Mapping[str, Any]
"""A catalog as ``Catalog.to_json`` writes it: how catalogs travel to workers."""

REPLICA = "replica"
"""The part of a load that goes to a replicated table's one shard on a worker (a
distributed table's parts are keyed by unit id)."""


class Reply(Protocol[T_co]):
    """The answer to a call, which may still be on its way."""

    def get(self, timeout: float | None = None) -> T_co:
        """Wait for the answer. Raises shardflow errors only: ``WorkerGone`` (the worker died
        or left), ``WorkerTimeout`` (no answer within ``timeout`` seconds), the worker's own
        error (``Moved``, ``QueryError``, ...), or ``ClusterError`` for anything else."""
        ...


@dataclass(frozen=True)
class Answered(Generic[T]):
    """A reply whose call already ran (in process, or over a fast lane): its value, or
    the error ``get`` raises."""

    value: T | None = None
    error: Error | None = None

    def get(self, timeout: float | None = None) -> T:
        if self.error is not None:
            raise self.error
        return cast("T", self.value)


# -- queries -------------------------------------------------------------------------------
@dataclass(frozen=True)
class FragmentStats:
    """What a worker measured of a fragment it ran. Beyond the time and the rows, the fields
    are filled only where the query is profiled (``profile_queries``, ``db.profile``)."""

    seconds: float
    """Execution time on the worker (queue wait and transfer excluded)."""
    rows_out: int
    started_at: float | None = None
    """Wall clock (``time.time``) when the worker started the fragment."""
    finished_at: float | None = None
    rows_in: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    engine: str = ""
    device: str = ""


@dataclass(frozen=True)
class LaneAddress:
    """Where a worker answers over its fast lane (``runtime/fastlane.py``)."""

    host: str
    port: int
    token: str
    """Hex of the worker's token."""
    endpoint: str = ""
    """The worker's own Flight location, where clients read the parts of answers reserved
    on it (``runtime/worker/endpoint.py``); "" where it serves none."""
    steps: tuple[str, ...] = ()
    """The steps of a move it takes over its lane besides a snapshot's chunks (``fence``,
    ``retire``, ``finish``); a worker of 0.2.0 takes none (its address reads as ()), and is
    asked those through Ray."""


@dataclass(frozen=True)
class PartRequest:
    """A part of an answer to reserve on a worker for one read from its Flight endpoint
    (``runtime/worker/endpoint.py``): the fragment (``sql`` over ``bindings`` at
    ``epoch``, the tables at ``commits``), the answer's ``schema``, who reads it (``user``
    for the audit log, ``caller`` the :func:`credential_digest` of its credential) and for
    how long (``ttl_s``)."""

    sql: str
    bindings: Mapping[str, list[int]]
    epoch: int
    commits: Mapping[str, int]
    schema: pa.Schema
    user: str
    caller: str
    ttl_s: float

    def to_json(self) -> dict[str, Any]:
        return {
            "sql": self.sql, "bindings": dict(self.bindings), "epoch": self.epoch,
            "commits": dict(self.commits), "schema": self.schema.serialize().to_pybytes().hex(),
            "user": self.user, "caller": self.caller, "ttl_s": self.ttl_s,
        }  # fmt: skip

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PartRequest:
        return cls(
            str(data["sql"]),
            {str(t): [int(u) for u in us] for t, us in data["bindings"].items()},
            int(data["epoch"]),
            {str(t): int(c) for t, c in data["commits"].items()},
            pa.ipc.read_schema(pa.py_buffer(bytes.fromhex(data["schema"]))),
            str(data["user"]),
            str(data["caller"]),
            float(data["ttl_s"]),
        )


def credential_digest(credential: str) -> str:
    """What a worker keeps of the credential a part of an answer is read with (its SHA-256):
    a session reserving the part sends it, the worker compares it with the digest of the
    bearer token its reader sends (``runtime/worker/endpoint.py``)."""
    return hashlib.sha256(credential.encode()).hexdigest() if credential else ""


# -- reports -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShardInfo:
    table: str
    unit: int
    rows: int
    bytes: int
    lsn: int
    indexed: bool = False
    """Whether the shard's rows keep an index on the table's key (``key_index``)."""
    prepared: tuple[str, ...] = ()
    """Changes of rows (their statements) prepared in the shard and not decided yet."""


@dataclass(frozen=True)
class ReplicaInfo:
    table: str
    rows: int
    bytes: int
    lsn: int
    prepared: tuple[str, ...] = ()
    """Changes of rows (their statements) prepared in the copy and not decided yet."""


@dataclass(frozen=True)
class Host:
    """Where a worker runs: its Ray node's id, address and name."""

    ray_node_id: str = ""
    address: str = ""
    name: str = ""


@dataclass(frozen=True)
class DeviceCache:
    """The shards a worker keeps in its engine's memory (on the GPU of a GPU worker)."""

    budget_bytes: int
    """``device_cache_mb``: what the kept frames may take."""
    bytes: int
    shards: int
    hit_rate: float
    """Of the fragments' shard reads, those that found the shard kept (its new appends
    added, where it had some)."""


@dataclass(frozen=True)
class WorkerInfo:
    """A worker as ``db.cluster.nodes()`` and the metrics show it."""

    profile: NodeProfile
    shards: tuple[ShardInfo, ...]
    replicas: tuple[ReplicaInfo, ...]
    queries_running: int
    busy_seconds: float
    uptime_seconds: float
    catalog_version: int
    device: DeviceState
    memory: MemoryState
    engine_fallbacks: Mapping[str, int]
    """Fragments that fell back from the node's engine, by where they went."""
    last_fallback: str
    host: Host = Host()
    """The Ray node the worker runs on (empty for an in-process worker)."""
    protocol: int = 1
    """What it speaks (``runtime/wire.py``; a worker of a release before the number was
    sent answers without it: 1)."""
    pid: int = 0
    """The worker's process id on its host."""
    device_cache: DeviceCache | None = None
    """What the worker keeps in its engine's memory; None where it keeps nothing."""
    release: str = ""
    """The shardflow release the worker runs ("" from a worker of 0.2.0 or before, which
    did not say): during a rolling upgrade, which workers run the new one."""


@dataclass(frozen=True)
class LoadReport:
    """Cumulative execution seconds and every unit's bytes: the controller turns two reports
    into rates (the balancer's input)."""

    at: float
    """``time.monotonic()`` on the worker when the report was taken."""
    busy_seconds: float
    unit_seconds: Mapping[int, Mapping[str, float]]
    """Per unit, execution seconds by calibrated operator (the unit's operator mix)."""
    shard_seconds: Mapping[ShardKey, float]
    unit_bytes: Mapping[int, int]
    op_seconds: Mapping[str, float]
    """Execution seconds by calibrated operator (the node's operator mix)."""
    device_utilization: float | None
    operations: int = 0
    """Fragments and appends run on this worker since it started."""
    failures: int = 0
    """Of those, the ones the node failed (not the caller's errors: bad SQL, wrong types)."""
    device_errors: int | None = None
    """The device's uncorrectable error count (None: no such telemetry)."""
    memory_budget: int = 0
    """Bytes of shards the worker keeps in its engine's memory at most (its device cache
    budget; 0: it keeps none, no bound)."""


@dataclass(frozen=True)
class SharedRows:
    """Rows put once where every worker can read them: one upload for many receivers (a
    replicated table's load or insert). ``ref`` is the implementation's handle."""

    ref: object


# -- a live move ---------------------------------------------------------------------------
@dataclass(frozen=True)
class PinnedShard:
    """A source shard pinned at a snapshot: its log sequence number and the insert batches
    it holds (so that a retried insert still lands once after the move)."""

    lsn: int
    applied: Applied


@dataclass(frozen=True)
class ExportPinned:
    """A source's shards of a move, pinned; their rows follow chunk by chunk."""

    node: str
    shards: Mapping[ShardKey, PinnedShard]


@dataclass(frozen=True)
class ChangeSet:
    """Inserts a source took in after its snapshot, per shard, oldest first."""

    node: str
    changes: Mapping[ShardKey, tuple[Change, ...]]

    @property
    def rows(self) -> int:
        return sum(c.rows.num_rows for found in self.changes.values() for c in found)


@dataclass(frozen=True)
class FenceResult:
    """A fenced source's one answer: the changes it had not handed out yet, and the
    checksums of everything it handed out, these changes included."""

    changes: ChangeSet
    sums: SourceChecksums


@dataclass(frozen=True)
class CopyResult:
    rows: int
    bytes: int


@dataclass(frozen=True)
class FinalApplied:
    """The target applied the fenced sources' last changes (``rows``); ``stored`` is, per
    table, the checksum of what its new shards hold: the snapshot as stored, and every
    change applied."""

    rows: int
    stored: Mapping[str, Checksum]
    promoted: bool = False
    """Whether the target found ``stored`` equal to what the sources handed out and serves
    the new shards already (saving the switch a round trip while writers wait)."""
    handed_out: tuple[SourceChecksums, ...] = ()
    """What each fenced source said it handed out (VERIFY compares it with ``stored``)."""


# -- tables ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class PreparedChange:
    """A node's part of a change of rows, prepared (``Worker.prepare_change``)."""

    rows: dict[int | str, int]
    """Per shard (unit id, or ``REPLICA``), the rows the statement changes there."""
    moving: pa.Table | None = None
    """Rows an UPDATE of the key gave a key another shard owns (new values), and below
    their buckets: the statement inserts them there (``Worker.prepare_rows``)."""
    buckets: np.ndarray | None = None
    returned: tuple[pa.Table, ...] = ()
    """What the changed rows give back (a statement's ``RETURNING``), per shard."""


@dataclass(frozen=True)
class NewTable:
    """A table to create, as the session asks the coordinator to plan it."""

    name: str
    schema: bytes
    """Its Arrow schema, serialised (Arrow IPC)."""
    kind: str
    """``distributed`` or ``replicated``."""
    key: str | None = None
    """A distributed table's column hashed into buckets ("": rows spread evenly)."""
    colocate_with: str | None = None
    """A table whose co-location group it joins (equal bucket ranges on one node)."""
    key_index: bool = False
    """Keep an index on ``key`` in every shard (point lookups)."""
    size_bytes: int | None = None
    """The source's Arrow size, where known before the load (how many units it gets);
    None for a stream."""
    grants: tuple[tuple[str, str, str], ...] | None = None
    """Its grants (``catalog/grants.py``); None: shared, PUBLIC holds every privilege (the
    service gives OWNER to the account making it, and nothing else)."""


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


# -- the coordinator's answers to the session ---------------------------------------------
@dataclass(frozen=True)
class NodeLoad:
    utilization: float | None
    """Busy fraction over the balancer's last window; None until a window has passed."""
    capacity: float
    """Capacity for the cluster's operator mix relative to the median node."""
    health: str = "healthy"
    """``healthy``, ``suspect`` or ``failing`` (``control/health.py``)."""
    failure_rate: float = 0.0
    """Share of its operations the node failed over ``node_failure_window_s``."""


@dataclass(frozen=True)
class DrainReport:
    drained: bool
    node: str
    moved: tuple[dict[str, Any], ...]
    """The moves made, as ``db.cluster.migrations()`` reports them."""
    remaining: int
    reason: str
    cancelled: bool = False
    """Stopped by an operator (``cancel_drain``), not by its deadline."""


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
