"""A whole cluster in this process, without Ray: the coordinator's state and controller (with
its migrator and Prometheus counters) over real in-process workers (``runtime/inprocess.py``:
real DuckDB, real files in a temporary data directory). Tables are loaded and rows inserted
through the worker protocol as the session does; queries run the real planner and executor.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from shardflow.catalog import Catalog
from shardflow.config import Settings
from shardflow.engine import DuckDBEngine
from shardflow.runtime.controller import Controller
from shardflow.runtime.coordinator import CoordinatorState
from shardflow.runtime.executor import execute
from shardflow.runtime.inprocess import LocalRunner, LocalWorkers
from shardflow.runtime.session import retrying
from shardflow.sql import plan
from shardflow.storage.partition import buckets_for, route, split_by_unit
from shardflow.telemetry.metrics import registry_for


class LocalCluster:
    def __init__(self, data_dir: Path, nodes: int = 3, **settings: Any) -> None:
        self.data_dir = str(data_dir)
        self.settings = Settings(auto_balance=False, retry_deadline_s=30, **settings)
        self.state = CoordinatorState(self.data_dir, self.settings)
        self.state.register_nodes([f"node-{i}" for i in range(nodes)])
        self.workers = LocalWorkers(self.data_dir, self.settings, self.state.report_profile)
        for node in self.state.catalog.nodes:
            self.workers.start(node, self.state.catalog_json())
        self.controller = Controller(self.state, self.workers, self.settings)
        self.registry, self.controller.recorder = registry_for(self.controller.gauges)
        self.engine = DuckDBEngine(threads=1)

    @property
    def catalog(self) -> Catalog:
        return self.state.catalog

    def restart(self, node: str, **settings: Any) -> None:
        """Stop ``node``'s worker and start a new one (with these settings changed), which
        rebuilds what the catalog assigns it from the data directory."""
        self.workers.stop(node)
        self.workers.start(node, self.state.catalog_json(), self.settings.replace(**settings))

    def close(self) -> None:
        self.controller.stop()
        self.workers.close()
        self.engine.close()

    # -- tables -----------------------------------------------------------------------------
    def create_table(
        self, name: str, data: pa.Table, key: str, colocate_with: str | None = None
    ) -> None:
        schema = data.schema.serialize().to_pybytes()
        preview = Catalog.from_json(
            self.state.begin_create(name, schema, "distributed", key, colocate_with)
        )
        spec = preview.table(name)
        assert spec.group is not None
        units: dict[str, list[int]] = defaultdict(list)
        for unit in preview.groups[spec.group].units:
            units[unit.node].append(unit.unit_id)
        for node, ids in units.items():
            self.workers.get(node).prepare(spec, ids, False).get()
        parts: dict[str, dict[int | str, pa.Table]] = defaultdict(dict)
        for unit_id, rows in split_by_unit(data, spec, preview).items():
            parts[preview.groups[spec.group].unit(unit_id).node][unit_id] = rows
        for node, staged in parts.items():
            self.workers.get(node).stage(name, staged).get()
        rows = sum(self.workers.get(node).commit_load(name).get() for node in units)
        catalog = self.state.commit_create(name, rows)
        for node in preview.nodes:
            self.workers.get(node).finish_load(name, catalog).get()

    def insert(self, name: str, data: pa.Table) -> None:
        """Route the rows to their units' owners as the session does; a batch refused by a
        moved or fenced shard is sent again with fresh routing (rows it already placed land
        once: the batch id is the same)."""
        spec = self.catalog.table(name)
        batch_id = uuid.uuid4().hex
        buckets = buckets_for(data, spec, self.catalog.n_buckets, int(batch_id[:8], 16))

        def attempt() -> None:
            catalog = self.catalog
            group = catalog.group_of(name)
            by_node: dict[str, dict[int, tuple[pa.Table, np.ndarray]]] = defaultdict(dict)
            for unit_id, part in route(data, buckets, catalog, group.group_id).items():
                by_node[group.unit(unit_id).node][unit_id] = part
            for node, parts in by_node.items():
                self.workers.get(node).append(name, parts, batch_id, catalog.epoch).get()

        retrying(f"insert into {name}", attempt, self.settings.retry_deadline_s)

    def sql(self, query: str) -> pa.Table:
        catalog = self.catalog
        result, _ = execute(plan(query, catalog), LocalRunner(self.workers, catalog), self.engine)
        return result

    # -- live moves ---------------------------------------------------------------------------
    def units(self, table: str) -> Sequence[Any]:
        return self.catalog.group_of(table).units

    def migrate(self, unit_id: int, to: str) -> dict[str, Any]:
        return self.controller.run_move(self.state.plan_move(unit_id, to))

    def split(self, unit_id: int) -> dict[str, Any]:
        return self.controller.run_move(self.state.plan_split(unit_id))

    def merge(self, first: int, second: int) -> dict[str, Any]:
        return self.controller.run_move(self.state.plan_merge(first, second))

    def moves_counted(self, kind: str, outcome: str) -> float:
        """``shardflow_migrations_total{kind, outcome}`` as Prometheus would scrape it."""
        value = self.registry.get_sample_value(
            "shardflow_migrations_total", {"kind": kind, "outcome": outcome}
        )
        return value or 0.0
