"""The worker: one logical node. It holds its shards (native DuckDB tables), makes inserts
durable, runs SQL fragments over its shards, and takes part in live moves through its two
halves (``worker/moves.py``): as a source it exports a pinned snapshot and the changes since,
fences writes and retires what moved; as a target it builds the new shards beside the served
ones and promotes them at the switch.

A worker that starts rebuilds every shard the catalog assigns to it from durable storage.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import itertools
import logging
import os
import re
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa

from shardflow.catalog import Catalog, CatalogStore, DataDir, OwnerToken, TableSpec, version
from shardflow.catalog.store import CATALOG_FOLDER
from shardflow.config import Settings
from shardflow.control.admission import Foreground
from shardflow.engine import DuckDBEngine, distinct_names, query_error
from shardflow.engine.duckdb_engine import NativeRows, PartsGiven
from shardflow.errors import Moved, NodeFault, QueryError
from shardflow.runtime.protocol import (
    REPLICA,
    DeviceCache,
    FragmentStats,
    LoadReport,
    ReplicaInfo,
    ShardInfo,
    ShardKey,
    WorkerInfo,
)
from shardflow.runtime.wire import PROTOCOL
from shardflow.runtime.worker.changes import RowChanges, stale_files
from shardflow.runtime.worker.local import (
    check_shared,
    default_memory_mb,
    local_folder,
    release_memory,
)
from shardflow.runtime.worker.moves import SourceSide, TargetSide
from shardflow.runtime.worker.profile import (
    calibration_path,
    keep_calibration,
    kept_calibration,
    make_executor,
    node_profile,
    resident_shards,
)
from shardflow.runtime.worker.reads import BoundPart, BoundReads
from shardflow.runtime.worker.resident import KeepsFrames
from shardflow.runtime.worker.serving import CatalogServing
from shardflow.storage import CheckpointPolicy, Shard, ShardStore
from shardflow.storage.shard_store import unfenced
from shardflow.telemetry.calibration import calibrate, operator_mix
from shardflow.telemetry.devices import NodeProfile, device_state, discover, memory_state

log = logging.getLogger(__name__)

_SHARD_DATABASES = itertools.count(1)
"""Numbers the in-memory databases of the shards this process holds (one each)."""
NODE_ERRORS = (duckdb.IOException, duckdb.InternalException, OSError)
"""Errors of the node rather than of the query (a failing disk, an engine fault): the
fragment is tried again, and the node's failure rate counts them. Running out of memory is
the query's size, not the node's health: it is not among them."""


NO_ROOM_MESSAGES = ("No space left on device", "Disk quota exceeded")


def _out_of_room(error: BaseException) -> bool:
    """Whether ``error`` says a disk is full (DuckDB's IO errors carry the system's text)."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return any(message in str(error) for message in NO_ROOM_MESSAGES)


_CONSTANTS = re.compile(r"'(?:[^']|'')*'|\b\d+(?:\.\d+)?\b")


def _index_database(shard: Shard) -> str | None:
    """The database of a shard whose rows should keep a key index, else None."""
    if isinstance(shard.data, NativeRows) and shard.data.index is not None:
        return shard.data.physical
    return None


@functools.lru_cache(maxsize=1024)
def _kind(sql: str) -> str:
    """A fragment's kind of work: its SQL with the constants left out."""
    return _CONSTANTS.sub("?", sql)


@functools.lru_cache(maxsize=1024)
def _operators(sql: str) -> tuple[str, ...]:
    return operator_mix(sql)


