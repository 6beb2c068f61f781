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

from shardflow.runtime.protocol.messages import (
    REPLICA,
    Answered,
    CatalogJson,
    ChangeSet,
    CopyResult,
    DeviceCache,
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
    PartRequest,
    PinnedShard,
    PreparedChange,
    ReplicaInfo,
    Reply,
    ShardInfo,
    ShardKey,
    SharedRows,
    WorkerInfo,
    credential_digest,
)
from shardflow.runtime.protocol.roles import (
    Coordinator,
    SourceLink,
    Worker,
    Workers,
    admit_workers,
)

__all__ = [
    "REPLICA",
    "Answered",
    "CatalogJson",
    "ChangeSet",
    "Coordinator",
    "CopyResult",
    "DeviceCache",
    "DrainReport",
    "ExportPinned",
    "FenceResult",
    "FinalApplied",
    "FragmentStats",
    "Host",
    "LaneAddress",
    "LoadReport",
    "NewTable",
    "NodeLoad",
    "PartRequest",
    "PinnedShard",
    "PreparedChange",
    "ReplicaInfo",
    "Reply",
    "ShardInfo",
    "ShardKey",
    "SharedRows",
    "SourceLink",
    "Worker",
    "WorkerInfo",
    "Workers",
    "admit_workers",
    "credential_digest",
]
