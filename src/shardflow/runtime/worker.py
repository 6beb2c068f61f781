"""The worker: one logical node. It holds its shards (native DuckDB tables behind a view
per table), makes inserts durable, runs SQL fragments over its shards, and takes part in live
moves: as a source it exports a pinned snapshot and the changes since, fences writes and
retires what moved; as a target it builds the new shards in folders of their own and
promotes them at the switch.

A worker that starts rebuilds every shard the catalog assigns to it from durable storage.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa

from shardflow.catalog import Catalog, DataDir, OwnerToken, TableSpec
from shardflow.config import Settings
from shardflow.control.migration import MovePlan
from shardflow.engine import DuckDBEngine, Engine
from shardflow.engine.duckdb_engine import NativeRows, quote
from shardflow.engine.polars_engine import PolarsEngine
from shardflow.engine.simulated import SlowedEngine
from shardflow.errors import Moved, QueryError
from shardflow.storage import CheckpointPolicy, Shard, ShardStore
from shardflow.storage.partition import buckets_for
from shardflow.storage.shard import Change
from shardflow.storage.shard_store import Applied
from shardflow.telemetry.calibration import calibrate, capacity, operator_mix
from shardflow.telemetry.devices import (
    GPU_ENGINE,
    DeviceInfo,
    NodeProfile,
    choose_engine,
    cuda_index,
    device_state,
    discover,
    installed,
    memory_state,
)

log = logging.getLogger(__name__)

REPLICA = "replica"
CHUNK_ROWS = 128 * 1024
"""Rows per chunk of a move's snapshot: the unit of transfer and of bandwidth pacing."""
ShardKey = tuple[str, int]


Sums = dict[str, list[int]]
"""Per table: [rows, sum of row hashes] of what a move has copied so far."""


def add_sum(sums: Sums, table: str, rows_and_hash: tuple[int, int]) -> None:
    total = sums.setdefault(table, [0, 0])
    total[0] += rows_and_hash[0]
    total[1] += rows_and_hash[1]


@dataclass
class Export:
    """This node as the source of a move: the shards it exports, pinned at a snapshot, and
    the checksum of everything it has handed out (snapshot and changes since)."""

    plan: MovePlan
    shards: dict[ShardKey, Shard]
    sums: Sums = field(default_factory=dict)
    counted: dict[ShardKey, int] = field(default_factory=dict)
    streams: dict[ShardKey, Any] = field(default_factory=dict)
    """The pinned snapshot of each shard, handed out a batch at a time."""


@dataclass
class Import:
    """This node as a target of a move: new shards built beside the served ones."""

    plan: MovePlan
    units: list[tuple[int, int, int]]
    """(unit_id, lo, hi) of the targets on this node."""
    shards: dict[ShardKey, Shard]
    applied: dict[ShardKey, int] = field(default_factory=dict)
    """Per source shard, the LSN applied so far."""
    sums: Sums = field(default_factory=dict)
    """Checksum of what the new shards hold: the stored snapshot plus every change applied."""
    promoted: bool = False

    @property
    def shares_files(self) -> bool:
        """A plain move keeps the unit's id and files: the source logged every insert the
        copy replays, so the copy writes nothing until it takes over at the switch."""
        return self.plan.kind == "move"


def make_executor(
    engine: DuckDBEngine, device: DeviceInfo, slowdown: float, choice: str = "auto"
) -> Engine:
    """The engine that runs this node's fragments: ``choice`` ("auto" follows the device,
    see ``choose_engine``), slowed down for a simulated device."""
    has = {"polars": installed("polars"), "cudf_polars": installed("cudf_polars")}
    picked, _ = choose_engine(device, has)
    executor: Engine = engine
    if choice == "polars" or (choice == "auto" and picked == GPU_ENGINE):
        gpu = device.vendor == "nvidia" and has["cudf_polars"]
        executor = PolarsEngine(engine, gpu=gpu, device=cuda_index(device.index or 0))
    if slowdown > 1:
        return SlowedEngine(executor, slowdown)
    return executor


def node_profile(
    node_id: str,
    device: DeviceInfo,
    executor: Engine,
    throughput: Mapping[str, float],
    slowdown: float,
) -> NodeProfile:
    _, note = choose_engine(
        device, {"polars": installed("polars"), "cudf_polars": installed("cudf_polars")}
    )
    model = device.model if slowdown <= 1 else f"simulated x{slowdown:g} slower {device.model}"
    return NodeProfile(
        node_id=node_id,
        vendor=device.vendor,
        model=model,
        memory_bytes=device.memory_bytes,
        cores=os.cpu_count() or 1,
        engine=executor.name,
        capacity=round(capacity(throughput), 3) if throughput else 1.0,
        simulated=slowdown > 1,
        engine_note=note,
        calibration=dict(throughput),
    )


