"""Durable files of one shard: a Parquet base plus a write-ahead log of Arrow IPC entries.

Layout under ``<data dir>/tables/<table uid>/<shard>/``::

    base-<lsn>.parquet            every row up to and including log sequence number <lsn>
    wal-<lsn>-<batch id>[.<holder>].arrow
                                  one acknowledged insert; durable before it is acknowledged
                                  (<holder>: the token of the copy that logged it)
    holder.json                   the copies that claimed to write the shard, the last one
                                  its writer now (see below)

Each entry is its own file, written whole and renamed into place (or put as one object on
an object store), so recovery never sees a torn entry. A checkpoint writes a new base and
only then deletes the entries and the older base it covers: a crash at any point leaves a
state from which :meth:`ShardStore.recover` rebuilds every acknowledged row exactly once.

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

import dataclasses
import io
import json
import os
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from shardflow.catalog.store import DataDir, fsync_dir
from shardflow.errors import Moved

RECENT_BATCH_IDS = 4096
"""How many insert batch ids a shard remembers (and persists) to make retries idempotent."""

Applied = dict[str, list[int] | None]
"""Per recent insert batch id, the buckets of it this shard holds (None: all of it). Kept per
bucket because a split or merge can bring rows of one batch together from several shards."""


HOLDER_FILE = "holder.json"
HOLDERS_KEPT = 16
"""Claims a shard's holder record keeps (older ones name no entry recovery can still see:
a checkpoint since has covered them, or they are in every later holder's recovered part)."""
UNFENCED_VARIABLE = "SHARDFLOW_TEST_UNFENCED"
"""Tests only: a comma list of the per-shard fences switched off — ``writes`` (an insert is
acknowledged without the check), ``reads``, ``checkpoints`` and ``recovery`` (an older
holder's late entries are recovered) — whose tests must then fail."""


def unfenced(what: str) -> bool:
    """Whether the test-only hook switched the fence of ``what`` off."""
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
            self._path(self._entry_name(lsn, batch_id)), payload, sync_dir=sync_dir
        )
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
        superseded = _superseded(self.holders())
        for name in sorted(n for n in names if n.startswith("wal-") and n.endswith(".arrow")):
            entry_lsn = _lsn_of(name)
            if entry_lsn is None or entry_lsn <= lsn:
                continue
            batch_id, writer = _entry_of(name)
            if entry_lsn > superseded.get(writer, entry_lsn) and not unfenced("recovery"):
                continue  # logged by a holder after a later one took over: never acknowledged
            payload = self._dir.read(self._path(name))
            with pa.ipc.open_stream(io.BytesIO(payload)) as reader:
                entry = reader.read_all()
            tables.append(entry.replace_schema_metadata(None).cast(schema))
            buckets = json.loads((entry.schema.metadata or {}).get(b"shardflow.buckets", b"null"))
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


def merge_buckets(held: list[int] | None, more: list[int] | None) -> list[int] | None:
    """Buckets of a batch held after adding ``more`` (None stands for every bucket)."""
    if held is None or more is None:
        return None
    return sorted(set(held) | set(more))


def _entry_of(name: str) -> tuple[str, str]:
    """A log entry's batch id and the token of the holder that logged it ("" if none)."""
    found = _ENTRY.fullmatch(name)
    assert found is not None, name
    return found["batch"], found["holder"] or ""


_ENTRY = re.compile(r"wal-\d{12}-(?P<batch>.+?)(?:\.(?P<holder>[0-9a-f]{16}))?\.arrow")


def _lsn_of(name: str) -> int | None:
    for prefix in ("base-", "wal-"):
        if name.startswith(prefix):
            digits = name[len(prefix) : len(prefix) + 12]
            return int(digits) if digits.isdigit() else None
    return None
