"""Durable files of one shard: a Parquet base plus a write-ahead log of Arrow IPC entries.

Layout under ``<data dir>/tables/<table uid>/<shard>/``::

    base-<lsn>.parquet            every row up to and including log sequence number <lsn>
    wal-<lsn>-<batch id>.arrow    one acknowledged insert; durable before it is acknowledged

Each entry is its own file, written whole and renamed into place (or put as one object on
an object store), so recovery never sees a torn entry. A checkpoint writes a new base and
only then deletes the entries and the older base it covers: a crash at any point leaves a
state from which :meth:`ShardStore.recover` rebuilds every acknowledged row exactly once.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from shardflow.catalog.store import DataDir, fsync_dir

RECENT_BATCH_IDS = 4096
"""How many insert batch ids a shard remembers (and persists) to make retries idempotent."""

Applied = dict[str, list[int] | None]
"""Per recent insert batch id, the buckets of it this shard holds (None: all of it). Kept per
bucket because a split or merge can bring rows of one batch together from several shards."""


@dataclass(frozen=True)
class Recovered:
    tables: list[pa.Table]
    lsn: int
    applied: Applied
    wal_entries: int
    wal_bytes: int


def shard_folder(data_dir: DataDir, table_uid: str, shard: str) -> str:
    return data_dir.path("tables", table_uid, shard)


class ShardStore:
    """Reads and writes the durable files of one shard."""

    def __init__(self, data_dir: DataDir, table_uid: str, shard: str) -> None:
        self._dir = data_dir
        self.table_uid = table_uid
        self.folder = shard_folder(data_dir, table_uid, shard)
        data_dir.fs.create_dir(self.folder, recursive=True)

    def append_wal(
        self,
        table: pa.Table,
        lsn: int,
        batch_id: str,
        buckets: list[int] | None = None,
        *,
        sync_dir: bool = True,
    ) -> int:
        """Persist one insert (and which buckets of its batch it holds); returns the bytes
        written. With ``sync_dir`` False the entry's file is synced but not the folder's
        listing: the caller calls :meth:`sync_dir` once for several entries before any of
        them is acknowledged (a group commit)."""
        metadata = {b"shardflow.buckets": json.dumps(buckets).encode()}
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        payload = sink.getvalue().to_pybytes()
        self._dir.write_atomic(
            self._path(f"wal-{lsn:012d}-{batch_id}.arrow"), payload, sync_dir=sync_dir
        )
        return len(payload)

    def discard_wal(self, lsn: int, batch_id: str) -> None:
        """Remove a log entry that was written but not acknowledged (best effort: its group
        failed), so that a restart does not bring back rows the client was told failed."""
        try:
            self._dir.delete(self._path(f"wal-{lsn:012d}-{batch_id}.arrow"))
        except OSError:
            pass

    def sync_dir(self) -> None:
        """Make the files written in this shard's folder so far part of its durable listing."""
        self._dir.sync_dir(self.folder)

    def write_base(
        self, table: pa.Table, lsn: int, applied: Mapping[str, list[int] | None]
    ) -> None:
        """Make ``table`` the shard's content at ``lsn``, then drop what it supersedes."""
        writer = self.base_writer(lsn, table.schema)
        writer.write(table)
        writer.finish(applied)

    def base_writer(self, lsn: int, schema: pa.Schema) -> BaseWriter:
        """A base written piece by piece (a load or a copy streams through it); it becomes
        the shard's content at ``lsn`` when finished, not before."""
        return BaseWriter(self, lsn, schema)

    def _supersede(self, lsn: int, keep: str) -> None:
        for name in self._dir.list(self.folder):
            covered = _lsn_of(name)
            if covered is not None and name != keep and covered <= lsn:
                self._dir.delete(self._path(name))

    def recover(self, schema: pa.Schema) -> Recovered:
        names = self._dir.list(self.folder)
        bases = sorted(n for n in names if n.startswith("base-") and n.endswith(".parquet"))
        tables: list[pa.Table] = []
        lsn = 0
        applied: Applied = {}
        if bases:
            base = bases[-1]
            lsn = _lsn_of(base) or 0
            with self._dir.fs.open_input_file(self._path(base)) as handle:
                parquet = pq.ParquetFile(handle)
                table = parquet.read()
                found = parquet.metadata.metadata or {}
            applied = json.loads(found.get(b"shardflow.applied", b"{}"))
            tables.append(table.replace_schema_metadata(None).cast(schema))
        wal_entries = 0
        wal_bytes = 0
        for name in sorted(n for n in names if n.startswith("wal-") and n.endswith(".arrow")):
            entry_lsn = _lsn_of(name)
            if entry_lsn is None or entry_lsn <= lsn:
                continue
            payload = self._dir.read(self._path(name))
            with pa.ipc.open_stream(io.BytesIO(payload)) as reader:
                entry = reader.read_all()
            tables.append(entry.replace_schema_metadata(None).cast(schema))
            buckets = json.loads((entry.schema.metadata or {}).get(b"shardflow.buckets", b"null"))
            batch_id = name[len("wal-000000000000-") : -len(".arrow")]
            applied[batch_id] = merge_buckets(applied.get(batch_id, []), buckets)
            lsn = entry_lsn
            wal_entries += 1
            wal_bytes += len(payload)
        recent = dict(list(applied.items())[-RECENT_BATCH_IDS:])
        return Recovered(tables, lsn, recent, wal_entries, wal_bytes)

    def destroy(self) -> None:
        self._dir.delete_dir(self.folder)

    def _path(self, name: str) -> str:
        return f"{self.folder}/{name}"


class BaseWriter:
    """Streams rows into a shard's next Parquet base; atomic and durable on ``finish``."""

    def __init__(self, store: ShardStore, lsn: int, schema: pa.Schema) -> None:
        self.store = store
        self.lsn = lsn
        self.name = f"base-{lsn:012d}.parquet"
        self.path = store._path(self.name)
        data_dir = store._dir
        if data_dir.local:
            self.target = f"{self.path}.tmp-{os.getpid()}-{id(self)}"
            self.writer = pq.ParquetWriter(self.target, schema, compression="lz4")
        else:  # an object store makes the object appear whole at close
            self.target = self.path
            self.writer = pq.ParquetWriter(
                self.path, schema, compression="lz4", filesystem=data_dir.fs
            )

    def write(self, table: pa.Table) -> None:
        if table.num_rows:
            self.writer.write_table(table)

    def finish(self, applied: Mapping[str, list[int] | None]) -> None:
        recent = dict(list(applied.items())[-RECENT_BATCH_IDS:])
        self.writer.add_key_value_metadata({"shardflow.applied": json.dumps(recent)})
        try:
            self.store._dir.check_owner()  # the base takes effect below: only while we own it
        except Exception:
            self.abandon()
            raise
        self.writer.close()
        if self.target != self.path:
            with open(self.target, "rb+") as handle:
                os.fsync(handle.fileno())
            os.replace(self.target, self.path)
            fsync_dir(self.store.folder)
        self.store._supersede(self.lsn, self.name)

    def abandon(self) -> None:
        self.writer.close()
        self.store._dir.delete(self.target, fenced=False)


def merge_buckets(held: list[int] | None, more: list[int] | None) -> list[int] | None:
    """Buckets of a batch held after adding ``more`` (None stands for every bucket)."""
    if held is None or more is None:
        return None
    return sorted(set(held) | set(more))


def _lsn_of(name: str) -> int | None:
    for prefix in ("base-", "wal-"):
        if name.startswith(prefix):
            digits = name[len(prefix) : len(prefix) + 12]
            return int(digits) if digits.isdigit() else None
    return None
