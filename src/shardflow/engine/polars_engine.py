"""The GPU engine: Polars SQL, collected with cudf-polars on NVIDIA GPUs (or on the CPU).

Fragments arrive as DuckDB SQL; SQLGlot rewrites them for Polars' SQL (a PostgreSQL-like
dialect). What Polars cannot run — SQL it does not parse, or operations the GPU engine does
not support — falls back: to Polars on the CPU when the GPU cannot, and to DuckDB when Polars
cannot at all. Every fallback is counted and its last reason kept, for the node's profile.
Polars and cudf-polars are optional (``pip install shardflow[gpu]``) and imported lazily.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import sqlglot

from shardflow.catalog import name_key
from shardflow.engine.duckdb_engine import DuckDBEngine
from shardflow.engine.polars_dialect import (
    Subquery,
    constant_subqueries,
    inputs,
    polars_sql,
    schema_key,
    sql_literal,
    sql_values,
    with_values,
)


class PolarsEngine:
    """Runs SQL over named Arrow tables with Polars; ``gpu`` collects on the GPU."""

    def __init__(
        self,
        storage: DuckDBEngine,
        gpu: bool = False,
        device: int = 0,
        executor: str = "in-memory",
    ) -> None:
        import polars  # imported here: CPU-only installs need not have it

        self._polars = polars
        self.storage = storage
        """Holds the shards; per-call views are read from it as Arrow."""
        self.gpu = gpu
        self.name = "polars-gpu" if gpu else "polars"
        self._engine: Any = "cpu"
        if gpu:
            # cudf-polars' in-memory executor: a fragment's inputs fit on the device, and
            # it ran TPC-H SF 1 in 0.6x the time of the streaming one on an H200
            self._engine = polars.GPUEngine(device=device, raise_on_fail=True, executor=executor)
        # Polars 2's cost-based join reordering joined customer with supplier on nationkey
        # first in TPC-H Q5 (60 M rows; 3.3 s against 0.09 s in FROM order at SF 1); the
        # fragments arrive with joins in a sensible order, so the order is kept. (Polars 1,
        # which cudf-polars supports, keeps the order anyway and has no such flag.)
        try:
            self._optimizations = polars.QueryOptFlags(join_order=False)
        except TypeError:
            self._optimizations = polars.QueryOptFlags()
        self.frames = PolarsFrames()
        """How this engine keeps a shard in its own memory (a worker's kept frames)."""
        self.fallbacks: Counter[str] = Counter()
        self.last_fallback = ""
        self._lock = threading.Lock()
        self._call = threading.local()
        self._schemas: dict[tuple[str, tuple[tuple[str, str], ...]], pa.Schema] = {}

    @property
    def fell_back(self) -> str:
        """Where this thread's last call fell back to ("" when it did not)."""
        return str(getattr(self._call, "where", ""))

    def run(
        self,
        sql: str,
        tables: Mapping[str, pa.Table | Resident] | None = None,
        views: Mapping[str, str] | None = None,
        resident: Mapping[str, Sequence[Resident]] | None = None,
    ) -> pa.Table:
        """``sql`` over ``tables`` (Arrow, or frames kept in the engine's memory) and the
        bound shards: read out of DuckDB as Arrow (``views``), or, for the tables in
        ``resident``, the frames kept of their shards (no copy out of DuckDB, nor into the
        engine's memory)."""
        self._call.where = ""
        frames: dict[str, pa.Table | Resident] = dict(tables or {})
        for name, select in (views or {}).items():
            if resident is not None and name in resident:
                frames[name] = Resident.union(resident[name], self._polars)
            else:  # the bound shards, read as Arrow
                frames[name] = self.storage.run(select)
        return self._run(sql, frames)

    def explain(self, sql: str, tables: Mapping[str, pa.Table]) -> str:
        """The Polars plan ``sql`` runs as over ``tables`` (its scalar subqueries folded as
        :meth:`run` folds them): what the GPU engine is handed."""
        frames = dict(tables)
        lazy = self._lazy(self._folded(sql, frames), frames)
        if isinstance(lazy, pa.Table):
            raise ValueError(f"Polars cannot run this query: {self.last_fallback}")
        return str(lazy.explain())

    def _run(self, sql: str, frames: dict[str, pa.Table | Resident]) -> pa.Table:
        lazy = self._lazy(self._folded(sql, frames), frames, original=sql)
        if isinstance(lazy, pa.Table):  # it fell back to DuckDB
            return lazy
        try:
            result = lazy.collect(engine=self._engine, optimizations=self._optimizations)
        except Exception as error:
            if not self.gpu:
                return self._fall_back("duckdb", f"Polars: {_first(error)}", sql, frames)
            self._note("cpu", f"GPU engine: {_first(error)}")
            try:
                result = lazy.collect(optimizations=self._optimizations)
            except Exception as cpu_error:
                return self._fall_back("duckdb", f"Polars: {_first(cpu_error)}", sql, frames)
        try:
            return conform(result.to_arrow(), self._duckdb_schema(sql, frames))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError) as error:
            return self._fall_back("duckdb", f"result types: {_first(error)}", sql, frames)

    def _folded(self, sql: str, frames: dict[str, pa.Table | Resident]) -> str:
        """``sql`` with its uncorrelated scalar and IN subqueries run first (by this engine)
        and replaced by their values. Polars would join each back to the query as a one-row
        frame (an IN subquery's values imploded into a list), which the GPU engine pads
        with nulls instead of repeating (TPC-H Q11 found no rows) or cannot take at all. One
        that cannot run on its own, or whose values cannot be written, stays."""
        schema = schema_key({name: table.schema for name, table in frames.items()})
        try:
            subqueries = constant_subqueries(sql, schema)
        except sqlglot.errors.SqlglotError:
            return sql
        values: dict[Subquery, str | list[str]] = {}
        for subquery in subqueries:
            try:
                result = self._run(subquery.sql, frames)
            except Exception:  # e.g. it names the outer query's columns: it stays
                continue
            value = sql_values(result) if subquery.listed else sql_literal(result)
            if value is not None:
                values[subquery] = value
        return with_values(sql, schema, values) if values else sql

    def _lazy(
        self, sql: str, frames: dict[str, pa.Table | Resident], original: str | None = None
    ) -> Any:
        """The Polars lazy frame of ``sql`` over ``frames``, or the answer DuckDB gave to
        ``original`` (default ``sql``) where Polars cannot take the query."""
        original = original or sql
        try:
            read, columns = inputs(sql)
            spelled = {name_key(name): name for name in frames}
            for name in read - frames.keys():  # the query may spell a name otherwise
                if name_key(name) in spelled:
                    frames[name] = frames[spelled[name_key(name)]]
            for name in read - frames.keys():  # replicated tables: the node's standing views
                frames[name] = self.storage.run(f'SELECT * FROM "{name}"')
            used = {}
            for name in read & frames.keys():  # only what the query reads goes to Polars
                table = frames[name]
                if columns is not None:  # unused columns (long strings above all) stay behind
                    kept = [c for c in table.schema.names if c in columns]
                    table = table.select(kept or table.schema.names[:1])  # keeps the rows
                used[name] = table
            query = polars_sql(sql, schema_key({n: t.schema for n, t in used.items()}))
        except sqlglot.errors.SqlglotError as error:
            return self._fall_back("duckdb", f"SQL not rewritable: {error}", original, frames)
        polars_frames = {
            name: table.frame if isinstance(table, Resident) else self._polars.from_arrow(table)
            for name, table in used.items()
        }
        context = self._polars.SQLContext(frames=polars_frames, eager=False)
        try:
            return context.execute(query)
        except Exception as error:  # Polars' SQL front end refused it
            return self._fall_back("duckdb", f"Polars SQL: {_first(error)}", original, frames)

    def _duckdb_schema(self, sql: str, frames: Mapping[str, pa.Table | Resident]) -> pa.Schema:
        """The names and types DuckDB gives ``sql`` over tables shaped like ``frames``
        (bound over empty tables once per query text and input schemas)."""
        key = (sql, tuple(sorted((n, str(t.schema)) for n, t in frames.items())))
        schema = self._schemas.get(key)
        if schema is None:
            empty = {name: table.schema.empty_table() for name, table in frames.items()}
            schema = self.storage.run(sql, empty).schema
            with self._lock:
                if len(self._schemas) > 4096:
                    self._schemas.clear()
                self._schemas[key] = schema
        return schema

    def _fall_back(
        self, where: str, reason: str, sql: str, frames: Mapping[str, pa.Table | Resident]
    ) -> pa.Table:
        self._note(where, reason)
        tables = {n: f.table() if isinstance(f, Resident) else f for n, f in frames.items()}
        return self.storage.run(sql, tables)

    def _note(self, where: str, reason: str) -> None:
        self._call.where = where
        with self._lock:
            self.fallbacks[where] += 1
            self.last_fallback = f"fell back to {where}: {reason}"


