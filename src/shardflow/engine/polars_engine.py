"""The GPU engine: Polars SQL, collected with cudf-polars on NVIDIA GPUs (or on the CPU).

Fragments arrive as DuckDB SQL; SQLGlot rewrites them for Polars' SQL (a PostgreSQL-like
dialect). What Polars cannot run — SQL it does not parse, or operations the GPU engine does
not support — falls back: to Polars on the CPU when the GPU cannot, and to DuckDB when Polars
cannot at all. Every fallback is counted and its last reason kept, for the node's profile.
Polars and cudf-polars are optional (``pip install shardflow[gpu]``) and imported lazily.
"""

from __future__ import annotations

import functools
import threading
from collections import Counter
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
import sqlglot

from shardflow.engine.duckdb_engine import DuckDBEngine


@functools.lru_cache(maxsize=2048)
def polars_sql(sql: str) -> tuple[str, frozenset[str], frozenset[str] | None]:
    """DuckDB SQL rewritten for Polars, the tables it reads (CTE names left out) and the
    column names it mentions (None when it selects ``*``: then every column is needed)."""
    tree = sqlglot.parse_one(sql, read="duckdb")
    ctes = {cte.alias_or_name for cte in tree.find_all(sqlglot.exp.CTE)}
    tables = frozenset(t.name for t in tree.find_all(sqlglot.exp.Table)) - ctes
    star = any(not isinstance(s.parent, sqlglot.exp.Count) for s in tree.find_all(sqlglot.exp.Star))
    columns = None if star else frozenset(c.name for c in tree.find_all(sqlglot.exp.Column))
    return tree.sql(dialect="postgres"), tables, columns


class PolarsEngine:
    """Runs SQL over named Arrow tables with Polars; ``gpu`` collects on the GPU."""

    def __init__(self, storage: DuckDBEngine, gpu: bool = False, device: int = 0) -> None:
        import polars  # imported here: CPU-only installs need not have it

        self._polars = polars
        self.storage = storage
        """Holds the shards; per-call views are read from it as Arrow."""
        self.gpu = gpu
        self.name = "polars-gpu" if gpu else "polars"
        self._engine: Any = "cpu"
        if gpu:
            self._engine = polars.GPUEngine(device=device, raise_on_fail=True)
        self.fallbacks: Counter[str] = Counter()
        self.last_fallback = ""
        self._lock = threading.Lock()
        self._call = threading.local()

    @property
    def fell_back(self) -> str:
        """Where this thread's last call fell back to ("" when it did not)."""
        return str(getattr(self._call, "where", ""))

    def run(
        self,
        sql: str,
        tables: Mapping[str, pa.Table] | None = None,
        views: Mapping[str, str] | None = None,
    ) -> pa.Table:
        self._call.where = ""
        frames = dict(tables or {})
        for name, select in (views or {}).items():  # the bound shards, read as Arrow
            frames[name] = self.storage.run(select)
        try:
            query, read, columns = polars_sql(sql)
        except sqlglot.errors.SqlglotError as error:
            return self._fall_back("duckdb", f"SQL not rewritable: {error}", sql, frames)
        for name in read - frames.keys():  # replicated tables: the node's standing views
            frames[name] = self.storage.run(f'SELECT * FROM "{name}"')
        polars_frames = {}
        for name in read & frames.keys():  # only what the query reads goes to Polars
            table = frames[name]
            if columns is not None:  # unused columns (long strings above all) stay behind
                kept = [c for c in table.column_names if c in columns]
                table = table.select(kept or table.column_names[:1])  # keeps the row count
            polars_frames[name] = self._polars.from_arrow(table)
        context = self._polars.SQLContext(frames=polars_frames, eager=False)
        try:
            lazy = context.execute(query)
        except Exception as error:  # Polars' SQL front end refused it
            return self._fall_back("duckdb", f"Polars SQL: {_first(error)}", sql, frames)
        try:
            return lazy.collect(engine=self._engine).to_arrow()
        except Exception as error:
            if not self.gpu:
                return self._fall_back("duckdb", f"Polars: {_first(error)}", sql, frames)
            self._note("cpu", f"GPU engine: {_first(error)}")
            try:
                return lazy.collect().to_arrow()
            except Exception as cpu_error:
                return self._fall_back("duckdb", f"Polars: {_first(cpu_error)}", sql, frames)

    def _fall_back(
        self, where: str, reason: str, sql: str, frames: Mapping[str, pa.Table]
    ) -> pa.Table:
        self._note(where, reason)
        return self.storage.run(sql, frames)

    def _note(self, where: str, reason: str) -> None:
        self._call.where = where
        with self._lock:
            self.fallbacks[where] += 1
            self.last_fallback = f"fell back to {where}: {reason}"


def _first(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__
