"""Local execution: run SQL over named Arrow tables on one node."""

from shardflow.engine.base import Engine
from shardflow.engine.duckdb_engine import DuckDBEngine

__all__ = ["DuckDBEngine", "Engine"]