class Resident:
    """A table's rows as the engine's own frame (a Polars DataFrame; on a GPU worker, the
    device's), with the Arrow schema they came with."""

    def __init__(self, frame: Any, schema: pa.Schema) -> None:
        self.frame = frame
        self.schema = schema

    @staticmethod
    def union(parts: Sequence[Resident], polars: Any) -> Resident:
        """One frame of a table's bound shards, in order (no copy: chunks side by side)."""
        if len(parts) == 1:
            return parts[0]
        return Resident(polars.concat([p.frame for p in parts], rechunk=False), parts[0].schema)

    def select(self, columns: list[str]) -> Resident:
        schema = pa.schema([self.schema.field(c) for c in columns])
        return Resident(self.frame.select(columns), schema)

    def table(self) -> pa.Table:
        """The rows as Arrow again (a fallback to DuckDB reads them so)."""
        return self.frame.to_arrow().cast(self.schema)


class PolarsFrames:
    """How the Polars engine keeps a shard on the CPU: as a Polars DataFrame built once from
    the shard's rows and extended by its appends (the twin of the GPU's device frames,
    sharing everything but where the rows live)."""

    name = "polars"

    def __init__(self) -> None:
        import polars

        self._polars = polars

    def build(self, batches: Iterable[pa.RecordBatch], schema: pa.Schema) -> Resident:
        table = pa.Table.from_batches(list(batches), schema=schema)
        return Resident(self._polars.from_arrow(table, rechunk=False), schema)

    def extend(self, kept: Resident, tables: Sequence[pa.Table]) -> Resident:
        added = [self._polars.from_arrow(t.cast(kept.schema), rechunk=False) for t in tables]
        frame = self._polars.concat([kept.frame, *added], rechunk=False)
        return Resident(frame, kept.schema)

    def nbytes(self, kept: Resident) -> int:
        return int(kept.frame.estimated_size())


