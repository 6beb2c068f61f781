"""The worker: a threaded Ray actor that is one logical node. It holds its shards in memory
as Arrow, makes inserts durable, and runs SQL fragments over its shards with its engine.

A worker that is restarted (its process killed) rebuilds every shard the catalog assigns to
it from durable storage before it serves again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import duckdb
import pyarrow as pa

from shardflow.catalog import Catalog, DataDir, TableSpec
from shardflow.config import Settings
from shardflow.engine import DuckDBEngine
from shardflow.engine.duckdb_engine import NativeRows, quote
from shardflow.errors import Moved, QueryError
from shardflow.storage import CheckpointPolicy, Shard, ShardStore
from shardflow.telemetry.devices import probe

log = logging.getLogger(__name__)

REPLICA = "replica"


def owned(table: pa.Table) -> pa.Table:
    """A copy in this process's memory: data arriving through Ray points into the shared
    object store, which must not stay pinned for as long as a shard lives."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return pa.ipc.open_stream(sink.getvalue()).read_all()


class WorkerNode:
    """A worker's logic, independent of Ray (the actor class below wraps it)."""

    def __init__(
        self,
        node_id: str,
        data_dir: str,
        settings: Settings,
        catalog: Mapping[str, Any] | None = None,
    ) -> None:
        self.node_id = node_id
        self.data_dir = DataDir.resolve(data_dir)
        self.settings = settings
        self.profile = probe(node_id)
        self.engine = DuckDBEngine(threads=settings.engine_threads or None)
        self.policy = CheckpointPolicy(
            settings.wal_checkpoint_entries or 1 << 62, settings.wal_checkpoint_bytes or 1 << 62
        )
        self.shards: dict[tuple[str, int], Shard] = {}
        self.replicas: dict[str, Shard] = {}
        self.loading: dict[str, dict[int | str, Shard]] = {}
        self.catalog = Catalog()
        self._lock = threading.RLock()
        self._running = 0
        self._busy_seconds = 0.0
        self._started = time.monotonic()
        if catalog is not None:
            self.sync(catalog)

    # -- catalog ------------------------------------------------------------------------
    def sync(self, catalog_json: Mapping[str, Any]) -> int:
        """Serve what ``catalog_json`` assigns to this node: load missing shards, drop others."""
        catalog = Catalog.from_json(catalog_json)
        with self._lock:
            if catalog.version < self.catalog.version:
                return self.catalog.version
            changed: set[str] = set()
            wanted = {(r.table, r.unit_id) for r in catalog.shards_on(self.node_id)}
            for key in list(self.shards):
                uid = self._uid(catalog, key[0])
                if key not in wanted or uid != self.shards[key].store.table_uid:
                    self._release(self.shards.pop(key))
                    changed.add(key[0])
            for name in list(self.replicas):
                spec = catalog.tables.get(name)
                if spec is None or spec.uid != self.replicas[name].store.table_uid:
                    self._release(self.replicas.pop(name))
                    changed.add(name)
            for table, unit_id in sorted(wanted - set(self.shards)):
                spec = catalog.table(table)
                shard = self._new_shard(spec, str(unit_id), writer=True)
                shard.recover()
                self.shards[(table, unit_id)] = shard
                changed.add(table)
            for spec in catalog.replicated_tables():
                if spec.name not in self.replicas:
                    shard = self._new_shard(spec, REPLICA, writer=self._is_primary(catalog))
                    shard.recover()
                    self.replicas[spec.name] = shard
                    changed.add(spec.name)
            for shard in self.replicas.values():
                shard.writer = self._is_primary(catalog)
            for table in changed:
                self._refresh_view(table)
            self.catalog = catalog
            return catalog.version

    def _refresh_view(self, table: str) -> None:
        """The view named ``table`` reads exactly the shards this node serves of it."""
        if table in self.replicas:
            physicals = [self._physical(self.replicas[table])]
        else:
            units = sorted(u for t, u in self.shards if t == table)
            physicals = [self._physical(self.shards[(table, u)]) for u in units]
        self.engine.set_view(table, physicals)

    @staticmethod
    def _physical(shard: Shard) -> str:
        assert isinstance(shard.data, NativeRows)
        return shard.data.physical

    @staticmethod
    def _release(shard: Shard) -> None:
        if isinstance(shard.data, NativeRows):
            shard.data.drop()

    def _uid(self, catalog: Catalog, table: str) -> str | None:
        spec = catalog.tables.get(table)
        return spec.uid if spec is not None else None

    def _is_primary(self, catalog: Catalog) -> bool:
        """The node that writes the log of replicated tables (the first live node)."""
        return bool(catalog.nodes) and sorted(catalog.nodes)[0] == self.node_id

    def _new_shard(self, spec: TableSpec, name: str, *, writer: bool) -> Shard:
        store = ShardStore(self.data_dir, spec.uid, name)
        physical = f"t_{spec.uid[:12]}_{name}"
        rows = self.engine.native_rows(physical, spec.schema)
        return Shard(store, spec.schema, rows=rows, writer=writer, policy=self.policy)

    # -- loading a new table ------------------------------------------------------------
    def prepare(self, spec_json: Mapping[str, Any], unit_ids: list[int], primary: bool) -> None:
        spec = TableSpec.from_json(spec_json)
        with self._lock:
            if spec.kind == "replicated":
                shards: dict[int | str, Shard] = {
                    REPLICA: self._new_shard(spec, REPLICA, writer=primary)
                }
            else:
                shards = {u: self._new_shard(spec, str(u), writer=True) for u in unit_ids}
            self.loading[spec.name] = shards

    def stage(self, table: str, parts: Mapping[int | str, pa.Table]) -> int:
        shards = self.loading[table]
        rows = 0
        for unit, part in parts.items():
            shards[unit].stage(owned(part))
            rows += part.num_rows
        return rows

    def commit_load(self, table: str) -> int:
        shards = self.loading[table]
        return sum(shard.commit_load() for shard in shards.values())

    def finish_load(self, table: str, catalog_json: Mapping[str, Any]) -> None:
        """Make a committed load visible: the staged shards become served shards."""
        with self._lock:
            shards = self.loading.pop(table, {})
            for unit, shard in shards.items():
                if unit == REPLICA:
                    self.replicas[table] = shard
                else:
                    assert isinstance(unit, int)
                    self.shards[(table, unit)] = shard
            self._refresh_view(table)
        self.sync(catalog_json)

    def abort_load(self, table: str) -> None:
        with self._lock:
            shards = self.loading.pop(table, {})
        for shard in shards.values():
            self._release(shard)
            if shard.writer:
                shard.store.destroy()

    # -- writes -------------------------------------------------------------------------
    def append(
        self, table: str, parts: Mapping[int, pa.Table], batch_id: str, epoch: int
    ) -> dict[int, int]:
        """Append each part to its shard (durably); returns the new LSN per unit."""
        lsns = {}
        for unit, part in parts.items():
            shard = self.shards.get((table, unit))
            if shard is None:
                raise Moved(f"{table}#{unit}", epoch)
            lsns[unit] = shard.append(owned(part), batch_id).lsn
        return lsns

    def append_replica(self, table: str, part: pa.Table, batch_id: str) -> int:
        shard = self.replicas.get(table)
        if shard is None:
            raise Moved(f"{table} (replica)", self.catalog.epoch)
        return shard.append(owned(part), batch_id).lsn

    def drop(self, table: str) -> None:
        with self._lock:
            for key in [k for k in self.shards if k[0] == table]:
                self._release(self.shards.pop(key))
            if table in self.replicas:
                self._release(self.replicas.pop(table))
            self._refresh_view(table)

    # -- queries ------------------------------------------------------------------------
    def views_for(self, bindings: Mapping[str, list[int]], epoch: int) -> dict[str, str]:
        """Per-call views for tables bound to fewer shards than this node serves (a retry
        after a move); tables bound to all of them read their standing view."""
        views = {}
        with self._lock:
            for table, units in bindings.items():
                for unit in units:
                    if (table, unit) not in self.shards:
                        raise Moved(f"{table}#{unit}", epoch)
                served = {u for t, u in self.shards if t == table}
                if set(units) != served:
                    views[table] = " UNION ALL ".join(
                        f"SELECT * FROM {quote(self._physical(self.shards[(table, u)]))}"
                        for u in sorted(units)
                    )
        return views

    def execute(
        self,
        sql: str,
        bindings: Mapping[str, list[int]],
        epoch: int,
        inputs: Mapping[str, pa.Table],
    ) -> tuple[pa.Table, float]:
        """Run a fragment over this node's shards; returns the result and execution seconds."""
        views = self.views_for(bindings, epoch)
        started = time.perf_counter()
        with self._lock:
            self._running += 1
        try:
            result = self.engine.run(sql, inputs, views)
        except duckdb.Error as error:
            raise QueryError(str(error).strip()) from None
        finally:
            elapsed = time.perf_counter() - started
            with self._lock:
                self._running -= 1
                self._busy_seconds += elapsed
        return result, elapsed

    # -- reporting ----------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        with self._lock:
            shards = [
                {"table": t, "unit": u, "rows": s.rows, "bytes": s.nbytes, "lsn": s.lsn}
                for (t, u), s in sorted(self.shards.items())
            ]
            replicas = [
                {"table": t, "rows": s.rows, "bytes": s.nbytes, "lsn": s.lsn}
                for t, s in sorted(self.replicas.items())
            ]
            uptime = time.monotonic() - self._started
            return {
                "profile": asdict(self.profile),
                "shards": shards,
                "replicas": replicas,
                "queries_running": self._running,
                "busy_seconds": self._busy_seconds,
                "uptime_seconds": uptime,
                "catalog_version": self.catalog.version,
            }
