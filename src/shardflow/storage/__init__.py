"""Shard data and durability: Arrow in memory, write-ahead log, Parquet base, recovery."""

from shardflow.storage.shard import (
    AppendResult,
    ArrowRows,
    CheckpointPolicy,
    RowRewrite,
    RowStore,
    Shard,
)
from shardflow.storage.shard_store import ShardStore, shard_folder

__all__ = [
    "AppendResult",
    "ArrowRows",
    "CheckpointPolicy",
    "RowRewrite",
    "RowStore",
    "Shard",
    "ShardStore",
    "shard_folder",
]
