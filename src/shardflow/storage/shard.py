"""A shard: its rows in memory (a :class:`RowStore`) backed by its durable
:class:`ShardStore`.

An insert is written to the log before it becomes visible and before it is acknowledged, and
a retried insert (same batch id) is applied once. Where the rows live in memory is up to the
row store: Arrow batches (:class:`ArrowRows`), or an engine's native table on a worker.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import tempfile
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import pyarrow as pa

from shardflow.errors import Moved, Retryable, StorageError
from shardflow.storage.held import Held, claim, covered, merge_held
from shardflow.storage.partition import BATCH_UNITS
from shardflow.storage.shard_store import (
    RECENT_BATCH_IDS,
    Applied,
    BaseWriter,
    CheckpointFile,
    CheckpointMeta,
    ShardStore,
    read_checkpoint,
)

log = logging.getLogger(__name__)
_IDENTS = itertools.count(1)

FENCE_WAIT_S = 10.0
"""How long an insert waits at a fence before it asks its client to retry."""

COMPACT_TAIL_BATCHES = 32
"""Small inserted batches are merged once this many pile up (scans of tiny batches are slow)."""
RECENT_BYTES = 64 << 20
"""Rows of the latest appends a shard keeps for the copies of it kept current by appends
(:meth:`Shard.rows_since`): beyond this, such a copy is built again from the shard."""
STAGE_ROWS = 122_880
"""Rows a load or a move's copy hands its row store at a time, in whole multiples (the rest
waits for more rows, or for the end): DuckDB's row group. An INSERT of fewer rows is copied
once more at its commit (a unit of TPC-H lineitem staged in the halves of 128K-row chunks,
as a split does: 0.63 s against 0.37 s in whole chunks); one of more rows that are no
multiple leaves a row group part full in the middle of the file, and DuckDB's first
checkpoint after rows are deleted from such a file merges them, rewriting and compressing
the rows again (a DELETE of 10 % of a lineitem unit of 1.5 M rows: its checkpoint 0.6-1.0 s
against 0.01-0.04 s with whole row groups)."""


@dataclass(frozen=True)
class CheckpointPolicy:
    """When the log is folded into a new Parquet base."""

    max_wal_entries: int = 256
    max_wal_bytes: int = 64 << 20


@dataclass(frozen=True)
class AppendResult:
    lsn: int
    rows: int
    duplicate: bool
    appended: pa.Table | None = None
    """The rows that were new (all of them, unless a retry brought some twice)."""


@dataclass(eq=False)
class _Pending:
    """An append waiting to be group-committed, and then its outcome."""

    table: pa.Table
    batch_id: str
    buckets: np.ndarray | None
    lsn: int | None
    done: bool = False
    result: AppendResult | None = None
    error: Exception | None = None


@dataclass(frozen=True)
class Change:
    """An insert applied after a snapshot was pinned (what a live move catches up on)."""

    lsn: int
    batch_id: str
    rows: pa.Table
    buckets: np.ndarray | None
    """The bucket of every row (None for tables without buckets: replicas)."""


class BatchStream(Protocol):
    """A pinned snapshot handed out a batch at a time."""

    def next(self) -> pa.Table | None:
        """The next batch, or None once every row was handed out."""
        ...

    def checksum(self) -> tuple[int, int] | None:
        """(rows, sum of row hashes) of the whole snapshot where the store hashes it in
        place, before the first batch; None: hash the batches as they are handed out."""
        ...

    def close(self) -> None: ...


class RowStore(Protocol):
    """Where a shard's rows live in memory."""

    def append(self, table: pa.Table, lsn: int = 0) -> None:
        """Add rows logged up to ``lsn``."""
        ...

    def reset(self, tables: list[pa.Table]) -> None:
        """Replace every row with ``tables``."""
        ...

    def read(self) -> pa.Table: ...

    @property
    def rows(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


@dataclass(frozen=True)
class RowRewrite:
    """A change of a shard's rows, as a statement gives it (``DELETE``, ``UPDATE``): SQL
    over the shard's rows named as the table (``alias``). Rows where ``where`` holds (all,
    without one) are deleted, or get ``sets`` (column, expression over the old values)."""

    alias: str
    where: str | None
    sets: tuple[tuple[str, str], ...] = ()
    delete: bool = False
    key: str | None = None
    """The table's distribution key, where ``sets`` sets it: a row whose new key belongs
    to another shard leaves this one (the statement inserts it there)."""
    inputs: Mapping[str, pa.Table] = field(default_factory=dict)
    """Tables ``where`` and ``sets`` read by these names (whole copies of the cluster's
    tables a correlated subquery reads, ``sql/statements.shipped_reads``)."""
    returning: str | None = None
    """What each changed row gives back (``RETURNING``'s select list), or None."""
    typed_sets: tuple[tuple[str, str], ...] = ()
    """``sets`` with each value cast to its column's type, as the UPDATE stores it."""


def returning_query(
    rows: str,
    alias: str,
    where: str | None,
    sets: Sequence[tuple[str, str]],
    returning: str,
) -> str:
    """What a DELETE or UPDATE gives back (``RETURNING``) as a query over ``rows`` (SQL of a
    FROM item: the rows before the statement, named ``alias`` as it names them): the
    returned values of each row ``where`` holds for, as the statement leaves it: a deleted
    row as it was, an updated one with its new values (``sets``, each value cast to its
    column, ``RowRewrite.typed_sets``), as DuckDB's own RETURNING answers.

    >>> print(returning_query("t", "x", None, [("v", "CAST((v + 1) AS BIGINT)")], "v AS w"))
    SELECT v AS w FROM (SELECT * REPLACE (CAST((v + 1) AS BIGINT) AS "v") FROM t AS "x") AS "x"
    """
    named = _quoted(alias)
    source = f"{rows} AS {named}" + (f" WHERE {where}" if where else "")
    if sets:
        replaced = ", ".join(f"{value} AS {_quoted(column)}" for column, value in sets)
        source = f"(SELECT * REPLACE ({replaced}) FROM {source}) AS {named}"
    return f"SELECT {returning} FROM {source}"


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


@runtime_checkable
class CheckpointRows(RowStore, Protocol):
    """A row store whose base is a checkpoint file it reads as it lies (a worker's DuckDB,
    ``engine/duckdb_engine.NativeRows``): a restart attaches it, a checkpoint copies it and
    adds the rows logged since, never decoding the rows it holds."""

    scratch: str
    """A local folder for files the data directory cannot be read in place from."""

    def restore(
        self,
        checkpoint: str | None,
        meta: CheckpointMeta | None,
        tables: list[pa.Table],
        lsns: list[int],
    ) -> None:
        """Hold the checkpoint file (if any) and ``tables`` after it (each logged up to its
        LSN in ``lsns``); ``StorageError`` for a file that is not what ``meta`` says."""
        ...

    def begin_load(self, path: str) -> None:
        """Stage the rows that follow (:meth:`stage`) into a new checkpoint file."""
        ...

    def stage(self, table: pa.Table) -> None: ...

    def finish_load(self) -> tuple[int, int, int]:
        """Close the load's file; its (rows, digest, Arrow bytes)."""
        ...

    def abandon_load(self) -> None: ...

    def write_change(
        self,
        path: str,
        lsn: int,
        change: RowRewrite,
        keeps: Callable[[pa.Table], np.ndarray] | None = None,
    ) -> Any:
        """Write the rows logged before ``lsn`` as ``change`` leaves them, as a checkpoint
        file at ``path`` (at ``lsn``); its rows, digest, Arrow bytes, the rows the change
        changes (nothing is written where it changes none) and, for an UPDATE of the key,
        the rows ``keeps`` does not keep here (``engine/duckdb_engine.Written``)."""
        ...

    def write_checkpoint(self, path: str, lsn: int) -> tuple[int, int, int, int]:
        """Write every row logged up to ``lsn`` as a checkpoint file at ``path``; its
        (rows, digest, Arrow bytes, rows deleted in place it still holds)."""
        ...

    def use_checkpoint(self, path: str, meta: CheckpointMeta) -> None:
        """Read the rows up to ``meta.lsn`` from the checkpoint file at ``path`` from now on
        (the copies of them in memory go)."""
        ...


class ArrowRows:
    """Rows as Arrow record batches; readers get a zero-copy ``pyarrow.Table``."""

    def __init__(self, schema: pa.Schema) -> None:
        self.schema = schema
        self._batches: list[pa.RecordBatch] = []
        self._tail = 0
        self._snapshot: pa.Table | None = None
        self._lock = threading.Lock()

    def append(self, table: pa.Table, lsn: int = 0) -> None:
        with self._lock:
            self._batches.extend(b for b in table.to_batches() if b.num_rows)
            self._tail += table.num_rows and 1
            if self._tail > COMPACT_TAIL_BATCHES:  # scans of many tiny batches are slow
                merged = pa.Table.from_batches(self._batches, self.schema).combine_chunks()
                self._batches = merged.to_batches()
                self._tail = 0
            self._snapshot = None

    def reset(self, tables: list[pa.Table]) -> None:
        with self._lock:
            self._batches = [b for t in tables for b in t.to_batches() if b.num_rows]
            self._tail = 0
            self._snapshot = None

    def read(self) -> pa.Table:
        with self._lock:
            if self._snapshot is None:
                self._snapshot = pa.Table.from_batches(self._batches, self.schema)
            return self._snapshot

    @property
    def rows(self) -> int:
        return self.read().num_rows

    @property
    def nbytes(self) -> int:
        return self.read().nbytes


class _OneBatch:
    """A stream of one table (for row stores that hold Arrow already)."""

    def __init__(self, table: pa.Table) -> None:
        self._table: pa.Table | None = table

    def next(self) -> pa.Table | None:
        table, self._table = self._table, None
        return table

    def checksum(self) -> None:
        return None

    def close(self) -> None:
        self._table = None


class Claimers:
    """Threads of this process that make the claims :meth:`Shard.claim_soon` hands over,
    started once (:meth:`start`, as a worker starts) rather than one per claim."""

    THREADS = 2

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], None], threading.Event]] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._started = False

    def start(self) -> None:
        with self._lock:
            if self._started:
                return
            for index in range(self.THREADS):
                name = f"claims-{index}"
                threading.Thread(target=self._run, name=name, daemon=True).start()
            self._started = True

    def submit(self, work: Callable[[], None]) -> threading.Event:
        """Run ``work`` on one of the threads; the event is set once it ended."""
        self.start()
        done = threading.Event()
        self._queue.put((work, done))
        return done

    def _run(self) -> None:
        while True:
            work, done = self._queue.get()
            try:
                work()
            except Exception:  # pragma: no cover - the work says what failed itself
                log.exception("a claim failed")
            finally:
                done.set()


