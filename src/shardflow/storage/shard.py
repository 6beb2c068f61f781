"""A shard in memory: Arrow record batches backed by its durable :class:`ShardStore`.

Readers take an immutable snapshot (a ``pyarrow.Table`` over the current batches, no copy);
writers append under a lock. An insert is written to the log before it becomes visible and
before it is acknowledged, and a retried insert (same batch id) is applied once.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import pyarrow as pa

from shardflow.storage.shard_store import RECENT_BATCH_IDS, ShardStore

COMPACT_TAIL_BATCHES = 32
"""Small inserted batches are merged once this many pile up (scans of tiny batches are slow)."""


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


class Shard:
    """One shard's rows: a base plus inserted batches, with their log sequence number."""

    def __init__(
        self,
        store: ShardStore,
        schema: pa.Schema,
        *,
        writer: bool = True,
        policy: CheckpointPolicy | None = None,
    ) -> None:
        self.store = store
        self.schema = schema
        self.writer = writer
        self.policy = policy or CheckpointPolicy()
        self.lsn = 0
        self._base: list[pa.RecordBatch] = []
        self._tail: list[pa.RecordBatch] = []
        self._batch_ids: OrderedDict[str, None] = OrderedDict()
        self._wal_entries = 0
        self._wal_bytes = 0
        self._lock = threading.Lock()
        self._snapshot: pa.Table | None = None

    # -- life cycle ----------------------------------------------------------------------
    def recover(self, attempts: int = 5) -> None:
        """Rebuild from durable storage (retrying while a writer checkpoints under us)."""
        for attempt in range(attempts):
            try:
                recovered = self.store.recover(self.schema)
                break
            except FileNotFoundError:
                if attempt == attempts - 1:
                    raise
                time.sleep(0.05 * (attempt + 1))
        batches = [b for t in recovered.tables for b in t.to_batches() if b.num_rows]
        with self._lock:
            self._base = batches
            self._tail = []
            self.lsn = recovered.lsn
            self._batch_ids = OrderedDict.fromkeys(recovered.batch_ids)
            self._wal_entries = recovered.wal_entries
            self._wal_bytes = recovered.wal_bytes
            self._snapshot = None

    def stage(self, table: pa.Table) -> None:
        """Add rows of an initial load (not yet durable: see :meth:`commit_load`)."""
        with self._lock:
            self._base.extend(b for b in table.cast(self.schema).to_batches() if b.num_rows)
            self._snapshot = None

    def commit_load(self) -> int:
        """Write the staged rows as the durable base; returns the row count."""
        table = self.snapshot()
        if self.writer:
            self.store.write_base(table, self.lsn, list(self._batch_ids))
        return table.num_rows

    # -- writes --------------------------------------------------------------------------
    def append(self, table: pa.Table, batch_id: str) -> AppendResult:
        table = table.cast(self.schema)
        with self._lock:
            if batch_id in self._batch_ids:
                return AppendResult(self.lsn, 0, duplicate=True)
            lsn = self.lsn + 1
            if self.writer:
                self._wal_bytes += self.store.append_wal(table, lsn, batch_id)
                self._wal_entries += 1
            self.lsn = lsn
            self._tail.extend(b for b in table.to_batches() if b.num_rows)
            self._remember(batch_id)
            if len(self._tail) > COMPACT_TAIL_BATCHES:
                merged = pa.Table.from_batches(self._tail, self.schema).combine_chunks()
                self._tail = merged.to_batches()
            self._snapshot = None
            due = self.writer and (
                self._wal_entries >= self.policy.max_wal_entries
                or self._wal_bytes >= self.policy.max_wal_bytes
            )
            if due:
                self._checkpoint_locked()
        return AppendResult(lsn, table.num_rows, duplicate=False)

    def checkpoint(self) -> None:
        with self._lock:
            if self.writer and self._wal_entries:
                self._checkpoint_locked()

    def _checkpoint_locked(self) -> None:
        table = pa.Table.from_batches(self._base + self._tail, self.schema)
        self.store.write_base(table, self.lsn, list(self._batch_ids))
        self._base = self._base + self._tail
        self._tail = []
        self._wal_entries = 0
        self._wal_bytes = 0

    def _remember(self, batch_id: str) -> None:
        self._batch_ids[batch_id] = None
        while len(self._batch_ids) > RECENT_BATCH_IDS:
            self._batch_ids.popitem(last=False)

    # -- reads ---------------------------------------------------------------------------
    def snapshot(self) -> pa.Table:
        with self._lock:
            if self._snapshot is None:
                self._snapshot = pa.Table.from_batches(self._base + self._tail, self.schema)
            return self._snapshot

    @property
    def rows(self) -> int:
        return self.snapshot().num_rows

    @property
    def nbytes(self) -> int:
        return self.snapshot().nbytes
