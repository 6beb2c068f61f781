"""A whole cluster in this process, without Ray: ``inprocess.LocalBackend`` (the coordinator's
state, controller, migrator and Prometheus counters over real in-process workers: real
DuckDB, real files in a temporary data directory) driven through a real ``Session``, as a
database drives a cluster on Ray. Only wiring lives here."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
from prometheus_client import CollectorRegistry

from shardflow.catalog import Catalog
from shardflow.config import Settings
from shardflow.runtime.client.session import Session
from shardflow.runtime.coordinator.controller import Controller
from shardflow.runtime.coordinator.state import CoordinatorState
from shardflow.runtime.inprocess import LocalBackend


class LocalCluster:
    def __init__(self, data_dir: Path, nodes: int = 3, **settings: Any) -> None:
        # tables of a few rows still get a unit per worker (tests move them)
        settings.setdefault("initial_shard_bytes", 0)
        settings.setdefault("retry_deadline_s", 30)
        self.settings = Settings(auto_balance=False, **settings)
        self.data_dir = str(data_dir)
        self.backend = LocalBackend(self.data_dir, self.settings, nodes)
        self.session = Session(self.backend)
        self.workers = self.backend.local_workers

    @property
    def state(self) -> CoordinatorState:
        return self.backend.node.state

    @property
    def controller(self) -> Controller:
        return self.backend.node.controller

    @property
    def registry(self) -> CollectorRegistry:
        return self.backend.node.registry

    @property
    def catalog(self) -> Catalog:
        return self.state.catalog

    def restart(self, node: str, **settings: Any) -> None:
        """Stop ``node``'s worker and start a new one (with these settings changed), which
        rebuilds what the catalog assigns it from the data directory."""
        self.workers.stop(node)
        self.workers.start(node, self.state.catalog_json(), self.settings.replace(**settings))

    def close(self) -> None:
        self.session.close()
        self.backend.close()

    # -- tables, as a database makes them -----------------------------------------------------
    def create_table(
        self, name: str, data: pa.Table, key: str, colocate_with: str | None = None
    ) -> None:
        self.session.create_table(name, data, key, False, colocate_with)

    def insert(self, name: str, data: pa.Table, batch_id: str | None = None) -> None:
        self.session.insert(name, data, batch_id)

    def sql(self, query: str) -> pa.Table:
        return self.session.query(query)[0]

    # -- live moves ---------------------------------------------------------------------------
    def units(self, table: str) -> Sequence[Any]:
        return self.catalog.group_of(table).units

    def migrate(self, unit_id: int, to: str) -> dict[str, Any]:
        return self.session.migrate(unit_id, to)

    def split(self, unit_id: int) -> dict[str, Any]:
        return self.session.split(unit_id)

    def merge(self, first: int, second: int) -> dict[str, Any]:
        return self.session.merge(first, second)

    def moves_counted(self, kind: str, outcome: str) -> float:
        """``shardflow_migrations_total{kind, outcome}`` as Prometheus would scrape it."""
        value = self.registry.get_sample_value(
            "shardflow_migrations_total", {"kind": kind, "outcome": outcome}
        )
        return value or 0.0


# -- sample tables, and what the cluster must serve of them --------------------------------
ROWS = 20_000
CHECK = (
    "SELECT count(*) AS n, sum(id) AS ids, sum(length(pad)) AS pads, "
    "sum(hash(id, pad) % 1000003) AS h FROM events"
)


def events(start: int, count: int) -> pa.Table:
    ids = pa.array(range(start, start + count), pa.int64())
    return pa.table({"id": ids, "pad": pa.array([f"row-{i}" for i in range(start, start + count)])})


def orders(start: int, count: int) -> pa.Table:
    ids = pa.array(range(start, start + count), pa.int64())
    return pa.table({"oid": ids, "amount": pa.array([i * 2 for i in range(start, start + count)])})


def expected(rows: pa.Table) -> list[dict[str, object]]:
    """What DuckDB answers over the same rows, in one table."""
    con = duckdb.connect()
    con.register("events", rows)
    try:
        return con.sql(CHECK).to_arrow_table().to_pylist()
    finally:
        con.close()


def assert_serves(cluster: LocalCluster, rows: pa.Table) -> None:
    assert cluster.sql(CHECK).to_pylist() == expected(rows)
