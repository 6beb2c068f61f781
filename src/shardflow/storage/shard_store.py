"""Durable files of one shard: a checkpoint plus a write-ahead log of Arrow IPC entries.

Layout under ``<data dir>/tables/<table uid>/<shard>/``::

    ckpt-<lsn>.duckdb             every row up to and including log sequence number <lsn>, as
                                  a DuckDB database file the engine attaches as it is (a
                                  worker's shards; see ``engine/duckdb_engine.NativeRows``)
    ckpt-<lsn>.json               what that file holds (rows, checksum, size, batch ids):
                                  written before the file is renamed into place
    base-<lsn>.parquet            the same as Parquet (shards kept as Arrow, in tests and
                                  tools); the newest of the two kinds is the shard's base
    wal-<lsn>-<batch id>[.<holder>].arrow
                                  one acknowledged insert; durable before it is acknowledged
                                  (<holder>: the token of the copy that logged it)
    holder.json                   the copies that claimed to write the shard, the last one
                                  its writer now (see below)
    prep-<lsn>-<statement>.duckdb the shard's rows up to <lsn> as a statement that changes
    prep-<lsn>-<statement>.json   rows (DELETE, UPDATE) would leave them, prepared and not in
                                  effect: it becomes ckpt-<lsn> once the catalog holds the
                                  statement as committed (see ``Shard.prepare_change``)
    prep-<lsn>-<statement>.arrow  rows such a statement adds (an UPDATE of the key moves
                                  them from another shard): wal-<lsn>-<statement> then

Each entry is its own file, written whole and renamed into place (or put as one object on
an object store), so recovery never sees a torn entry. A checkpoint writes a new base and
only then deletes the entries and the older base it covers: a crash at any point leaves a
state from which :meth:`ShardStore.recover` rebuilds every acknowledged row exactly once.

A checkpoint file is immutable once in place: a restart, a failover and a live move's
target open it where it lies (a copy first, where the data directory is not a local
folder) and replay the log entries after its LSN; nothing is decoded and loaded again. The
next checkpoint starts from a copy of it (a file copy) and adds the rows logged since.

**One writer per shard, fenced by its epoch.** A copy of the shard that is to write it (a
worker given the shard by the catalog, a move's target) first *claims* it: it adds itself
to ``holder.json`` with the routing epoch that gave it the shard, and only then lists the
folder to recover; once recovered it records the LSN it reached (``start_lsn``). A copy
acknowledges an insert only after its log entry is durable *and* the holder record still
names it, and a checkpoint takes effect only under the same check; a read is refused once
another copy holds the shard. So a worker cut off from the coordinator, whose shards were
given to others meanwhile, takes no write and serves no read for them: its entry was
either listed by the new holder (and is served there) or came after the listing, and then
it was not acknowledged and recovery leaves it out (an entry of an older holder past a
later holder's ``start_lsn``). The cluster's lease (``catalog/lease.py``) fences whole
clusters; this fences copies of one shard.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
import re
import secrets
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from shardflow.catalog.store import UNFENCED_VARIABLE, DataDir, fsync_dir
from shardflow.errors import Moved, StorageError
from shardflow.storage.held import Held, merge_held
from shardflow.storage.holds import ARCHIVE_FOLDER, held, keeping_log

log = logging.getLogger(__name__)

RECENT_BATCH_IDS = 4096
"""How many insert batch ids a shard remembers (and persists) to make retries idempotent."""

Applied = dict[str, Held]
"""Per recent insert batch id, the bucket ranges of it this shard holds (None: all of it),
kept by range because a split or merge can bring rows of one batch together from several
shards (:mod:`shardflow.storage.held`)."""


LOGGED_AT = b"shardflow.logged_at"
"""An entry's schema metadata: when it was written (seconds since the epoch), which a
restore to a point in time cuts by (entries of 0.2.0 and before have none)."""

HOLDER_FILE = "holder.json"
HOLDERS_KEPT = 16
"""Claims a shard's holder record keeps (older ones name no entry recovery can still see:
a checkpoint since has covered them, or they are in every later holder's recovered part)."""