def conform(result: pa.Table, schema: pa.Schema) -> pa.Table:
    """``result`` with DuckDB's names and types. Where Polars' type differs, values are cast;
    a date difference (a duration in Polars, whole days in DuckDB) becomes days. A decimal
    of a smaller scale than DuckDB's was rounded on the way: that is an error."""
    if result.num_columns != len(schema):
        raise ValueError(f"Polars gave {result.num_columns} columns, DuckDB {len(schema)}")
    columns = []
    for column, field in zip(result.columns, schema, strict=True):
        if _is_decimal(column.type) and _is_decimal(field.type):
            if column.type.scale < field.type.scale:  # Polars rounded what DuckDB keeps
                raise ValueError(
                    f"{field.name}: Polars gave {column.type}, DuckDB {field.type} (rounded)"
                )
        if column.type != field.type:
            column = _days(column) if _is_time_span(column.type) else column
            column = column.cast(field.type)
        columns.append(column)
    return pa.Table.from_arrays(columns, schema=schema)


def _is_decimal(kind: pa.DataType) -> bool:
    return bool(pa.types.is_decimal(kind))


def _is_time_span(kind: pa.DataType) -> bool:
    return pa.types.is_duration(kind) or pa.types.is_interval(kind)


def _days(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """Whole days of a duration or month-day-nano column (date minus date in DuckDB)."""
    if pa.types.is_duration(column.type):
        per_day = {"s": 86_400, "ms": 86_400_000, "us": 86_400_000_000}.get(
            column.type.unit, 86_400_000_000_000
        )
        return pc.divide(column.cast(pa.int64()), per_day)
    days = [
        None if v is None else v.months * 30 + v.days + v.nanoseconds // 86_400_000_000_000
        for v in column.to_pylist()
    ]
    return pa.chunked_array([pa.array(days, pa.int64())])


def _first(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__
