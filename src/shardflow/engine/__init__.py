"""Local execution: run SQL over named Arrow tables on one node."""

from shardflow.engine.base import Engine
from shardflow.engine.duckdb_engine import DuckDBEngine, distinct_names, query_error

__all__ = ["DuckDBEngine", "Engine", "distinct_names", "query_error"]