def unfenced(what: str) -> bool:
    """Whether the test-only hook (``UNFENCED_VARIABLE``, a comma list) switched the fence
    of ``what`` off: ``writes`` (an insert is acknowledged without the check), ``reads``,
    ``checkpoints`` and ``recovery`` (an older holder's late entries are recovered),
    ``commits`` (a worker serves a fragment or insert routed at another commit of a table,
    ``TRUNCATE``), ``atomic`` (the coordinator commits a change of rows some of whose parts
    failed to prepare: the parts prepared take effect), ``behind`` (a copy behind its
    files prepares a change: see :meth:`ShardStore.new_prepared`), ``listing`` (see
    ``DataDir.list``), ``backup-hold`` (a checkpoint deletes what it covers while a
    backup copies the files: ``storage/holds.py``), ``keep-log`` (a checkpoint deletes
    what it covers where the log is to be kept) and ``prepared`` (a catalog change written
    ahead is committed unchecked: ``CatalogStore.save``). Their tests must then fail."""
    return what in os.environ.get(UNFENCED_VARIABLE, "").split(",")


@dataclass(frozen=True)
class Holder:
    """A copy of a shard that claimed to write it."""

    node: str
    epoch: int
    """The routing epoch of the catalog that gave it the shard."""
    token: str
    """Tells this copy from any other, on the same node too (a worker started again)."""
    start_lsn: int | None = None
    """The LSN it recovered to; None until it has."""


CHECKPOINT_FAULT_VARIABLE = "SHARDFLOW_TEST_FAULT_CHECKPOINT"
"""Tests only: "torn" cuts every checkpoint file short once it is in place, "stale" puts
the shard's previous checkpoint file in its place (where there is one): recovery and
VERIFY must refuse to serve either."""


@dataclass(frozen=True)
class CheckpointMeta:
    """What a checkpoint file holds, kept beside it (``ckpt-<lsn>.json``)."""

    lsn: int
    rows: int
    digest: int
    """The sum of DuckDB's row hashes over its rows (``DuckDBEngine.checksum``)."""
    nbytes: int
    """The rows' size as Arrow (what placement weighs)."""
    file_bytes: int
    """The file's size: a file cut short is refused."""
    applied: Applied
    dead: int = 0
    """Rows deleted in place whose slots the file may still hold (a DELETE run in a copy of
    the file; at most this many: DuckDB's own checkpoint vacuums a row group where enough
    went): once they could be many, the next change or checkpoint writes the rows whole."""


@dataclass(frozen=True)
class Recovered:
    tables: list[pa.Table]
    """The Parquet base's rows (if the base is one) and each log entry's after it."""
    lsns: list[int]
    """Per table, the LSN it holds the rows of (a Parquet base: its LSN)."""
    lsn: int
    applied: Applied
    wal_entries: int
    wal_bytes: int
    checkpoint: str | None = None
    """The checkpoint file the shard starts from (None: a Parquet base, or none)."""
    meta: CheckpointMeta | None = None
    prepared: dict[str, int] = dataclasses.field(default_factory=dict)
    """Changes of rows prepared and not decided, by statement: the LSN each holds."""


def shard_folder(data_dir: DataDir, table_uid: str, shard: str) -> str:
    return data_dir.path("tables", table_uid, shard)