class WorkerNode(BoundReads, CatalogServing, RowChanges):
    """A worker's logic, independent of Ray (``runtime/ray/actors.py`` wraps it, and
    ``runtime/inprocess.py`` calls it in this process)."""

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
        host_name: str = "",
    ) -> None:
        """``host_name``: the name of the machine (Ray node) it runs on, if it has one."""
        self.node_id = node_id
        self.data_dir = DataDir.resolve(data_dir, owner)
        """Writes only while ``owner`` owns the data directory (None: unchecked, in tests)."""
        if owner is not None:
            check_shared(self.data_dir, owner, node_id)
        version.read_format(self.data_dir)  # a newer format than this release reads: refused
        self.settings = settings
        self.device = discover(gpu_index)
        self.memory_limit_mb = settings.worker_memory_mb or default_memory_mb()
        self.engine = DuckDBEngine(
            threads=settings.engine_threads or None,
            memory_limit=f"{self.memory_limit_mb}MiB",
            temp_directory=local_folder(settings.local_dir, node_id),
            file_folders=[self.data_dir.path("tables")] if self.data_dir.local else [],
        )
        """Holds the shards (native tables) and runs fragments on the CPU."""
        self.executor = make_executor(self.engine, self.device, slowdown, settings.engine)
        """Runs fragments: the CPU engine, the GPU engine, or a simulated slower device."""
        self.resident = resident_shards(self.executor, self.device, settings, self.memory_limit_mb)
        """The shards kept in the engine's own memory (the GPU's), where it keeps any."""
        self.slowdown = slowdown
        self.profile = node_profile(node_id, self.device, self.executor, {}, slowdown)
        self.policy = CheckpointPolicy(
            settings.wal_checkpoint_entries or 1 << 62, settings.wal_checkpoint_bytes or 1 << 62
        )
        self.shards: dict[ShardKey, Shard] = {}
        self.replicas: dict[str, Shard] = {}
        self._standing_views: set[str] = set()
        """Replicated tables with a view of their name in the engine."""
        self._catalog_seen = 0
        """The catalog folder's change time when this node last found itself a member."""
        self._catalog_store = CatalogStore(self.data_dir)
        """Reads the catalog kept in the data directory: after the first, only the changes
        written since."""
        self.loading: dict[str, dict[int | str, Shard]] = {}
        self.readers: Counter[ShardKey] = Counter()
        """Fragments reading each shard now (retired shards wait for them)."""
        self._releasing: list[tuple[ShardKey, Shard, bool]] = []
        """Shards released once no fragment reads them, and whether their files go too."""
        self._releasing_replicas: list[Shard] = []
        """Replicated tables' copies made again, kept until no fragment runs here."""
        """Shards no longer served, kept until the fragments reading them finish."""
        self._unit_seconds: defaultdict[int, defaultdict[str, float]] = defaultdict(
            lambda: defaultdict(float)
        )
        """Execution seconds per unit, by calibrated operator (the unit's operator mix)."""
        self._shard_seconds: defaultdict[ShardKey, float] = defaultdict(float)
        self._op_seconds: defaultdict[str, float] = defaultdict(float)
        """Execution seconds by calibrated operator (the load's operator mix)."""
        self.catalog = Catalog()
        self.lock = threading.RLock()
        self.source = SourceSide(self)
        """This node as the source of live moves."""
        self.target = TargetSide(self)
        """This node as the target of live moves."""
        self.foreground = Foreground()
        """Latencies of this node's fragments and inserts, usual and recent."""
        self._foreground_lock = threading.Lock()
        self._running = 0
        self._busy_seconds = 0.0
        self._started = time.monotonic()
        self._operations = 0
        self._failures = 0
        """Operations run and failed by the node (the failure rate's counts)."""
        flaky = settings.flaky_node()
        named = flaky is not None and flaky[0] in (node_id, host_name or node_id)
        self._flaky_share = flaky[1] if flaky is not None and named else 0.0
        self._flaky_count = 0
        if catalog is not None:
            self.sync(catalog)

    def calibrate(self, fresh: bool = False) -> NodeProfile:
        """Measure this node's device with its own engine (a second or so); the capacity
        weighs how much work placement and the balancer give it. The measurement is kept in
        the data directory per kind of node (device, engine, threads, simulated slowdown)
        and reused by nodes of that kind that start later, unless ``fresh``."""
        if not fresh and self.kept_calibration() is not None:
            return self.profile
        throughput = calibrate(self.executor.run)
        keep_calibration(self.data_dir, self._calibration_path(), throughput)
        self.profile = node_profile(
            self.node_id, self.device, self.executor, throughput, self.slowdown
        )
        return self.profile

    def kept_calibration(self) -> NodeProfile | None:
        """The profile with the calibration kept for this kind of node, measuring nothing
        (a worker that starts takes it at once); None when there is none to reuse."""
        throughput = kept_calibration(self.data_dir, self._calibration_path())
        if throughput is None:
            return None
        self.profile = node_profile(
            self.node_id, self.device, self.executor, throughput, self.slowdown
        )
        return self.profile

    def _calibration_path(self) -> str:
        threads = self.settings.engine_threads or os.cpu_count()
        return calibration_path(self.data_dir, self.device, self.executor, threads, self.slowdown)

    def _check_member(self) -> None:
        """Serve no read once the catalog kept in the data directory no longer lists this
        node (failed over while cut off from the coordinator, which could not tell it): its
        copies of replicated tables may miss inserts acknowledged since (distributed shards
        are fenced each by its holder record). The catalog is read again only when its
        folder changed (a local data directory; elsewhere, not checked)."""
        if not self.replicas or not self.data_dir.local or unfenced("reads"):
            return
        try:
            stamp = os.stat(self.data_dir.path(CATALOG_FOLDER)).st_mtime_ns
        except FileNotFoundError:
            return
        if stamp == self._catalog_seen:
            return
        latest = self._catalog_store.load()
        if latest is not None and latest.version > self.catalog.version:
            if self.node_id not in latest.nodes:
                raise Moved(f"replicas on {self.node_id}, no longer a member", latest.epoch)
        self._catalog_seen = stamp

    def refresh_view(self, table: str) -> None:
        """The view named ``table`` reads this node's copy of a replicated table (dropped
        with the table). A distributed table has none: each fragment names the shards it
        was bound to (:meth:`views_for`), so a move (of distributed units only) changes no
        view — DDL that took 2-17 ms a table while writers waited at the fence."""
        if table in self.replicas:
            self.engine.set_view(table, [self._ref(self.replicas[table])])
            self._standing_views.add(table)
        elif table in self._standing_views:
            self.engine.set_view(table, [])
            self._standing_views.discard(table)

    @staticmethod
    def _ref(shard: Shard) -> str:
        assert isinstance(shard.data, NativeRows)
        return shard.data.ref

    def release(self, shard: Shard) -> None:
        """Stop serving ``shard`` and free its rows (and its kept frame). It is retired
        first, under its lock: an append already in it finishes before the rows go, and one
        that still holds the shard is told ``Moved`` (and re-routed) rather than writing into
        a dropped table."""
        shard.retire()
        if self.resident is not None:
            self.resident.forget(shard)
        if isinstance(shard.data, NativeRows):
            shard.data.drop()

    def prewarm(self, shards: Iterable[Shard]) -> None:
        """Keep the frames of shards about to be served (a move's target, before the
        switch), where this node keeps frames: the first query after finds them."""
        if self.resident is not None:
            self.resident.prewarm(shards)

    def new_shard(self, spec: TableSpec, name: str, *, writer: bool) -> Shard:
        store = ShardStore(self.data_dir, spec.uid, name)
        # every shard has a database of its own: one made again after a change of its rows
        # is served beside the one before (kept for the fragments reading it), and a unit
        # that moved away and back is served beside its old copy, still read meanwhile
        physical = f"t_{spec.uid[:12]}_{name}_{next(_SHARD_DATABASES)}"
        index = spec.key if spec.key_index and spec.key else None
        rows = self.engine.native_rows(physical, spec.schema, index)
        shard = Shard(store, spec.schema, rows=rows, writer=writer, policy=self.policy)
        shard.committed = frozenset(change.statement for change in spec.changes)
        return shard

    # -- loading a new table ------------------------------------------------------------
    def prepare(self, spec: TableSpec, unit_ids: Sequence[int], primary: bool) -> None:
        with self.lock:
            if spec.kind == "replicated":
                shards: dict[int | str, Shard] = {
                    REPLICA: self.new_shard(spec, REPLICA, writer=primary)
                }
            else:
                shards = {u: self.new_shard(spec, str(u), writer=True) for u in unit_ids}
            for shard in shards.values():
                if shard.writer:
                    shard.claim(self.node_id, self.catalog.epoch)
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

    def finish_load(self, table: str) -> None:
        """Make a committed load visible: the staged shards become served shards (the
        catalog with the table follows: :meth:`follow`, or :meth:`sync` with it whole)."""
        with self.lock:
            shards = self.loading.pop(table, {})
            for unit, shard in shards.items():
                if unit == REPLICA:
                    self.replicas[table] = shard
                else:
                    assert isinstance(unit, int)
                    self.shards[(table, unit)] = shard
            self.refresh_view(table)
        for shard in shards.values():
            if isinstance(shard.data, NativeRows):
                shard.data.settle()  # the load's last rows, below the compactor's threshold
        release_memory()

    def abort_load(self, table: str) -> None:
        with self.lock:
            shards = self.loading.pop(table, {})
        for shard in shards.values():
            shard.abandon_load()
            self.release(shard)
            if shard.writer:
                shard.store.destroy()

    # -- writes -------------------------------------------------------------------------
    def append(
        self,
        table: str,
        parts: Mapping[int, tuple[pa.Table, np.ndarray]],
        batch_id: str,
        epoch: int,
        commit: int | None = None,
    ) -> dict[int, int]:
        """Append each part (rows and their buckets) to its shard, durably; returns the new
        LSN per unit. ``commit``: the table's commit number the insert was routed at."""
        lsns = {}
        started = time.perf_counter()
        checked = self.check_commits({table: commit}, epoch) if commit is not None else {}
        shards: dict[int, Shard] = {}
        for unit in parts:
            found = self.shards.get((table, unit))
            if found is None:
                raise Moved(f"{table}#{unit}", epoch)
            self._same_files(checked, table, found, epoch)
            shards[unit] = found
        for unit, (part, buckets) in parts.items():
            shard = shards[unit]
            try:
                lsns[unit] = shard.append(part, batch_id, np.asarray(buckets)).lsn
            except OSError:  # a failing disk: the node's failure (the caller retries); a
                # full or read-only one is a StorageError, the storage's state, not the node's
                self._count(failed=True)
                raise
        self._count(failed=False)
        rows = sum(part.num_rows for part, _ in parts.values())
        self.record_foreground(f"insert {table} {rows.bit_length()}", time.perf_counter() - started)
        return lsns

    # -- the foreground, as moves see it --------------------------------------------------
    def record_foreground(self, kind: str, seconds: float) -> None:
        """A fragment or an insert finished (what a move's copy must not slow down). Its
        usual latency is learned only while the node takes part in no move: a target's
        copy and a source's handing out of its rows both slow the node's own work, and
        learned then, that slowdown would read as usual and never pace a copy."""
        with self._foreground_lock:
            moving = bool(self.target.imports) or bool(self.source.exports)
            self.foreground.record(kind, seconds, time.monotonic(), background=moving)

    def foreground_slowdown(self) -> float:
        """How much slower than usual this node's work runs now (1.0: as usual)."""
        with self._foreground_lock:
            return self.foreground.slowdown(time.monotonic())

    def append_replica(
        self, table: str, part: pa.Table, batch_id: str, commit: int | None = None
    ) -> int:
        epoch = self.catalog.epoch
        checked = self.check_commits({table: commit}, epoch) if commit is not None else {}
        shard = self.replicas.get(table)
        if shard is None:
            raise Moved(f"{table} (replica)", epoch)
        self._same_files(checked, table, shard, epoch)
        return shard.append(part, batch_id).lsn

    # -- queries ------------------------------------------------------------------------
    def views_for(self, bindings: Mapping[str, list[int]], epoch: int) -> dict[str, str]:
        """Per-call views naming exactly the shards a fragment was bound to. (The standing
        view of a table may change under a running fragment when a move switches; these
        cannot, and the shards they name are kept until the fragment's reads are done.)"""
        views = {}
        with self.lock:
            for table, units in bindings.items():
                for unit in units:
                    if (table, unit) not in self.shards:
                        raise Moved(f"{table}#{unit}", epoch)
                    shard = self.shards[(table, unit)]
                    stale = stale_files(shard, self.catalog.tables.get(table), epoch)
                    if stale is not None:
                        raise stale
                    shard.check_held()
                views[table] = " UNION ALL ".join(
                    f"SELECT * FROM {self._ref(self.shards[(table, u)])}" for u in sorted(units)
                )
        return views

    def execute(
        self,
        sql: str,
        bindings: Mapping[str, list[int]],
        epoch: int,
        inputs: Mapping[str, pa.Table],
        profile: bool = True,
        commits: Mapping[str, int] | None = None,
        emit: Callable[[pa.Table], None] | None = None,
        part: BoundPart | None = None,
    ) -> tuple[pa.Table, FragmentStats]:
        """Run a fragment over this node's shards; returns the result and what was measured
        (with ``profile``: wall-clock start and end, rows and bytes in and out, engine and
        device as well as the time). ``commits``: the commit number of each table the query
        reads, as its routing had them (:meth:`check_commits`). With ``emit``, DuckDB's
        engine gives it the result in parts as it makes them and returns none of it (an
        empty table of its schema); another engine returns it whole as ever. ``part``: the
        shards bound already (:meth:`bind`, a worker endpoint's reserved part), let go at the
        end as a part bound here is."""
        started_at = time.time()
        started = time.perf_counter()
        part = part or self.bind(bindings, epoch, commits or {})
        views, bound, reading = part.views, part.bound, part.reading
        rows_in = part.rows + sum(t.num_rows for t in inputs.values())
        bytes_in = part.bytes + sum(t.nbytes for t in inputs.values())
        try:
            self._flaky_fault()
            if emit is not None and self.executor is self.engine and self.resident is None:
                emitted = PartsGiven(emit)
                schema = self.engine.run_in_parts(sql, emitted, inputs, views)
                result = distinct_names(schema.empty_table())
                result_rows, result_bytes = emitted.rows, emitted.bytes
            else:
                result = distinct_names(self._run(sql, inputs, views, bound))
                result_rows, result_bytes = result.num_rows, result.nbytes
        except NodeFault:
            self._count(failed=True)
            raise
        except NODE_ERRORS as error:  # the node's failure, not the query's: try again
            if _out_of_room(error):  # its spill folder's disk is full: the query's size
                self._count(failed=False)
                raise QueryError(
                    f"a fragment of the query found no room to spill on {self.node_id} "
                    f"(the disk of local_dir is full): {str(error).strip()}"
                ) from None
            self._count(failed=True)
            raise NodeFault(f"{self.node_id} failed a fragment: {error}") from None
        except duckdb.OutOfMemoryException as error:  # the query's size: say which limit
            self._count(failed=False)
            raise QueryError(
                f"a fragment of the query needs more memory than {self.node_id} may use "
                f"(worker_memory_mb={self.memory_limit_mb}, spilling to local_dir beyond "
                f"it): {str(error).strip()}"
            ) from None
        except duckdb.Error as error:
            self._count(failed=False)
            raise query_error(error) from None
        finally:
            elapsed = time.perf_counter() - started
            with self.lock:
                self._unbind(part)
                self._busy_seconds += elapsed
                units = {u for _, u in reading}
                operators = _operators(sql)
                for operator in operators:
                    self._op_seconds[operator] += elapsed / len(operators)
                    for unit in units:  # a fragment's load is shared by the units it read
                        self._unit_seconds[unit][operator] += elapsed / len(units) / len(operators)
                for key in reading:
                    self._shard_seconds[key] += elapsed / len(reading)
            self.record_foreground(_kind(sql), elapsed)
        self._count(failed=False)
        if not profile:
            return result, FragmentStats(elapsed, result_rows)
        fell_back = getattr(self.executor, "fell_back", "")
        engine = (
            f"{self.profile.engine} (fell back to {fell_back})"
            if fell_back
            else self.profile.engine
        )
        return result, FragmentStats(
            seconds=elapsed,
            rows_out=result_rows,
            started_at=started_at,
            finished_at=started_at + elapsed,
            rows_in=rows_in,
            bytes_in=bytes_in,
            bytes_out=result_bytes,
            engine=engine,
            device=f"{self.profile.vendor} {self.profile.model}",
        )

    def _run(
        self,
        sql: str,
        inputs: Mapping[str, pa.Table],
        views: Mapping[str, str],
        bound: Mapping[str, list[Shard]],
    ) -> pa.Table:
        """Run a fragment with the node's engine: over the bound shards' kept frames where
        the engine keeps them (each current to its shard's LSN), else over DuckDB."""
        engine = self.executor
        if self.resident is None or not isinstance(engine, KeepsFrames):
            return engine.run(sql, inputs, views)
        kept = {t: [self.resident.frame(s) for s in shards] for t, shards in bound.items()}
        return engine.run(sql, inputs, views, kept)

    def _count(self, failed: bool) -> None:
        with self.lock:
            self._operations += 1
            self._failures += failed

    def _flaky_fault(self) -> None:
        """``test_flaky_node`` (tests only): fail this share of the fragments, evenly spread
        (the n-th fails when n * share crosses a whole number)."""
        if not self._flaky_share:
            return
        with self.lock:
            self._flaky_count += 1
            n = self._flaky_count
        if int(n * self._flaky_share) > int((n - 1) * self._flaky_share):
            raise NodeFault(f"{self.node_id} failed a fragment (test_flaky_node)")

    # -- what a live move asks before it starts ---------------------------------------------
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
    def load_report(self) -> LoadReport:
        """Cumulative execution seconds (in all, per unit and operator) and every unit's bytes:
        the balancer turns two reports into rates."""
        device = device_state(self.device)
        with self.lock:
            unit_bytes: Counter[int] = Counter()
            for (_, unit), shard in self.shards.items():
                unit_bytes[unit] += shard.nbytes
            return LoadReport(
                at=time.monotonic(),
                busy_seconds=self._busy_seconds,
                unit_seconds={u: dict(ops) for u, ops in self._unit_seconds.items()},
                shard_seconds={key: self._shard_seconds.get(key, 0.0) for key in self.shards},
                unit_bytes=dict(unit_bytes),
                op_seconds=dict(self._op_seconds),
                device_utilization=device.utilization,
                operations=self._operations,
                failures=self._failures,
                device_errors=device.errors,
                memory_budget=self.resident.budget_bytes if self.resident is not None else 0,
            )

    def _device_cache(self) -> DeviceCache | None:
        if self.resident is None:
            return None
        kept = self.resident.stats()
        return DeviceCache(kept.budget_bytes, kept.bytes, kept.shards, kept.hit_rate)

    def info(self) -> WorkerInfo:
        device = device_state(self.device)
        engine_bytes, spilled_bytes = self.engine.memory()
        memory = dataclasses.replace(
            memory_state(),
            engine_bytes=engine_bytes,
            spilled_bytes=spilled_bytes,
            limit_bytes=self.memory_limit_mb << 20,
        )
        with self.lock:
            held = [
                (
                    ShardInfo(t, u, s.rows, s.nbytes, s.lsn, prepared=tuple(sorted(s.prepared))),
                    _index_database(s),
                )
                for (t, u), s in sorted(self.shards.items())
            ]
            replicas = tuple(
                ReplicaInfo(t, s.rows, s.nbytes, s.lsn, tuple(sorted(s.prepared)))
                for t, s in sorted(self.replicas.items())
            )
            info = WorkerInfo(
                profile=self.profile,
                shards=(),
                replicas=replicas,
                queries_running=self._running,
                busy_seconds=self._busy_seconds,
                uptime_seconds=time.monotonic() - self._started,
                catalog_version=self.catalog.version,
                device=device,
                memory=memory,
                engine_fallbacks=dict(getattr(self.executor, "fallbacks", {})),
                last_fallback=str(getattr(self.executor, "last_fallback", "")),
                pid=os.getpid(),
                device_cache=self._device_cache(),
                protocol=self.settings.test_protocol or PROTOCOL,
                release=version.release(),
            )
        # which key indexes exist, asked of DuckDB once and outside the node's lock (a
        # fragment never waits on it); nothing is asked where no shard has one
        indexed = self.engine.indexed_databases() if any(db for _, db in held) else set()
        shards = tuple(
            dataclasses.replace(shard, indexed=database in indexed) if database else shard
            for shard, database in held
        )
        return dataclasses.replace(info, shards=shards)
