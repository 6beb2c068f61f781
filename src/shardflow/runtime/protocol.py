"""The one typed protocol between the coordinator side (session, coordinator, migrator,
controller) and the workers: what each call takes and answers, as frozen dataclasses, and the
interfaces that carry them.

Two implementations: Ray actors (``runtime/ray_workers.py``) and real workers in this process
(``runtime/inprocess.py``: real DuckDB, real files), which the unit tests of the migrator and
the controller drive without Ray. Every answer is a :class:`Reply`, so the coordinator side
can have many calls in flight; ``get`` raises shardflow errors only, whatever carried it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa

    from shardflow.catalog import TableSpec
    from shardflow.control.migration import Checksum, MovePlan, SourceChecksums
    from shardflow.storage.shard import Change
    from shardflow.storage.shard_store import Applied
    from shardflow.telemetry.devices import DeviceState, MemoryState, NodeProfile

T_co = TypeVar("T_co", covariant=True)

ShardKey = tuple[str, int]
"""A shard of a distributed table: (table, unit id)."""

CatalogJson = Mapping[str, Any]
"""A catalog as ``Catalog.to_json`` writes it: how catalogs travel to workers."""


class Reply(Protocol[T_co]):
    """The answer to a call, which may still be on its way."""

    def get(self, timeout: float | None = None) -> T_co:
        """Wait for the answer. Raises shardflow errors only: ``WorkerGone`` (the worker died
        or left), ``WorkerTimeout`` (no answer within ``timeout`` seconds), the worker's own
        error (``Moved``, ``QueryError``, ...), or ``ClusterError`` for anything else."""
        ...


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


@dataclass(frozen=True)
class ReplicaInfo:
    table: str
    rows: int
    bytes: int
    lsn: int


@dataclass(frozen=True)
class Host:
    """Where a worker runs: its Ray node's id, address and name."""

    ray_node_id: str = ""
    address: str = ""
    name: str = ""


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


# -- the interfaces ------------------------------------------------------------------------
class Worker(Protocol):
    """One worker, as the coordinator side calls it."""

    @property
    def node_id(self) -> str: ...

    # life and reports
    def ping(self) -> Reply[bool]: ...
    def pid(self) -> Reply[int]: ...
    def info(self) -> Reply[WorkerInfo]: ...
    def load_report(self) -> Reply[LoadReport]: ...
    def calibrate(self) -> Reply[NodeProfile]:
        """Measure the device (a second or so) and report the profile to the coordinator."""
        ...

    def sync(self, catalog: CatalogJson) -> Reply[int]:
        """Serve what ``catalog`` assigns to this node; answers the version it serves."""
        ...

    # tables: loads and inserts
    def prepare(self, spec: TableSpec, unit_ids: Sequence[int], primary: bool) -> Reply[None]: ...
    def stage(self, table: str, parts: Mapping[int | str, pa.Table | SharedRows]) -> Reply[int]: ...
    def commit_load(self, table: str) -> Reply[int]: ...
    def finish_load(self, table: str, catalog: CatalogJson) -> Reply[None]: ...
    def abort_load(self, table: str) -> Reply[None]: ...
    def append(
        self,
        table: str,
        parts: Mapping[int, tuple[pa.Table, np.ndarray]],
        batch_id: str,
        epoch: int,
    ) -> Reply[Mapping[int, int]]:
        """Append each unit's rows (and their buckets) durably; answers each unit's LSN."""
        ...

    def append_replica(
        self, table: str, rows: pa.Table | SharedRows, batch_id: str
    ) -> Reply[int]: ...

    # a move, as its source
    def unit_bytes(self, units: Sequence[int]) -> Reply[int]: ...
    def fence(self, move_id: str) -> Reply[FenceResult]:
        """Hold new writes to the move's shards; hand out the last changes and the final
        checksums in one answer."""
        ...

    def retire(self, move_id: str) -> Reply[None]: ...
    def drop_retired(self, move_id: str) -> Reply[bool]: ...
    def abort_export(self, move_id: str) -> Reply[None]: ...

    # a move, as its target
    def memory_headroom(self) -> Reply[int]: ...
    def copy_snapshot(self, plan: MovePlan, bandwidth_bytes_s: float) -> Reply[CopyResult]:
        """Build the plan's targets on this node from the sources' pinned snapshots, pulled
        worker to worker at most ``bandwidth_bytes_s`` (0: no cap)."""
        ...

    def catch_up(self, move_id: str) -> Reply[int]:
        """Apply what the sources took in since the last pull; answers those rows."""
        ...

    def apply_final(self, move_id: str, fenced: Sequence[FenceResult]) -> Reply[FinalApplied]:
        """Apply the fenced sources' last changes; where the copy then holds what they
        handed out, serve the new shards (promote) in the same call."""
        ...

    def promote(self, move_id: str) -> Reply[None]: ...
    def abort_import(self, move_id: str) -> Reply[None]: ...


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

    def share(self, rows: pa.Table) -> SharedRows: ...


class SourceLink(Protocol):
    """What the target of a move reads from one source, worker to worker."""

    def pin(self, plan: MovePlan) -> ExportPinned: ...
    def chunks(self, move_id: str, key: ShardKey) -> Iterator[pa.Table]:
        """The shard's pinned snapshot, a chunk at a time."""
        ...

    def changes(self, move_id: str, since: Mapping[ShardKey, int]) -> Reply[ChangeSet]:
        """The inserts each shard took in after LSN ``since[shard]``."""
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