class ShardStore:
    """Reads and writes the durable files of one shard."""

    def __init__(self, data_dir: DataDir, table_uid: str, shard: str) -> None:
        self._dir = data_dir
        self.table_uid = table_uid
        self.folder = shard_folder(data_dir, table_uid, shard)
        data_dir.fs.create_dir(self.folder, recursive=True)
        self.claimed: Holder | None = None
        """This copy's claim to write the shard (None: it claimed none, and checks none)."""
        self._still_ours: tuple[int, int, int] | None = None
        """The holder file (inode, change time, size) last found to name this copy."""

    # -- the shard's one writer ------------------------------------------------------------
    def claim(self, node: str, epoch: int | None, start_lsn: int | None = None) -> Holder:
        """Make this copy the shard's writer, before it lists the folder (:meth:`recover`):
        any copy that wrote it before is refused at its next check. ``epoch`` is the
        routing epoch that gave ``node`` the shard; a claim made at a lower epoch than the
        holder's is refused (``Moved``: a stale catalog). None succeeds the holder at its
        epoch (a move's target, its source fenced already)."""
        holders = self.holders()
        if holders and epoch is not None and holders[-1].epoch > epoch:
            raise Moved(f"{self.folder} (held by {holders[-1].node})", epoch)
        if epoch is None:
            epoch = holders[-1].epoch if holders else 0
        claim = Holder(node, epoch, secrets.token_hex(8), start_lsn)
        self._write_holders([*holders, claim])
        self.claimed = claim
        return claim

    def settle_claim(self, lsn: int) -> None:
        """Record the LSN this copy recovered to (recovery leaves out what older holders
        logged after it); refused (``Moved``) if another copy claimed the shard since."""
        if self.claimed is None:
            return
        holders = self.holders()
        if not holders or holders[-1].token != self.claimed.token:
            raise self._lost(holders)
        self.claimed = dataclasses.replace(self.claimed, start_lsn=lsn)
        self._write_holders([*holders[:-1], self.claimed])

    def check_claim(self, what: str, *, later_only: bool = False) -> None:
        """Raise ``Moved`` unless this copy still holds the shard (it claimed none: no
        check). ``what`` names the fence (writes, reads, checkpoints) for the test hook. With
        ``later_only`` only a holder given the shard at a later epoch counts (a failover):
        the target of a live move succeeds its source at the source's epoch, and the fenced
        source still holds every row until the switch (or serves on if the move rolls
        back). A local holder file unchanged since it was last found ours is not read
        again."""
        if self.claimed is None or unfenced(what):
            return
        path = self._path(HOLDER_FILE)
        stamp = None
        if self._dir.local:
            try:
                found = os.stat(path)
            except FileNotFoundError:
                raise self._lost([]) from None
            stamp = (found.st_ino, found.st_ctime_ns, found.st_size)
            if stamp == self._still_ours:
                return
        holders = self.holders()
        if not holders:
            raise self._lost(holders)
        if holders[-1].token != self.claimed.token:
            if not later_only or holders[-1].epoch > self.claimed.epoch:
                raise self._lost(holders)
            return  # succeeded by a move's target: not cached, asked again next time
        self._still_ours = stamp

    def holders(self) -> list[Holder]:
        """The claims on the shard, oldest first (the last one holds it)."""
        try:
            record = json.loads(self._dir.read(self._path(HOLDER_FILE)))
        except FileNotFoundError:
            return []
        return [Holder(**h) for h in record["holders"]]

    def _write_holders(self, holders: list[Holder]) -> None:
        record = {"holders": [dataclasses.asdict(h) for h in holders[-HOLDERS_KEPT:]]}
        self._dir.write_atomic(self._path(HOLDER_FILE), json.dumps(record).encode())
        self._still_ours = None

    def _lost(self, holders: list[Holder]) -> Moved:
        assert self.claimed is not None
        now = f"held by {holders[-1].node} at epoch {holders[-1].epoch}" if holders else "dropped"
        return Moved(f"{self.folder} ({now})", self.claimed.epoch)

    def append_wal(
        self,
        table: pa.Table,
        lsn: int,
        batch_id: str,
        buckets: Held = None,
        *,
        sync_dir: bool = True,
    ) -> int:
        """Persist one insert (and which bucket ranges of its batch it holds); returns the bytes
        written. With ``sync_dir`` False the entry's file is synced but not the folder's
        listing: the caller calls :meth:`sync_dir` once for several entries before any of
        them is acknowledged (a group commit)."""
        return self._write_entry(self._entry_name(lsn, batch_id), table, buckets, sync_dir)

    def _write_entry(self, name: str, table: pa.Table, buckets: Held, sync_dir: bool) -> int:
        metadata = {
            b"shardflow.buckets": json.dumps(buckets).encode(),
            LOGGED_AT: repr(time.time()).encode(),
        }
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        payload = sink.getvalue().to_pybytes()
        self._dir.write_atomic(self._path(name), payload, sync_dir=sync_dir)
        return len(payload)

    def discard_wal(self, lsn: int, batch_id: str) -> None:
        """Remove a log entry that was written but not acknowledged (best effort: its group
        failed), so that a restart does not bring back rows the client was told failed."""
        try:
            self._dir.delete(self._path(self._entry_name(lsn, batch_id)))
        except OSError:
            pass

    def _entry_name(self, lsn: int, batch_id: str) -> str:
        """A log entry's file name: with the token of the copy that holds the shard, so
        that two copies never write one file (a retry of one batch, logged under one LSN
        by a cut-off copy and by its new holder)."""
        holder = f".{self.claimed.token}" if self.claimed is not None else ""
        return f"wal-{lsn:012d}-{batch_id}{holder}.arrow"

    def sync_dir(self) -> None:
        """Make the files written in this shard's folder so far part of its durable listing."""
        self._dir.sync_dir(self.folder)

    def write_base(self, table: pa.Table, lsn: int, applied: Mapping[str, Held]) -> None:
        """Make ``table`` the shard's content at ``lsn``, then drop what it supersedes."""
        writer = self.base_writer(lsn, table.schema)
        writer.write(table)
        writer.finish(applied)

    def base_writer(self, lsn: int, schema: pa.Schema) -> BaseWriter:
        """A base written piece by piece (a load or a copy streams through it); it becomes
        the shard's content at ``lsn`` when finished, not before."""
        return BaseWriter(self, lsn, schema)

    def _supersede(self, lsn: int, keep: str) -> None:
        if held(self._dir):  # a backup is copying the files: the next checkpoint deletes them
            return
        kept = {keep, _meta_name(keep)}
        archiving = keeping_log(self._dir) is not None and not unfenced("keep-log")
        archive = self._archive() if archiving else None
        superseded = _superseded(self.holders()) if archive is not None else {}
        for name in self._dir.list(self.folder):
            covered = _lsn_of(name)
            if covered is None or name in kept or covered > lsn:
                continue
            if archive is not None and _is_log_entry(name):
                writer = _entry_of(name)[1]
                if covered <= superseded.get(writer, covered) or unfenced("recovery"):
                    self._dir.check_owner()  # as a delete: only while our cluster owns it
                    self._dir.fs.move(self._path(name), f"{archive}/{name}")
                    continue
            self._dir.delete(self._path(name))

    def _archive(self) -> str:
        """The folder the log entries a checkpoint covers go to while the log is kept
        (``storage/holds.py``)."""
        shard = self.folder.rsplit("/", 1)[-1]
        folder = self._dir.path(ARCHIVE_FOLDER, self.table_uid, shard)
        self._dir.fs.create_dir(folder, recursive=True)
        return folder

    def recover(
        self, schema: pa.Schema, upto: int | None = None, committed: Collection[str] = ()
    ) -> Recovered:
        """The shard's durable state: its newest base (a checkpoint file, named, or a
        Parquet base, read) and the log entries after it. With ``upto`` no entry past it,
        unless the base itself is newer (a live move's target: the source's pinned LSN;
        what came after reaches it from the source). A prepared change whose statement is
        in ``committed`` takes effect first (its file becomes the newest checkpoint); the
        others are answered as pending, and the LSN answered is past them (an append must
        not take an LSN a prepared change holds)."""
        names = self._dir.list(self.folder)
        prepared = _prepared_in(names)
        if any(statement in committed for statement in prepared):
            for statement in prepared:
                if statement in committed:
                    self.commit_prepared(statement)
            names = self._dir.list(self.folder)
            prepared = _prepared_in(names)
        bases = sorted(
            (lsn, name)
            for name in names
            if (lsn := _lsn_of(name)) is not None
            and (_is_parquet_base(name) or _is_checkpoint(name))
        )
        tables: list[pa.Table] = []
        lsns: list[int] = []
        lsn = 0
        applied: Applied = {}
        checkpoint: str | None = None
        meta: CheckpointMeta | None = None
        if bases:
            lsn, base = bases[-1]
            if _is_checkpoint(base):
                checkpoint = self._path(base)
                meta = self.checkpoint_meta(base)
                applied = dict(meta.applied)
            else:
                with self._dir.fs.open_input_file(self._path(base)) as handle:
                    parquet = pq.ParquetFile(handle)
                    table = parquet.read()
                    found = parquet.metadata.metadata or {}
                applied = json.loads(found.get(b"shardflow.applied", b"{}"))
                tables.append(table.replace_schema_metadata(None).cast(schema))
                lsns.append(lsn)
        last = None if upto is None else max(upto, lsn)
        wal_entries = 0
        wal_bytes = 0
        superseded = _superseded(self.holders())
        for name in sorted(n for n in names if n.startswith("wal-") and n.endswith(".arrow")):
            entry_lsn = _lsn_of(name)
            if entry_lsn is None or entry_lsn <= lsn:
                continue
            if last is not None and entry_lsn > last:
                break
            batch_id, writer = _entry_of(name)
            if entry_lsn > superseded.get(writer, entry_lsn) and not unfenced("recovery"):
                continue  # logged by a holder after a later one took over: never acknowledged
            payload = self._dir.read(self._path(name))
            with pa.ipc.open_stream(io.BytesIO(payload)) as reader:
                entry = reader.read_all()
            tables.append(entry.replace_schema_metadata(None).cast(schema))
            lsns.append(entry_lsn)
            buckets = json.loads((entry.schema.metadata or {}).get(b"shardflow.buckets", b"null"))
            applied[batch_id] = merge_held(applied.get(batch_id, []), buckets)
            lsn = entry_lsn
            wal_entries += 1
            wal_bytes += len(payload)
        recent = dict(list(applied.items())[-RECENT_BATCH_IDS:])
        if upto is None:
            lsn = max([lsn, *prepared.values()])
        return Recovered(
            tables, lsns, lsn, recent, wal_entries, wal_bytes, checkpoint, meta, prepared
        )

    # -- prepared changes of rows ----------------------------------------------------------
    def new_prepared(self, lsn: int, statement: str, scratch: str) -> CheckpointFile:
        """A file of the shard's rows up to ``lsn`` as ``statement`` changes them, to write:
        durable at :meth:`CheckpointFile.finish`, in effect only at :meth:`commit_prepared`."""
        self._refuse_behind(lsn, statement)
        return CheckpointFile(self, lsn, scratch, prepared=statement)

    def prepare_entry(self, table: pa.Table, lsn: int, statement: str, buckets: Held) -> None:
        """Rows ``statement`` adds to the shard (an UPDATE of the key brings them from
        another), written durably as a log entry not in effect (``prep-<lsn>-<statement>
        .arrow``): it becomes the log entry ``wal-<lsn>-<statement>`` at
        :meth:`commit_prepared`."""
        self._refuse_behind(lsn, statement)
        self._write_entry(_prepared_name(lsn, statement, ENTRY), table, buckets, True)

    def _refuse_behind(self, lsn: int, statement: str) -> None:
        """Refuse to prepare at ``lsn`` where a checkpoint at or past it is in place: the
        copy preparing was made from files older than these (its change would be computed
        from rows before a committed one, and once committed, would take that checkpoint's
        place). Raises ``StorageError``; nothing is written."""
        newest = max(
            (
                found
                for name in self._dir.list(self.folder)
                if (_is_checkpoint(name) or _is_parquet_base(name))
                and (found := _lsn_of(name)) is not None
            ),
            default=0,
        )
        if newest >= lsn and not unfenced("behind"):
            raise StorageError(
                f"{self.folder}: a checkpoint at LSN {newest} is in place, past the rows "
                f"this copy holds (LSN {lsn - 1}): it is behind its files, and prepares "
                f"nothing for {statement}; it is made again from them at the next catalog "
                "change, and the statement can be tried again"
            )

    def commit_prepared(self, statement: str) -> bool:
        """Put the change ``statement`` prepared in effect: its file becomes the shard's
        newest checkpoint (its record first, then the file), and what that covers goes; the
        rows it adds become a log entry after it. Only while this copy holds the shard.
        False where nothing is prepared here."""
        found = sorted(
            (lsn, name)
            for name in self._dir.list(self.folder)
            if (lsn := _prepared_lsn(name, statement)) is not None
        )
        if not found:
            return False
        self._dir.check_owner()
        self.check_claim("checkpoints")
        for lsn, name in found:
            if name.endswith(ENTRY):
                self._dir.fs.move(
                    self._path(name), self._path(f"wal-{lsn:012d}-{statement}{ENTRY}")
                )
                self.sync_dir()
                continue
            final = _checkpoint_name(lsn)
            self._dir.write_atomic(
                self._path(_meta_name(final)), self._dir.read(self._path(_meta_name(name)))
            )
            self._dir.fs.move(self._path(name), self._path(final))
            self.sync_dir()
            self._dir.delete(self._path(_meta_name(name)))
            self._supersede(lsn, final)
        return True

    def discard_prepared(self, statement: str) -> None:
        """Forget the change ``statement`` prepared here (it was aborted, or is prepared
        again)."""
        for name in self._dir.list(self.folder):
            if _prepared_lsn(name, statement) is not None:
                if not name.endswith(ENTRY):
                    self._dir.delete(self._path(_meta_name(name)), fenced=False)
                self._dir.delete(self._path(name), fenced=False)

    # -- checkpoint files ----------------------------------------------------------------
    def checkpoint_meta(self, name: str) -> CheckpointMeta:
        """What the checkpoint file ``name`` holds; ``StorageError`` if its record is
        missing or does not match the file (cut short)."""
        record_path = self._path(_meta_name(name))
        found = self._dir.fs.get_file_info(self._path(name))
        if found.type == pafs.FileType.NotFound:  # superseded since it was listed
            raise FileNotFoundError(self._path(name))
        try:
            record = json.loads(self._dir.read(record_path))
            meta = CheckpointMeta(**record)
        except FileNotFoundError:
            if self._dir.fs.get_file_info(self._path(name)).type == pafs.FileType.NotFound:
                raise  # both went meanwhile: superseded, list again
            raise StorageError(f"checkpoint {self._path(name)} has no record beside it") from None
        except (ValueError, TypeError) as error:
            raise StorageError(f"checkpoint record {record_path} is damaged: {error}") from None
        size = found.size
        if size != meta.file_bytes:
            raise StorageError(
                f"checkpoint {self._path(name)} is damaged: {size} bytes, written as "
                f"{meta.file_bytes}; not served (restore the file, or drop the table)"
            )
        return meta

    def local_checkpoint(self, path: str, scratch: str) -> str:
        """A local path to open the checkpoint file ``path`` at: itself in a local data
        directory, else a copy in the local folder ``scratch``."""
        if self._dir.local:
            return path
        os.makedirs(scratch, exist_ok=True)
        local = os.path.join(
            scratch, f"{self.table_uid}-{os.path.basename(self.folder)}-{os.path.basename(path)}"
        )
        pafs.copy_files(
            path,
            local,
            source_filesystem=self._dir.fs,
            destination_filesystem=pafs.LocalFileSystem(),
        )
        return local

    def new_checkpoint(self, lsn: int, scratch: str) -> CheckpointFile:
        """A checkpoint file at ``lsn`` to write (a local path; ``scratch`` holds it where
        the data directory is not a local folder); it becomes the shard's base at
        :meth:`CheckpointFile.finish`."""
        return CheckpointFile(self, lsn, scratch)

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

    def finish(self, applied: Mapping[str, Held]) -> None:
        recent = dict(list(applied.items())[-RECENT_BATCH_IDS:])
        self.writer.add_key_value_metadata({"shardflow.applied": json.dumps(recent)})
        try:  # the base takes effect below: only while our cluster owns the directory and
            self.store._dir.check_owner()  # this copy still holds the shard (else it would
            self.store.check_claim("checkpoints")  # delete the new holder's log entries)
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


