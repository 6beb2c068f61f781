"""shardflow: distributed SQL over sharded Arrow tables on a Ray cluster.

import shardflow
with shardflow.connect(workers=4) as db:
    db.create_table("orders", "orders.parquet", distributed_by="o_orderkey")
    db.sql("SELECT count(*) FROM orders")
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from shardflow.config import Settings
from shardflow.errors import (
    AuthenticationError,
    ClosedError,
    ClusterError,
    ConfigError,
    DataDirInUseError,
    DrainTimeoutError,
    Error,
    MigrationError,
    MoveCancelled,
    MoveRefusedError,
    OwnershipLostError,
    PermissionDeniedError,
    QueryError,
    SchemaMismatchError,
    SqlSyntaxError,
    StorageError,
    TableError,
    TableExistsError,
    UnknownColumnError,
    UnknownShardError,
    UnknownTableError,
    UnsupportedError,
)

if TYPE_CHECKING:
    from shardflow.api import AnswerPart, Cluster, Database, MigrationRecord, NodeInfo, connect
    from shardflow.telemetry.profile import QueryProfile

__version__ = "0.3.0.dev0"

_LAZY = {
    "AnswerPart": "shardflow.api",
    "Cluster": "shardflow.api",
    "Database": "shardflow.api",
    "MigrationRecord": "shardflow.api",
    "NodeInfo": "shardflow.api",
    "connect": "shardflow.api",
    "QueryProfile": "shardflow.telemetry.profile",
}
"""Imported on first use: a worker process imports only the modules it runs (the client's
planner, session and Flight client cost each of them a few hundred ms of start-up)."""


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shardflow' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "AnswerPart",
    "AuthenticationError",
    "ClosedError",
    "Cluster",
    "ClusterError",
    "ConfigError",
    "DataDirInUseError",
    "Database",
    "DrainTimeoutError",
    "Error",
    "MigrationError",
    "MigrationRecord",
    "MoveCancelled",
    "MoveRefusedError",
    "NodeInfo",
    "OwnershipLostError",
    "PermissionDeniedError",
    "QueryError",
    "QueryProfile",
    "SchemaMismatchError",
    "Settings",
    "SqlSyntaxError",
    "StorageError",
    "TableError",
    "TableExistsError",
    "UnknownColumnError",
    "UnknownShardError",
    "UnknownTableError",
    "UnsupportedError",
    "__version__",
    "connect",
]
