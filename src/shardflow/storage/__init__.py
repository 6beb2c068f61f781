"""Shard data and durability: Arrow in memory, write-ahead log, Parquet base, recovery."""

from shardflow.storage.shard import AppendResult, CheckpointPolicy, Shard
from shardflow.storage.shard_store import ShardStore, shard_folder

__all__ = ["AppendResult", "CheckpointPolicy", "Shard", "ShardStore", "shard_folder"]