CLAIMERS = Claimers()


class Shard:
    """One shard's rows with their log sequence number (LSN) and durable files."""

    def __init__(
        self,
        store: ShardStore,
        schema: pa.Schema,
        *,
        rows: RowStore | None = None,
        writer: bool = True,
        policy: CheckpointPolicy | None = None,
    ) -> None:
        self.store = store
        self.schema = schema
        self.writer = writer
        self.policy = policy or CheckpointPolicy()
        self.lsn = 0
        self.data: RowStore = rows if rows is not None else ArrowRows(schema)
        self._base_writer: BaseWriter | None = None
        self._load_file: CheckpointFile | None = None
        """The checkpoint file a load (or a split's copy) stages its rows into."""
        self._staged_rows = 0
        self._staging: list[pa.Table] = []
        """Staged rows not handed to the row store yet (fewer than STAGE_ROWS)."""
        self._applied: OrderedDict[str, Held] = OrderedDict()
        self._wal_entries = 0
        self._wal_bytes = 0
        self._lock = threading.Condition()
        self._queue: list[_Pending] = []
        """Appends waiting for the next group commit (see :meth:`append`)."""
        self._queue_lock = threading.Lock()
        self._claiming: tuple[str, threading.Event] | None = None
        """A claim under way on a thread (:meth:`claim_soon`): the node, and its end."""
        self._claim_failed: Exception | None = None
        self._claim_lock = threading.Lock()
        self._taps: dict[str, list[Change]] = {}
        """The appends kept for each move exporting the shard (by its id): a move's end or
        roll-back ends its own, never another's that began since."""
        self._checkpointing = False
        """A checkpoint is being written in the background (see :meth:`_start_checkpoint`)."""
        self.fenced = False
        self.retired = False
        self.ident = next(_IDENTS)
        """Tells this shard from every other in this process (a shard built again, by a
        move, a split or a failover, is another one)."""
        self.committed: frozenset[str] = frozenset()
        """Statements whose changes of rows the catalog holds as committed (as this shard
        was made): a change prepared here for one of them takes effect at recovery."""
        self.prepared: dict[str, int] = {}
        """Changes of rows prepared here and not decided yet, by statement: the LSN each
        holds. No checkpoint is written meanwhile (it would hold the rows unchanged past
        that LSN, and a recovery would prefer it to the change once committed)."""
        self.keeps_recent = False
        """Keep the rows of the latest appends (:meth:`rows_since`): a copy of the shard
        elsewhere (its frame on a GPU) is kept current with them."""
        self._recent: deque[tuple[int, pa.Table]] = deque()
        self._recent_bytes = 0

    # -- life cycle ----------------------------------------------------------------------
    def claim(self, node: str, epoch: int | None, *, recovering: bool = False) -> None:
        """Become the shard's one writer (``ShardStore.claim``): a shard about to be
        recovered (``recovering``) claims it first, and :meth:`recover` records the LSN it
        reaches; a new shard, or a move's copy taking over, records its LSN now."""
        self.store.claim(node, epoch, None if recovering else self.lsn)

    def claim_soon(self, node: str) -> None:
        """:meth:`claim` as a move's target takes the shard over (succeeding the fenced
        source at its epoch), on a thread of its own: the claim's synced writes go on while
        the coordinator switches the routing, out of the writers' pause. Nothing is written
        to the shard (a log entry, a checkpoint, a prepared change) before the claim is
        done (:meth:`await_claim`). The thread is one of :data:`CLAIMERS`, started before:
        starting one here, while writers wait, waited for a core (4-25 ms of the pause on a
        busy 2-core machine)."""
        with self._claim_lock:
            self._claim_failed = None
            self._claiming = (node, CLAIMERS.submit(lambda: self._claim_quietly(node)))

    def _claim_quietly(self, node: str) -> None:
        try:
            self.claim(node, None)
        except Exception as error:  # the first write claims again, and says why if it fails
            log.warning(
                "%s: claim failed, tried again at the first write: %s", self.store.folder, error
            )
            self._claim_failed = error

    def await_claim(self) -> None:
        """Wait for a claim :meth:`claim_soon` began; one that failed is made again here
        (its error raised where that fails too)."""
        with self._claim_lock:
            pending = self._claiming
            if pending is None:
                return
            node, done = pending
            done.wait()
            self._claiming = None
            if self._claim_failed is not None:
                self._claim_failed = None
                self.claim(node, None)

    def claim_again(self, node: str) -> None:
        """Hold the shard again after a move that was to take it over rolled back (its
        target had claimed it), unless a copy given it at a later epoch holds it now."""
        claimed = self.store.claimed
        holders = self.store.holders()
        if claimed is not None and (not holders or holders[-1].token != claimed.token):
            self.claim(node, claimed.epoch)

    def check_held(self) -> None:
        """Raise ``Moved`` once a copy given the shard at a later epoch holds it (a read
        must not miss what that copy acknowledged)."""
        self.store.check_claim("reads", later_only=True)

    def recover(self, attempts: int = 5, upto: int | None = None) -> None:
        """Rebuild from durable storage (retrying while a writer checkpoints under us). A
        checkpoint file is opened where it lies, and only the log after it is read. With
        ``upto`` no log entry past it is taken (a move's target: what the source logs after
        its pinned LSN comes from the source)."""
        for attempt in range(attempts):
            try:
                recovered = self.store.recover(self.schema, upto, self.committed)
                with self._lock:
                    if isinstance(self.data, CheckpointRows):
                        checkpoint = recovered.checkpoint
                        if checkpoint is not None:
                            checkpoint = self.store.local_checkpoint(checkpoint, self.data.scratch)
                        self.data.restore(
                            checkpoint, recovered.meta, recovered.tables, recovered.lsns
                        )
                    else:
                        tables = recovered.tables
                        if recovered.checkpoint is not None:
                            base = self._read_checkpoint(recovered.checkpoint)
                            tables = [base, *tables]
                        self.data.reset(tables)
                break
            except FileNotFoundError:  # superseded by a checkpoint meanwhile: list again
                if attempt == attempts - 1:
                    raise
                time.sleep(0.05 * (attempt + 1))
        with self._lock:
            self.lsn = recovered.lsn
            self._applied = OrderedDict(recovered.applied)
            self._wal_entries = recovered.wal_entries
            self._wal_bytes = recovered.wal_bytes
            self.prepared = dict(recovered.prepared) if upto is None else {}
        self.store.settle_claim(recovered.lsn)

    def _read_checkpoint(self, path: str) -> pa.Table:
        """A checkpoint file's rows, read whole (rows kept as Arrow); a copy made to read it
        (the data directory is not local) goes after."""
        local = self.store.local_checkpoint(path, tempfile.gettempdir())
        try:
            return read_checkpoint(local).cast(self.schema)
        finally:
            if local != path:
                os.unlink(local)

    def stage(self, table: pa.Table) -> None:
        """Load rows into a new shard, streaming them into memory and into the base being
        written (a checkpoint file, which the shard then reads: it holds them once).
        Nobody reads the shard before it is served; it is durable at :meth:`commit_load`."""
        table = table.cast(self.schema)
        with self._lock:
            if self.writer and self._base_writer is None and self._load_file is None:
                if isinstance(self.data, CheckpointRows):
                    self._begin_load_file()
                else:
                    self._base_writer = self.store.base_writer(self.lsn, self.schema)
            self._staging.append(table)
            if sum(t.num_rows for t in self._staging) >= STAGE_ROWS:
                self._hand_staged(whole_groups=True)
            if self._base_writer is not None:
                self._base_writer.write(table)
            self._staged_rows += table.num_rows

    def _hand_staged(self, whole_groups: bool = False) -> None:
        """Hand the staged rows to the row store: all of them, or with ``whole_groups`` a
        whole number of :data:`STAGE_ROWS`, the rest kept staged."""
        if self._staging:
            staged = pa.concat_tables(self._staging)
            self._staging = []
            if whole_groups:
                cut = staged.num_rows // STAGE_ROWS * STAGE_ROWS
                if cut < staged.num_rows:
                    self._staging = [staged.slice(cut)]
                    staged = staged.slice(0, cut)
            if isinstance(self.data, CheckpointRows):
                self.data.stage(staged)
            else:
                self.data.append(staged, self.lsn)

    def commit_load(self) -> int:
        """Make the staged rows the durable base; returns their count."""
        with self._lock:
            self._hand_staged()
            if isinstance(self.data, CheckpointRows):
                self._commit_checkpoint_load()
            elif self.writer:
                writer = self._base_writer or self.store.base_writer(self.lsn, self.schema)
                writer.finish(self._applied)
            self._base_writer = None
            rows, self._staged_rows = self._staged_rows, 0
            return rows

    def _commit_checkpoint_load(self) -> None:
        assert isinstance(self.data, CheckpointRows)
        if not self.writer:
            return
        if self._load_file is None:  # nothing was staged: an empty checkpoint all the same
            self._begin_load_file()
        assert self._load_file is not None
        load, self._load_file = self._load_file, None
        self._finish_file(load, self.data.finish_load, self._applied)

    def _begin_load_file(self) -> None:
        assert isinstance(self.data, CheckpointRows)
        self._load_file = self.store.new_checkpoint(self.lsn, self.data.scratch)
        self.data.begin_load(self._load_file.path)

    def _finish_file(
        self, written: CheckpointFile, write: Callable[[], tuple[int, ...]], applied: Applied
    ) -> None:
        """Write a checkpoint file (``write``: its rows, digest and bytes, and the rows
        deleted in place it holds, if any), make it the shard's base, and read the shard
        from it from then on; abandoned if it fails."""
        assert isinstance(self.data, CheckpointRows)
        try:
            rows, digest, nbytes, *dead = write()
        except BaseException:
            written.abandon()
            raise
        meta = written.finish(rows, digest, nbytes, applied, *dead)
        self.data.use_checkpoint(written.opened_at, meta)

    def abandon_load(self) -> None:
        with self._lock:
            self._staging = []
            if self._base_writer is not None:
                self._base_writer.abandon()
                self._base_writer = None
            if self._load_file is not None:
                assert isinstance(self.data, CheckpointRows)
                self.data.abandon_load()
                self._load_file.abandon()
                self._load_file = None

    # -- writes --------------------------------------------------------------------------
    def append(
        self,
        table: pa.Table,
        batch_id: str,
        buckets: np.ndarray | None = None,
        lsn: int | None = None,
    ) -> AppendResult:
        """Append rows durably. Rows of a batch id whose bucket this shard already holds are
        dropped, so a retried insert is applied once even if the shard was split or merged
        in between. ``buckets`` gives each row's bucket, and the rows must be every row of
        the batch in the buckets they span (:mod:`shardflow.storage.held`); without it the
        batch is all or nothing (replicated tables). ``lsn`` replays an insert another copy
        of this shard logged under that number (a live move that keeps the shard's files).

        Appends that arrive while another is being written are *group-committed*: the next
        writer logs them all (a file each) with one directory sync and adds their rows to
        the shard in one step; each is still acknowledged only once its entry is durable."""
        return self.append_many([(table, batch_id, buckets, lsn)])[0]

    def append_many(
        self, entries: Sequence[tuple[pa.Table, str, np.ndarray | None, int | None]]
    ) -> list[AppendResult]:
        """:meth:`append` of several (rows, batch id, buckets, LSN), in order, committed as
        one group (one directory sync): a move's target applies a catch-up round so. The
        first error of them is raised (a failing disk fails them all)."""
        pending = [
            _Pending(_cast_keeping_units(table, self.schema), batch_id, buckets, lsn)
            for table, batch_id, buckets, lsn in entries
        ]
        last = pending[-1]
        with self._queue_lock:
            self._queue.extend(pending)
        with self._lock:
            if not self._lock.wait_for(
                lambda: last.done or not self.fenced or self.retired, FENCE_WAIT_S
            ):
                with self._queue_lock:
                    self._queue = [p for p in self._queue if p not in pending]
                raise Retryable(f"{self.store.folder} is fenced for a move; retry")
            if not last.done:
                with self._queue_lock:
                    group, self._queue = self._queue, []
                self._commit(group)
        failed = next((p.error for p in pending if p.error is not None), None)
        if failed is not None:
            raise failed
        results = [p.result for p in pending if p.result is not None]
        assert len(results) == len(pending)
        return results

    def _commit(self, group: list[_Pending]) -> None:
        """Log and apply ``group`` (under the lock): admit each (duplicates, LSNs), write
        their log entries, sync the directory once, then apply them in order. Whatever
        fails, every append of the group ends with its result or its error."""
        try:
            self._apply(self._admit(group))
        except Exception as error:  # a failing disk or engine: the group's appends fail
            for entry in group:
                if entry.result is None and entry.error is None:
                    entry.error = error
        finally:
            for entry in group:
                entry.done = True
            self._lock.notify_all()

    def _admit(
        self, group: list[_Pending]
    ) -> list[tuple[_Pending, pa.Table, np.ndarray | None, Held, int]]:
        """The appends of ``group`` to apply, with their rows, buckets and LSNs: a retried
        batch's rows this shard holds already (or an earlier append of the group brought)
        are dropped."""
        admitted: list[tuple[_Pending, pa.Table, np.ndarray | None, Held, int]] = []
        added: dict[str, Held] = {}
        next_lsn = self.lsn
        for entry in group:
            if self.retired:
                entry.error = Moved(self.store.folder, -1)
                continue
            table, buckets = entry.table, entry.buckets
            known = entry.batch_id in self._applied or entry.batch_id in added
            held = self._applied.get(entry.batch_id, [])
            if entry.batch_id in added:
                held = merge_held(held, added[entry.batch_id])
            if known and (held is None or buckets is None):
                entry.result = AppendResult(next_lsn, 0, duplicate=True)
                continue
            present = claim(buckets)  # before dropping: held rows count as carried
            if buckets is not None and held:
                fresh = ~covered(buckets, held)
                if not fresh.any():
                    entry.result = AppendResult(next_lsn, 0, duplicate=True)
                    continue
                table, buckets = table.filter(pa.array(fresh)), buckets[fresh]
            next_lsn = next_lsn + 1 if entry.lsn is None else entry.lsn
            added[entry.batch_id] = merge_held(added.get(entry.batch_id, []), present)
            admitted.append((entry, table, buckets, present, next_lsn))
        return admitted

    def _apply(
        self, admitted: list[tuple[_Pending, pa.Table, np.ndarray | None, Held, int]]
    ) -> None:
        if not admitted:
            return
        written: list[tuple[int, str, int]] = []
        try:
            if self.writer:
                self.await_claim()
                for entry, table, _, present, lsn in admitted:
                    size = self.store.append_wal(
                        table, lsn, entry.batch_id, present, sync_dir=False
                    )
                    written.append((lsn, entry.batch_id, size))
                self.store.sync_dir()  # one directory sync for the whole group
                self.store.check_claim("writes")  # acknowledged only while this copy holds it
            self.data.append(
                pa.concat_tables([table for _, table, *_ in admitted]), admitted[-1][4]
            )
        except Moved:  # another copy holds the shard now: its recovery listed these entries
            # (it serves them) or leaves them out; deleting them could take rows it serves
            self.retired = True
            raise
        except Exception:  # nothing of the group is applied: its log entries go too
            for lsn, batch_id, _ in written:
                self.store.discard_wal(lsn, batch_id)
            raise
        self._wal_bytes += sum(size for *_, size in written)
        self._wal_entries += len(written)
        for entry, table, buckets, present, lsn in admitted:
            self.lsn = lsn
            if self.keeps_recent:
                self._keep_recent(lsn, table)
            self._remember(entry.batch_id, present)
            for tap in self._taps.values():
                tap.append(Change(lsn, entry.batch_id, table, buckets))
            entry.result = AppendResult(lsn, table.num_rows, duplicate=False, appended=table)
        due = self.writer and (
            self._wal_entries >= self.policy.max_wal_entries
            or self._wal_bytes >= self.policy.max_wal_bytes
        )
        if due and not self._checkpointing and not self.prepared:
            self._start_checkpoint()

    def checkpoint(self) -> None:
        """Write the shard's rows as its new base now (after one being written finishes)."""
        self.wait_for_checkpoint()
        with self._lock:
            if self.writer and self._wal_entries and not self.prepared:
                self.await_claim()
                self._checkpoint_locked()

    def _checkpoint_locked(self) -> None:
        if isinstance(self.data, CheckpointRows):
            self._write_checkpoint(self.lsn, dict(self._applied))
        else:
            self.store.write_base(self.data.read(), self.lsn, self._applied)
        self._wal_entries = 0
        self._wal_bytes = 0

    def _write_checkpoint(self, lsn: int, applied: Applied) -> None:
        """A new checkpoint file of the rows logged up to ``lsn``: the last one copied, the
        rows logged since added to it; the shard reads it from then on."""
        assert isinstance(self.data, CheckpointRows)
        written = self.store.new_checkpoint(lsn, self.data.scratch)
        data = self.data
        self._finish_file(written, lambda: data.write_checkpoint(written.path, lsn), applied)

    def _start_checkpoint(self) -> None:
        """Write the rows up to this LSN as the new base on a thread of their own, so
        appends go on meanwhile: a checkpoint held every append to the shard for as long
        (an insert p99 of seconds in ``bench/elasticity.py``). Log entries after the LSN
        stay; if the checkpoint fails they all stay, and the next append tries again. A
        checkpoint file needs nothing pinned (the rows logged up to the LSN change no
        more); a Parquet base (rows kept as Arrow) reads the rows as they are now."""
        done = (self.lsn, dict(self._applied), self._wal_entries, self._wal_bytes)
        self._wal_entries = self._wal_bytes = 0
        self._checkpointing = True
        if isinstance(self.data, CheckpointRows):
            thread = threading.Thread(target=self._checkpoint_file, args=done, daemon=True)
        else:
            pinned = _OneBatch(self.data.read())
            thread = threading.Thread(
                target=self._checkpoint_pinned, args=(pinned, *done), daemon=True
            )
        thread.name = "checkpoint"
        thread.start()

    def _checkpoint_file(self, lsn: int, applied: Applied, entries: int, size: int) -> None:
        try:
            self._write_checkpoint(lsn, applied)
        except Exception as error:  # the appends are durable in the log: retried later
            self._checkpoint_failed(error, entries, size)
        finally:
            self._checkpoint_done()

    def _checkpoint_pinned(
        self,
        pinned: BatchStream,
        lsn: int,
        applied: Applied,
        entries: int,
        size: int,
    ) -> None:
        try:
            writer = self.store.base_writer(lsn, self.schema)
            try:
                while (batch := pinned.next()) is not None:
                    writer.write(batch)
            except BaseException:
                writer.abandon()
                raise
            writer.finish(applied)
        except Exception as error:  # the appends are durable in the log: retried later
            self._checkpoint_failed(error, entries, size)
        finally:
            pinned.close()
            self._checkpoint_done()

    def _checkpoint_failed(self, error: Exception, entries: int, size: int) -> None:
        log.warning("checkpoint of %s failed: %s", self.store.folder, error)
        with self._lock:
            self._wal_entries += entries
            self._wal_bytes += size

    def _checkpoint_done(self) -> None:
        with self._lock:
            self._checkpointing = False
            self._lock.notify_all()

    # -- changes of rows (DELETE, UPDATE) ---------------------------------------------------
    def prepare_change(
        self,
        statement: str,
        change: RowRewrite,
        keeps: Callable[[pa.Table], np.ndarray] | None = None,
    ) -> tuple[int, pa.Table | None, pa.Table | None]:
        """Prepare ``statement``'s change of this shard's rows: the rows logged up to now
        as it leaves them, written durably as a file beside the checkpoints that is not in
        effect (``prep-<lsn>-<statement>``), at an LSN of its own; appends go on after it.
        Answers the rows it changes (0: nothing is prepared), for an UPDATE of the key
        the rows whose new key ``keeps`` does not keep here (new values: the statement
        inserts them where they belong, :meth:`prepare_entry`), and what the changed rows
        give back (``change.returning``; else None). It takes effect when the
        catalog holds the statement as committed: the shard made again from storage then
        starts from it (:meth:`ShardStore.recover`); until then no checkpoint is written."""
        if not isinstance(self.data, CheckpointRows) or not self.writer:
            raise StorageError(f"{self.store.folder}: rows are changed on a writing copy only")
        # the caller checked the table is at the commit the statement was planned at: every
        # change prepared here before is applied (the node applies before it switches) or
        # was aborted (this statement's own, tried again, among them)
        for earlier in list(self.prepared):
            self.discard_prepared(earlier)
        lsn, applied = self._prepared_lsn(statement)
        try:
            written = self.store.new_prepared(lsn, statement, self.data.scratch)
            try:
                done = self.data.write_change(written.path, lsn, change, keeps)
                changed = done.changed
                if changed:
                    written.finish(done.rows, done.digest, done.nbytes, applied, done.dead)
                else:
                    written.abandon()
            except BaseException:
                written.abandon()
                raise
        except BaseException:
            self._forget_prepared(statement)
            raise
        if not changed:
            self._forget_prepared(statement)
            return 0, None, None
        return changed, done.leaving, done.returned

    def prepare_entry(self, statement: str, table: pa.Table, buckets: np.ndarray) -> None:
        """Prepare rows ``statement`` adds to this shard (an UPDATE of the key brings them
        from another), durably and not in effect, at an LSN of their own: a log entry once
        the statement is committed."""
        if not self.writer:
            raise StorageError(f"{self.store.folder}: rows are changed on a writing copy only")
        lsn, _ = self._prepared_lsn(statement)
        try:
            self.store.prepare_entry(table.cast(self.schema), lsn, statement, claim(buckets))
        except BaseException:
            self.discard_prepared(statement)
            raise

    def _prepared_lsn(self, statement: str) -> tuple[int, Applied]:
        """An LSN of its own for what ``statement`` prepares here (once no checkpoint is
        being written; none is from now until it is decided), and the batches applied."""
        with self._lock:
            while self._checkpointing:
                self._lock.wait()
            if self.retired or self.fenced:
                raise Moved(self.store.folder, -1)
            self.await_claim()
            self.lsn += 1
            self.prepared[statement] = self.lsn
            return self.lsn, dict(self._applied)

    def discard_prepared(self, statement: str) -> None:
        """Drop the change ``statement`` prepared here (aborted): its file goes, and the
        shard checkpoints again once no other is prepared."""
        if statement in self.prepared:
            self.store.discard_prepared(statement)
            self._forget_prepared(statement)

    def _forget_prepared(self, statement: str) -> None:
        with self._lock:
            self.prepared.pop(statement, None)
            self._lock.notify_all()

    def adopt(self, applied: Applied) -> None:
        """Remember batches applied by the shard(s) this one replaces, so that a retry of one
        of them after the move is still applied once."""
        with self._lock:
            for batch_id, buckets in applied.items():
                self._remember(batch_id, buckets)

    # -- moving ---------------------------------------------------------------------------
    def begin_streaming_export(
        self, batch_rows: int, move_id: str = ""
    ) -> tuple[int, Applied, BatchStream]:
        """Pin a snapshot for move ``move_id``: its LSN, the batches it holds, and a stream
        of exactly its rows (a batch at a time where the row store can, as DuckDB's).
        Appends from now on are also kept for it (see :meth:`changes_since`)."""
        with self._lock:
            self._taps[move_id] = []
            stream = getattr(self.data, "stream", None)
            if stream is not None:
                pinned: BatchStream = stream(batch_rows)
                return self.lsn, dict(self._applied), pinned
            return self.lsn, dict(self._applied), _OneBatch(self.data.read())

    def changes_since(self, lsn: int, move_id: str = "") -> list[Change]:
        with self._lock:
            return [c for c in self._taps.get(move_id, []) if c.lsn > lsn]

    @property
    def exporting(self) -> bool:
        """Whether a move's export keeps the appends made since its snapshot."""
        return bool(self._taps)

    def end_export(self, move_id: str = "") -> None:
        with self._lock:
            self._taps.pop(move_id, None)

    def fence(self) -> int:
        """Hold new appends (they wait, they do not fail); returns the LSN they stop at."""
        with self._lock:
            self.fenced = True
            return self.lsn

    def unfence(self) -> None:
        with self._lock:
            self.fenced = False
            self._lock.notify_all()

    def retire(self) -> None:
        """The shard has moved: waiting and later appends are told so (``Moved``). Returns
        once a checkpoint being written is done (its rows may be dropped, its files deleted
        after this)."""
        with self._lock:
            self.retired = True
            self._taps.clear()
            self._lock.notify_all()
        self.wait_for_checkpoint()

    def wait_for_checkpoint(self) -> None:
        """Return once no checkpoint is being written in the background."""
        with self._lock:
            while self._checkpointing:
                self._lock.wait()

    def _remember(self, batch_id: str, buckets: Held) -> None:
        held = self._applied.pop(batch_id, [])
        self._applied[batch_id] = merge_held(held, buckets)
        while len(self._applied) > RECENT_BATCH_IDS:
            self._applied.popitem(last=False)

    def _keep_recent(self, lsn: int, table: pa.Table) -> None:
        self._recent.append((lsn, table))
        self._recent_bytes += table.nbytes
        while self._recent_bytes > RECENT_BYTES and self._recent:
            self._recent_bytes -= self._recent.popleft()[1].nbytes

    # -- reads ---------------------------------------------------------------------------
    def snapshot(self) -> pa.Table:
        return self.data.read()

    def rows_since(self, lsn: int) -> tuple[int, list[pa.Table] | None]:
        """The shard's LSN now, and the rows appended after ``lsn`` (in order), taken
        together: None where the rows kept (:attr:`keeps_recent`) no longer reach back
        there (the copy is built again)."""
        with self._lock:
            if lsn == self.lsn:
                return lsn, []
            if lsn > self.lsn or not self._recent or self._recent[0][0] > lsn + 1:
                return self.lsn, None
            return self.lsn, [table for at, table in self._recent if at > lsn]

    def pinned(self, batch_rows: int) -> tuple[int, BatchStream]:
        """The shard's LSN now and a stream of exactly its rows now (read while appends go
        on), taken together."""
        with self._lock:
            stream = getattr(self.data, "stream", None)
            if stream is not None:
                return self.lsn, stream(batch_rows)
            return self.lsn, _OneBatch(self.data.read())

    @property
    def rows(self) -> int:
        return self.data.rows

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


def _cast_keeping_units(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` cast to ``schema``, the batch's units (``partition.BATCH_UNITS``) kept for
    its log entry."""
    cast = table.cast(schema)
    units = (table.schema.metadata or {}).get(BATCH_UNITS)
    if units is None:
        return cast
    return cast.replace_schema_metadata({**(cast.schema.metadata or {}), BATCH_UNITS: units})
