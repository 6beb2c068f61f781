"""An in-process stand-in for the worker fleet: shards as Arrow tables in one process.

It runs the real planner and executor over really partitioned data with DuckDB, so planning
can be checked against the oracle in milliseconds; the cluster tests run the same plans on
Ray workers.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Mapping
from typing import Any

import duckdb
import pyarrow as pa

from shardflow.catalog import Catalog, TableSpec
from shardflow.catalog.model import Unit
from shardflow.catalog.types import storage_schema
from shardflow.control.placement import place_units
from shardflow.engine import DuckDBEngine, distinct_names, query_error
from shardflow.runtime.protocol import FragmentStats
from shardflow.runtime.query.executor import FragmentResult, Materialized, Output, concat
from shardflow.runtime.query.planning import Binder, PlannedQuery, answer, plan_query
from shardflow.sql import Stage
from shardflow.storage.partition import split_by_unit


@functools.cache
def _binder() -> Binder:
    return Binder(DuckDBEngine(threads=1))


class InMemoryCluster:
    def __init__(self, nodes: int = 3, units_per_node: int = 2, engine: Any = None) -> None:
        self.nodes = [f"node-{i}" for i in range(nodes)]
        self.catalog = Catalog(nodes=tuple(self.nodes))
        self.units_per_node = units_per_node
        self.shards: dict[tuple[str, int], pa.Table] = {}
        self.replicated: dict[str, pa.Table] = {}
        self.engine = engine or DuckDBEngine(threads=1)
        """Runs the fragments (DuckDB, or another engine under test)."""

    def create_table(
        self,
        name: str,
        data: pa.Table,
        distributed_by: str | None = None,
        colocate_with: str | None = None,
        replicated: bool = False,
    ) -> None:
        uid = uuid.uuid4().hex
        data = data.cast(storage_schema(data.schema))
        if replicated:
            spec = TableSpec(name, uid, data.schema, "replicated", rows=data.num_rows)
            self.catalog = self.catalog.with_table(spec)
            self.replicated[name] = data
            return
        if colocate_with is not None:
            group = self.catalog.table(colocate_with).group
        else:
            owners = place_units(
                self.units_per_node * len(self.nodes), {n: 1.0 for n in self.nodes}
            )
            key_type = data.schema.field(distributed_by).type if distributed_by else pa.int64()
            self.catalog, group = self.catalog.with_new_group(key_type, owners)
        spec = TableSpec(
            name, uid, data.schema, "distributed", distributed_by or "", group, data.num_rows
        )
        self.catalog = self.catalog.with_table(spec)
        for unit in self.catalog.group_of(name).units:
            self.shards[(name, unit.unit_id)] = data.schema.empty_table()
        for unit_id, part in split_by_unit(data, spec, self.catalog).items():
            self.shards[(name, unit_id)] = part

    def sql(self, query: str, client: Any = None) -> pa.Table:
        """The answer as ``Database.sql`` gives it: planned (or gathered whole where the
        session would), run over the shards, named and typed as DuckDB binds the query."""
        return self.run_planned(query, plan_query(query, self.catalog, _binder()), client)

    def run_planned(self, query: str, planned: PlannedQuery, client: Any = None) -> pa.Table:
        """The answer of ``query`` by ``planned`` (a plan made or kept elsewhere)."""
        result, _, _ = answer(query, planned, self.catalog, self, client or self.engine)
        return result

    def _tables_on(
        self, node: str, names: tuple[str, ...], running: list[Unit] | None = None
    ) -> dict[str, pa.Table]:
        chosen = {u.unit_id for u in running} if running is not None else None
        tables = dict(self.replicated)
        for name in names:
            units = [
                u.unit_id
                for u in self.catalog.group_of(name).units
                if u.node == node and (chosen is None or u.unit_id in chosen)
            ]
            tables[name] = concat([self.shards[(name, u)] for u in units])
        return tables

    def scatter(
        self, stage: Stage, inputs: Mapping[str, Output], final: bool = False
    ) -> list[FragmentResult]:
        assert stage.group is not None
        group = self.catalog.groups[stage.group]
        given = {name: value.table() for name, value in inputs.items()}
        units = stage.units_to_run(group)
        return [
            self._run(node, stage.sql, {**self._tables_on(node, stage.tables, units), **given})
            for node in sorted({u.node for u in units})
        ]

    def run_on_worker(self, sql: str, inputs: Mapping[str, Output]) -> FragmentResult:
        given = {name: value.table() for name, value in inputs.items()}
        return self._run(self.nodes[0], sql, {**self.replicated, **given})

    def _run(self, node: str, sql: str, tables: dict[str, pa.Table]) -> FragmentResult:
        started_at = time.time()
        started = time.perf_counter()
        try:  # as a worker does: DuckDB's refusals typed, repeated names told apart
            table = distinct_names(self.engine.run(sql, tables))
        except duckdb.Error as error:
            raise query_error(error) from None
        elapsed = time.perf_counter() - started
        stats = FragmentStats(
            seconds=elapsed,
            rows_out=table.num_rows,
            started_at=started_at,
            finished_at=started_at + elapsed,
            rows_in=sum(t.num_rows for t in tables.values()),
            bytes_in=sum(t.nbytes for t in tables.values()),
            bytes_out=table.nbytes,
            engine="duckdb",
            device="in-process",
        )
        return FragmentResult(Materialized(table), node, elapsed, table.num_rows, stats, started_at)
