"""shardflow: distributed SQL over sharded Arrow tables on a Ray cluster.

import shardflow
with shardflow.connect(workers=4) as db:
    db.create_table("orders", "orders.parquet", distributed_by="o_orderkey")
    db.sql("SELECT count(*) FROM orders")
"""

from shardflow.api import Cluster, Database, MigrationRecord, NodeInfo, connect
from shardflow.config import Settings
from shardflow.errors import (
    ClosedError,
    ClusterError,
    ConfigError,
    DataDirInUseError,
    DrainTimeoutError,
    Error,
    MigrationError,
    MoveRefusedError,
    OwnershipLostError,
    QueryError,
    SchemaMismatchError,
    SqlSyntaxError,
    TableError,
    TableExistsError,
    UnknownColumnError,
    UnknownShardError,
    UnknownTableError,
    UnsupportedError,
)
from shardflow.telemetry.profile import QueryProfile

__version__ = "0.1.0"

__all__ = [
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
    "MoveRefusedError",
    "NodeInfo",
    "OwnershipLostError",
    "QueryError",
    "QueryProfile",
    "SchemaMismatchError",
    "Settings",
    "SqlSyntaxError",
    "TableError",
    "TableExistsError",
    "UnknownColumnError",
    "UnknownShardError",
    "UnknownTableError",
    "UnsupportedError",
    "__version__",
    "connect",
]