class CheckpointFile:
    """A checkpoint file being written (by the engine, at :attr:`path`): it becomes the
    shard's base at :meth:`finish`, durably and atomically, not before."""

    def __init__(
        self, store: ShardStore, lsn: int, scratch: str, prepared: str | None = None
    ) -> None:
        self.store = store
        self.lsn = lsn
        self.prepared = prepared
        """The statement whose change of rows this file prepares (None: a checkpoint)."""
        self.name = _checkpoint_name(lsn) if prepared is None else _prepared_name(lsn, prepared)
        self.final = store._path(self.name)
        if store._dir.local:
            self.path = f"{self.final}.tmp-{os.getpid()}-{id(self)}"
        else:
            os.makedirs(scratch, exist_ok=True)
            self.path = os.path.join(scratch, f"{store.table_uid}-{self.name}.{id(self)}")
        self.opened_at = self.final if store._dir.local else self.path
        """Where the shard opens the file once finished (kept local where the data
        directory is not)."""

    def finish(
        self, rows: int, digest: int, nbytes: int, applied: Applied, dead: int = 0
    ) -> CheckpointMeta:
        """Make the written file the shard's base: its record first, then the file
        (renamed, or put whole on an object store), then what it supersedes goes. Only
        while our cluster owns the directory and this copy holds the shard (else it would
        delete the new holder's log entries)."""
        store = self.store
        data_dir = store._dir
        recent = dict(list(applied.items())[-RECENT_BATCH_IDS:])
        try:
            with open(self.path, "rb+") as handle:
                os.fsync(handle.fileno())
            size = os.path.getsize(self.path)
            meta = CheckpointMeta(self.lsn, rows, digest, nbytes, size, recent, dead)
            data_dir.check_owner()
            store.check_claim("checkpoints")
            data_dir.write_atomic(
                store._path(_meta_name(self.name)), json.dumps(dataclasses.asdict(meta)).encode()
            )
            if data_dir.local:
                os.replace(self.path, self.final)
                fsync_dir(store.folder)
            else:
                pafs.copy_files(
                    self.path,
                    self.final,
                    source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=data_dir.fs,
                )
        except BaseException:
            self.abandon()
            raise
        if self.prepared is None:  # a prepared change takes effect at its commit
            _inject_checkpoint_fault(store, self.final)
            store._supersede(self.lsn, self.name)
        return meta

    def abandon(self) -> None:
        for path in (self.path, f"{self.path}.wal"):
            with contextlib.suppress(OSError):
                os.unlink(path)


