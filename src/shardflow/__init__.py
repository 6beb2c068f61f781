"""shardflow: distributed SQL over sharded Arrow tables on a Ray cluster.

import shardflow
with shardflow.connect(workers=4) as db:
    db.create_table("orders", "orders.parquet", distributed_by="o_orderkey")
    db.sql("SELECT count(*) FROM orders")
"""

from shardflow.api import Cluster, Database, MigrationRecord, NodeInfo, connect
from shardflow.config import Settings
from shardflow.errors import (
    ClusterError,
    ConfigError,
    DrainTimeoutError,
    Error,
    MigrationError,
    MoveRefusedError,
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
    "Cluster",
    "ClusterError",
    "ConfigError",
    "Database",
    "DrainTimeoutError",
    "Error",
    "MigrationError",
    "MigrationRecord",
    "MoveRefusedError",
    "NodeInfo",
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
