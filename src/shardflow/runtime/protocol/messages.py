"""What crosses between the roles: each call's arguments and answers as frozen dataclasses,
and :class:`Reply`, how every answer comes back."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, cast

import pyarrow as pa

from shardflow.errors import Error

if TYPE_CHECKING:
    import numpy as np

    from shardflow.control.migration import Checksum, SourceChecksums
    from shardflow.storage.shard import Change
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
    """Where a worker answers over its fast lane (``runtime/fastlane/``)."""

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


def _pickled_as_before() -> None:
    """Every class here pickles as ``shardflow.runtime.protocol.<name>``: the path 0.2.0, whose
    protocol was one module, reads them by, so that its workers unpickle what this release
    sends them during a rolling upgrade (a source's ``FenceResult``, a ``CopyResult``, ...).
    The package re-exports each of them under that name."""
    for value in list(globals().values()):
        if isinstance(value, type) and value.__module__ == __name__:
            value.__module__ = "shardflow.runtime.protocol"


_pickled_as_before()