def read_checkpoint(path: str) -> pa.Table:
    """The rows of a checkpoint file (a local path), read whole into Arrow: for row stores
    that hold Arrow, and for tools; a worker attaches the file instead."""
    import duckdb  # only where a checkpoint is read whole, not by every importer

    connection = duckdb.connect(path, read_only=True)
    try:
        return connection.sql('SELECT * FROM main."rows"').to_arrow_table()
    finally:
        connection.close()


def _inject_checkpoint_fault(store: ShardStore, path: str) -> None:
    """The test-only hook of :data:`CHECKPOINT_FAULT_VARIABLE` (local data directories)."""
    fault = os.environ.get(CHECKPOINT_FAULT_VARIABLE, "")
    if not fault or not store._dir.local:
        return
    if fault == "torn":
        with open(path, "rb+") as handle:
            handle.truncate(os.path.getsize(path) // 2)
    elif fault == "stale":
        older = sorted(
            n for n in store._dir.list(store.folder) if _is_checkpoint(n) and store._path(n) < path
        )
        if older:
            with open(store._path(older[-1]), "rb") as src:
                content = src.read()
            with open(path, "wb") as out:
                out.write(content)
            meta_path = store._path(_meta_name(os.path.basename(path)))
            meta = json.loads(store._dir.read(meta_path))
            meta["file_bytes"] = len(content)  # the record fits the file: only its LSN lies
            store._dir.write_atomic(meta_path, json.dumps(meta).encode())
    log.warning("test fault %s injected into checkpoint %s", fault, path)


def _superseded(holders: list[Holder]) -> dict[str, int]:
    """Per holder's token, the LSN past which its entries are not the shard's: the lowest
    ``start_lsn`` of the holders that claimed the shard after it."""
    limits: dict[str, int] = {}
    lowest: int | None = None
    for holder in reversed(holders):
        if lowest is not None:
            limits[holder.token] = lowest
        if holder.start_lsn is not None:
            lowest = holder.start_lsn if lowest is None else min(lowest, holder.start_lsn)
    return limits


def _entry_of(name: str) -> tuple[str, str]:
    """A log entry's batch id and the token of the holder that logged it ("" if none)."""
    found = _ENTRY.fullmatch(name)
    assert found is not None, name
    return found["batch"], found["holder"] or ""


_ENTRY = re.compile(r"wal-\d{12}-(?P<batch>.+?)(?:\.(?P<holder>[0-9a-f]{16}))?\.arrow")


ENTRY = ".arrow"
"""The suffix of a prepared log entry (a prepared checkpoint file's is ``.duckdb``)."""
_PREPARED = re.compile(
    r"prep-(?P<lsn>\d{12})-(?P<statement>[0-9A-Za-z_-]+)(?P<kind>\.duckdb|\.arrow)"
)


def _prepared_name(lsn: int, statement: str, kind: str = ".duckdb") -> str:
    return f"prep-{lsn:012d}-{statement}{kind}"


def _prepared_lsn(name: str, statement: str) -> int | None:
    """The LSN of the change ``statement`` prepared, where ``name`` is its file."""
    found = _PREPARED.fullmatch(name)
    return int(found["lsn"]) if found and found["statement"] == statement else None


def _prepared_in(names: list[str]) -> dict[str, int]:
    """The changes prepared among ``names``: per statement, the highest LSN it holds."""
    prepared: dict[str, int] = {}
    for name in names:
        found = _PREPARED.fullmatch(name)
        if found is not None:
            lsn = int(found["lsn"])
            prepared[found["statement"]] = max(lsn, prepared.get(found["statement"], lsn))
    return prepared


def _is_log_entry(name: str) -> bool:
    return name.startswith("wal-") and name.endswith(".arrow") and ".tmp" not in name


def _checkpoint_name(lsn: int) -> str:
    return f"ckpt-{lsn:012d}.duckdb"


def _is_parquet_base(name: str) -> bool:
    return name.startswith("base-") and name.endswith(".parquet")


def _is_checkpoint(name: str) -> bool:
    return name.startswith("ckpt-") and name.endswith(".duckdb")


def _meta_name(checkpoint: str) -> str:
    return checkpoint.removesuffix(".duckdb") + ".json"


def _lsn_of(name: str) -> int | None:
    for prefix in ("base-", "wal-", "ckpt-"):
        if name.startswith(prefix):
            digits = name[len(prefix) : len(prefix) + 12]
            return int(digits) if digits.isdigit() else None
    return None
