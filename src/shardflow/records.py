"""What the cluster reports about itself: its nodes and its live moves. Plain records, the
same for a local :class:`~shardflow.api.Database` and a remote one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class NodeInfo:
    """One worker: its device profile and what it holds and does now."""

    node_id: str
    alive: bool
    vendor: str
    model: str
    engine: str
    memory_bytes: int
    cores: int
    capacity: float
    """Calibrated capacity for the cluster's operator mix relative to the median node, as
    placement and the balancer use it (0.5: gets half a median node's work)."""
    simulated: bool
    shards: int
    rows: int
    bytes: int
    queries_running: int
    utilization: float | None
    """Busy fraction over the balancer's last window (``balance_interval_s``); None until
    a window has passed."""
    busy_fraction: float
    """Share of the worker's uptime spent executing fragments (summed over threads)."""
    memory_used_bytes: int
    memory_free_bytes: int
    device_utilization: float | None
    """GPU utilisation (0..1) from NVML / AMD SMI; None on a CPU node."""
    device_memory_used_bytes: int | None
    device_memory_free_bytes: int | None
    """GPU memory from NVML / AMD SMI; None on a CPU node."""
    engine_note: str
    calibration: dict[str, float]
    """Rows per second per operator measured when the worker joined."""
    ray_node_id: str = ""
    """The Ray node the worker is pinned to ("" when it does not answer)."""
    host: str = ""
    """That Ray node's address."""
    ray_node_name: str = ""
    """That Ray node's name (its ``shardflow-name`` label, else Ray's node name)."""
    health: str = "healthy"
    """``healthy``; ``suspect`` (failing more than ``node_failure_rate`` of its operations:
    it gets no new shards and its shards move off); ``failing`` (kept empty until removed)."""
    failure_rate: float = 0.0
    """Share of its operations (fragments, inserts, health checks) the node failed over
    the last ``node_failure_window_s``."""
    engine_memory_bytes: int = 0
    """What the worker's DuckDB holds in memory (shards and running queries' state);
    ``memory_used_bytes`` is the whole process's resident memory."""
    spilled_bytes: int = 0
    """What the worker's DuckDB has spilled to its local disk (``local_dir``)."""
    memory_limit_bytes: int = 0
    """What the worker's DuckDB may hold in memory (``worker_memory_mb``)."""
    pid: int = 0
    """The worker's process id on its host (0: not known)."""
    device_cache_bytes: int = 0
    """Shard frames the worker keeps in its engine's memory (the GPU's on a GPU worker)."""
    device_cache_budget_bytes: int = 0
    """What those may take (``device_cache_mb``); 0 where the worker keeps none."""
    device_cache_hit_rate: float | None = None
    """Of its fragments' shard reads, those that found the shard kept; None: keeps none."""
    release: str = ""
    """The shardflow release the worker runs ("" where it did not say: a worker of 0.2.0
    or before, or one that does not answer)."""


@dataclass(frozen=True)
class MigrationRecord:
    """One live move (migration, split or merge), as the history keeps it."""

    move_id: str
    kind: str
    reason: str
    shards: tuple[str, ...]
    """The shards that moved (every co-located table of the unit)."""
    new_shards: tuple[str, ...]
    from_nodes: tuple[str, ...]
    to_nodes: tuple[str, ...]
    phase: str
    outcome: str
    """"done", or why it was rolled back."""
    started_at: float
    seconds: float
    phase_seconds: dict[str, float]
    rows: int
    bytes: int
    catch_up_rounds: int
    fence_seconds: float
    """How long writes to the moving shards were held (they wait; they do not fail)."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MigrationRecord:
        fields = {f for f in cls.__dataclass_fields__}
        values: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in fields
        }
        return cls(**values)


@dataclass(frozen=True)
class BackupInfo:
    """One backup of a data directory (``shardflow backup``, ``db.cluster.backup``)."""

    backup_id: str
    started_at: float
    finished_at: float
    catalog_version: int
    tables: int
    files: int
    bytes: int
    """The files' bytes: what a restore writes."""
    bytes_written: int
    """Bytes this backup added to its folder (chunks there already are not written again)."""
    rounds: int
    """Readings of the catalog it took (1: no table's files changed under it)."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BackupInfo:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class AnswerPart:
    """A part of a query's answer to read straight from the worker that holds it
    (``Database.endpoints``): its Flight ``location`` and the ``ticket`` a ``DoGet`` there
    reads it with, once, before the ticket expires."""

    node: str
    location: str
    ticket: bytes
