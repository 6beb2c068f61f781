"""The CPU engine: DuckDB over Arrow tables, registered without copying."""

from __future__ import annotations

from collections.abc import Mapping

import duckdb
import pyarrow as pa


class DuckDBEngine:
    """Runs a SQL text over named Arrow tables. Safe to call from many threads at once."""

    name = "duckdb"

    def __init__(self, threads: int | None = None, memory_limit: str | None = None) -> None:
        config: dict[str, str | int] = {}
        if threads:
            config["threads"] = threads
        if memory_limit:
            config["memory_limit"] = memory_limit
        self._database = duckdb.connect(":memory:", config=config)

    def run(self, sql: str, tables: Mapping[str, pa.Table]) -> pa.Table:
        """Execute ``sql``; every name in ``tables`` is visible to it as a table."""
        cursor = self._database.cursor()  # a connection of its own: registrations are private
        try:
            for name, table in tables.items():
                cursor.register(name, table)
            return cursor.sql(sql).to_arrow_table()
        finally:
            cursor.close()

    def close(self) -> None:
        self._database.close()