@functools.lru_cache(maxsize=1024)
def _operators(sql: str) -> tuple[str, ...]:
    return operator_mix(sql)


class WorkerNode:
    """A worker's logic, independent of Ray (the actor class below wraps it)."""

    def __init__(
        self,
        node_id: str,
        data_dir: str,
        settings: Settings,
        catalog: Mapping[str, Any] | None = None,
        *,
        slowdown: float = 1.0,
        gpu_index: int | None = None,
        owner: OwnerToken | None = None,
    ) -> None:
        self.node_id = node_id
        self.data_dir = DataDir.resolve(data_dir, owner)
        """Writes only while ``owner`` owns the data directory (None: unchecked, in tests)."""
        self.settings = settings
        self.device = discover(gpu_index)
        self.engine = DuckDBEngine(threads=settings.engine_threads or None)
        """Holds the shards (native tables) and runs fragments on the CPU."""
        self.executor = make_executor(self.engine, self.device, slowdown, settings.engine)
        """Runs fragments: the CPU engine, the GPU engine, or a simulated slower device."""
        self.slowdown = slowdown
        self.profile = node_profile(node_id, self.device, self.executor, {}, slowdown)
        self.policy = CheckpointPolicy(
            settings.wal_checkpoint_entries or 1 << 62, settings.wal_checkpoint_bytes or 1 << 62
        )
        self.shards: dict[tuple[str, int], Shard] = {}
        self.replicas: dict[str, Shard] = {}
        self.loading: dict[str, dict[int | str, Shard]] = {}
        self.exports: dict[str, Export] = {}
        self.imports: dict[str, Import] = {}
        self.retired: dict[str, dict[ShardKey, Shard]] = {}
        self._retired_plans: dict[str, str] = {}
        self._readers: Counter[ShardKey] = Counter()
        self._unit_seconds: dict[int, Counter[str]] = defaultdict(Counter)
        """Execution seconds per unit, by calibrated operator (the unit's operator mix)."""
        self._shard_seconds: Counter[ShardKey] = Counter()
        self._op_seconds: Counter[str] = Counter()
        """Execution seconds by calibrated operator (the load's operator mix)."""
        self.catalog = Catalog()
        self._lock = threading.RLock()
        self._running = 0
        self._busy_seconds = 0.0
        self._started = time.monotonic()
        if catalog is not None:
            self.sync(catalog)

    def calibrate(self) -> NodeProfile:
        """Measure this node's device with its own engine (a second or so); the capacity
        weighs how much work placement and the balancer give it."""
        throughput = calibrate(self.executor.run)
        self.profile = node_profile(
            self.node_id, self.device, self.executor, throughput, self.slowdown
        )
        return self.profile

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
                if self._importing(table, unit_id):
                    continue  # built by a move in progress, served once it switches
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

    def _importing(self, table: str, unit_id: int) -> bool:
        return any((table, unit_id) in move.shards for move in self.imports.values())

    def _uid(self, catalog: Catalog, table: str) -> str | None:
        spec = catalog.tables.get(table)
        return spec.uid if spec is not None else None

    def _is_primary(self, catalog: Catalog) -> bool:
        """The node that writes the log of replicated tables (the first live node)."""
        return catalog.primary == self.node_id

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
            shards[unit].stage(part)
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
            shard.abandon_load()
            self._release(shard)
            if shard.writer:
                shard.store.destroy()

    # -- writes -------------------------------------------------------------------------
    def append(
        self,
        table: str,
        parts: Mapping[int, tuple[pa.Table, np.ndarray]],
        batch_id: str,
        epoch: int,
    ) -> dict[int, int]:
        """Append each part (rows and their buckets) to its shard, durably; returns the new
        LSN per unit."""
        lsns = {}
        for unit, (part, buckets) in parts.items():
            shard = self.shards.get((table, unit))
            if shard is None:
                raise Moved(f"{table}#{unit}", epoch)
            lsns[unit] = shard.append(part, batch_id, np.asarray(buckets)).lsn
        return lsns

    def append_replica(self, table: str, part: pa.Table, batch_id: str) -> int:
        shard = self.replicas.get(table)
        if shard is None:
            raise Moved(f"{table} (replica)", self.catalog.epoch)
        return shard.append(part, batch_id).lsn

    def drop(self, table: str) -> None:
        with self._lock:
            for key in [k for k in self.shards if k[0] == table]:
                self._release(self.shards.pop(key))
            if table in self.replicas:
                self._release(self.replicas.pop(table))
            self._refresh_view(table)

    # -- queries ------------------------------------------------------------------------
    def views_for(self, bindings: Mapping[str, list[int]], epoch: int) -> dict[str, str]:
        """Per-call views naming exactly the shards a fragment was bound to. (The standing
        view of a table may change under a running fragment when a move switches; these
        cannot, and the shards they name are kept until the fragment's reads are done.)"""
        views = {}
        with self._lock:
            for table, units in bindings.items():
                for unit in units:
                    if (table, unit) not in self.shards:
                        raise Moved(f"{table}#{unit}", epoch)
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
        profile: bool = True,
    ) -> tuple[pa.Table, dict[str, Any]]:
        """Run a fragment over this node's shards; returns the result and what was measured
        (with ``profile``: wall-clock start and end, rows and bytes in and out, engine and
        device as well as the time)."""
        started_at = time.time()
        started = time.perf_counter()
        rows_in = bytes_in = 0
        with self._lock:
            views = self.views_for(bindings, epoch)
            reading = [(t, u) for t, units in bindings.items() for u in units]
            self._readers.update(reading)
            self._running += 1
            if profile:
                rows_in = sum(self.shards[key].rows for key in reading)
                bytes_in = sum(self.shards[key].nbytes for key in reading)
        if profile:
            rows_in += sum(t.num_rows for t in inputs.values())
            bytes_in += sum(t.nbytes for t in inputs.values())
        try:
            result = self.executor.run(sql, inputs, views)
        except duckdb.Error as error:
            raise QueryError(str(error).strip()) from None
        finally:
            elapsed = time.perf_counter() - started
            with self._lock:
                self._readers.subtract(reading)
                self._running -= 1
                self._busy_seconds += elapsed
                units = {u for _, u in reading}
                operators = _operators(sql)
                for operator in operators:
                    self._op_seconds[operator] += elapsed / len(operators)
                    for unit in units:  # a fragment's load is shared by the units it read
                        self._unit_seconds[unit][operator] += elapsed / len(units) / len(operators)
                for key in reading:
                    self._shard_seconds[key] += elapsed / len(reading)
        if not profile:
            return result, {"seconds": elapsed, "rows_out": result.num_rows}
        fell_back = getattr(self.executor, "fell_back", "")
        engine = (
            f"{self.profile.engine} (fell back to {fell_back})"
            if fell_back
            else (self.profile.engine)
        )
        return result, {
            "seconds": elapsed,
            "started_at": started_at,
            "finished_at": started_at + elapsed,
            "rows_in": rows_in,
            "bytes_in": bytes_in,
            "rows_out": result.num_rows,
            "bytes_out": result.nbytes,
            "engine": engine,
            "device": f"{self.profile.vendor} {self.profile.model}",
        }

    # -- moves: source side ---------------------------------------------------------------
    def export_begin(self, plan: MovePlan) -> dict[ShardKey, tuple[int, Applied]]:
        """Pin a snapshot of every shard of the source units on this node; returns, per
        shard, its LSN and the insert batches it holds. Its rows follow through
        :meth:`export_chunk`."""
        units = {s.unit_id for s in plan.sources if s.node == self.node_id}
        with self._lock:
            shards = {k: v for k, v in self.shards.items() if k[1] in units}
            missing = {u for u in units if not any(k[1] == u for k in shards)}
            if missing:
                raise Moved(f"units {sorted(missing)}", self.catalog.epoch)
            export = self.exports[plan.move_id] = Export(plan, shards)
        pinned = {}
        for key, shard in shards.items():
            lsn, applied, stream = shard.begin_streaming_export(CHUNK_ROWS)
            export.streams[key] = stream
            export.counted[key] = lsn
            pinned[key] = (lsn, applied)
        return pinned

    def export_chunk(self, move_id: str, key: ShardKey) -> pa.Table | None:
        """The next batch of a shard's pinned snapshot (None once all were handed out),
        added to the running checksum as it leaves."""
        export = self.exports[move_id]
        chunk = export.streams[key].next()
        if chunk is not None:
            rows_and_hash = self.engine.checksum_rows(chunk)
            with self._lock:
                add_sum(export.sums, key[0], rows_and_hash)
        return chunk

    def export_changes(
        self, move_id: str, since: Mapping[ShardKey, int]
    ) -> dict[ShardKey, list[Change]]:
        export = self.exports[move_id]
        changes = {
            key: shard.changes_since(since.get(key, 0)) for key, shard in export.shards.items()
        }
        for key, found in changes.items():
            for change in found:
                if change.lsn > export.counted.get(key, 0):
                    rows_and_hash = self.engine.checksum_rows(change.rows)
                    with self._lock:
                        add_sum(export.sums, key[0], rows_and_hash)
                    export.counted[key] = change.lsn
        return changes

    def export_sums(self, move_id: str) -> dict[str, list[int]]:
        """Per table: [rows, hash sum] handed out, and the rows the shards hold now (under
        the fence, equal to the rows handed out unless a change escaped the tap)."""
        export = self.exports[move_id]
        held: Counter[str] = Counter()
        for (table, _), shard in export.shards.items():
            held[table] += shard.rows
        return {t: [*sums, held[t]] for t, sums in export.sums.items()}

    def fence(self, move_id: str) -> tuple[dict[ShardKey, list[Change]], dict[str, list[int]]]:
        """Hold new writes to the exported shards and hand out, at once, what is left: the
        changes not yet handed out and the final checksums. One call, so that the fence
        holds writers as briefly as possible."""
        export = self.exports[move_id]
        for shard in export.shards.values():
            shard.fence()
        last = dict(export.counted)
        return self.export_changes(move_id, last), self.export_sums(move_id)

    def abort_export(self, move_id: str) -> None:
        export = self.exports.pop(move_id, None)
        if export is None:
            return
        for stream in export.streams.values():
            stream.close()
        for shard in export.shards.values():
            shard.end_export()
            shard.unfence()

    def retire(self, move_id: str) -> None:
        """The switch happened: stop serving the moved shards (fragments and inserts for
        them are told ``Moved``), keep them until the readers still on them finish."""
        export = self.exports.pop(move_id, None)
        if export is None:
            return
        with self._lock:
            for key, shard in export.shards.items():
                shard.retire()
                if self.shards.get(key) is shard:
                    del self.shards[key]
            self.retired[move_id] = dict(export.shards)
            self._retired_plans[move_id] = export.plan.kind
            for table in {key[0] for key in export.shards}:
                self._refresh_view(table)

    def drop_retired(self, move_id: str, timeout_s: float = 60.0) -> bool:
        """Drop the retired shards and their files once no fragment reads them."""
        shards = self.retired.get(move_id, {})
        deadline = time.monotonic() + timeout_s
        while any(self._readers[key] > 0 for key in shards):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        shares_files = self._retired_plans.pop(move_id, "") == "move"
        for shard in self.retired.pop(move_id, {}).values():
            self._release(shard)
            if not shares_files:  # a moved unit keeps its files: the new owner writes them
                shard.store.destroy()
        return True

    # -- moves: target side ---------------------------------------------------------------
    def import_begin(self, plan: MovePlan) -> None:
        mine = [(t.unit_id, t.lo, t.hi) for t in plan.targets if t.node == self.node_id]
        shards: dict[ShardKey, Shard] = {}
        writes = plan.kind != "move"
        for table in self.catalog.group_tables(plan.group):
            spec = self.catalog.table(table)
            for unit_id, _, _ in mine:
                shards[(table, unit_id)] = self._new_shard(spec, str(unit_id), writer=writes)
        with self._lock:
            self.imports[plan.move_id] = Import(plan, mine, shards)

    def import_rows(self, move_id: str, source: ShardKey, rows: pa.Table) -> int:
        """Stage rows of a source shard's snapshot into the target shards they belong to."""
        move = self.imports[move_id]
        table, _ = source
        staged = 0
        for unit_id, part, _ in self._route(move, source, rows, None):
            move.shards[(table, unit_id)].stage(part)
            rows_and_hash = self.engine.checksum_rows(part)
            with self._lock:
                add_sum(move.sums, table, rows_and_hash)
            staged += part.num_rows
        return staged

    def import_snapshot_done(
        self, move_id: str, source: ShardKey, lsn: int, applied: Applied
    ) -> None:
        move = self.imports[move_id]
        move.applied[source] = lsn
        for (table, _), shard in move.shards.items():
            if table == source[0]:
                shard.adopt(applied)
                if move.shares_files:
                    shard.lsn = lsn  # it continues the source's log

    def import_commit(self, move_id: str) -> int:
        """Write the staged snapshot as the new shards' durable base; returns the rows."""
        move = self.imports[move_id]
        return sum(shard.commit_load() for shard in move.shards.values())

    def import_changes(self, move_id: str, changes: Mapping[ShardKey, list[Change]]) -> int:
        """Apply the inserts made at the source since what was applied (durably, with their
        batch ids); returns the rows applied."""
        move = self.imports[move_id]
        applied = 0
        for source, entries in changes.items():
            table = source[0]
            for change in sorted(entries, key=lambda c: c.lsn):
                if change.lsn <= move.applied.get(source, 0):
                    continue
                routed = self._route(move, source, change.rows, change.buckets)
                for unit_id, part, buckets in routed:
                    result = move.shards[(table, unit_id)].append(part, change.batch_id, buckets)
                    applied += result.rows
                    if result.appended is not None:
                        rows_and_hash = self.engine.checksum_rows(result.appended)
                        with self._lock:
                            add_sum(move.sums, table, rows_and_hash)
                move.applied[source] = change.lsn
        return applied

    def import_since(self, move_id: str) -> dict[ShardKey, int]:
        return dict(self.imports[move_id].applied)

    def import_sums(self, move_id: str) -> Sums:
        return self.imports[move_id].sums

    def promote(self, move_id: str) -> None:
        """Serve the new shards (the routing switch follows)."""
        move = self.imports[move_id]
        with self._lock:
            for key, shard in move.shards.items():
                shard.writer = True  # from the switch on, this copy logs the inserts
                self.shards[key] = shard
            move.promoted = True
            for table in {key[0] for key in move.shards}:
                self._refresh_view(table)
            del self.imports[move_id]

    def abort_import(self, move_id: str) -> None:
        with self._lock:
            move = self.imports.pop(move_id, None)
        if move is None:
            return
        for shard in move.shards.values():
            shard.abandon_load()
            self._release(shard)
            if not move.shares_files:  # the source's files are the shard's files
                shard.store.destroy()

    def _route(
        self, move: Import, source: ShardKey, rows: pa.Table, buckets: np.ndarray | None
    ) -> list[tuple[int, pa.Table, np.ndarray | None]]:
        """Which of this node's target units each row belongs to, by bucket."""
        if len(move.units) == 1 and len(move.plan.targets) == 1:
            return [(move.units[0][0], rows, buckets)] if rows.num_rows else []
        if buckets is None:
            spec = self.catalog.table(source[0])
            if spec.key:
                buckets = buckets_for(rows, spec, self.catalog.n_buckets)
            else:  # no key and no recorded buckets: any split of the rows is right
                span = next(s for s in move.plan.sources if s.unit_id == source[1])
                width = span.hi - span.lo
                buckets = (span.lo + np.arange(rows.num_rows) % width).astype(np.int32)
        routed = []
        for unit_id, lo, hi in move.units:
            mask = (buckets >= lo) & (buckets < hi)
            if mask.any():
                routed.append((unit_id, rows.filter(pa.array(mask)), buckets[mask]))
        return routed

    def memory_headroom(self) -> int:
        """Bytes of memory this machine has available."""
        try:
            with open("/proc/meminfo", encoding="utf-8") as info:
                for line in info:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return self.profile.memory_bytes

    def unit_bytes(self, units: Iterable[int]) -> int:
        wanted = set(units)
        return sum(s.nbytes for (t, u), s in self.shards.items() if u in wanted)

    # -- reporting ----------------------------------------------------------------------
    def load_report(self) -> dict[str, Any]:
        """Cumulative execution seconds (in all, per unit and operator) and every unit's bytes:
        the balancer turns two reports into rates."""
        with self._lock:
            unit_bytes: Counter[int] = Counter()
            for (_, unit), shard in self.shards.items():
                unit_bytes[unit] += shard.nbytes
            return {
                "busy_seconds": self._busy_seconds,
                "unit_seconds": {u: dict(ops) for u, ops in self._unit_seconds.items()},
                "shard_seconds": [[t, u, self._shard_seconds[(t, u)]] for t, u in self.shards],
                "unit_bytes": dict(unit_bytes),
                "op_seconds": dict(self._op_seconds),
                "device_utilization": device_state(self.device)["device_utilization"],
                "at": time.monotonic(),
            }

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
                **device_state(self.device),
                "engine_fallbacks": dict(getattr(self.executor, "fallbacks", {})),
                "last_fallback": getattr(self.executor, "last_fallback", ""),
                **memory_state(),
            }
