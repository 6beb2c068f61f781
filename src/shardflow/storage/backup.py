"""Online backups of a data directory (consistent, incremental, checked) and their restore.

Layout under a backup root (a local folder or any pyarrow filesystem URI)::

    packs/<backup>-<n>.pack   the chunks of the files backed up, each kept once for every
                              backup of the root: a checkpoint file is cut at DuckDB's block
                              boundaries (its 12 KiB of headers, then 256 KiB blocks), so a
                              shard's next checkpoint (a copy of the file with the rows since
                              added) shares all but its new and rewritten blocks with the one
                              before, and a backup after a small change writes little
    backups/<backup>.json     the manifest, written last (a backup without one did not
                              happen): the catalog, every file as its chunks (sha256, pack,
                              offset, length, size: zstd-compressed where that is
                              shorter), and the manifest's own checksum

**One point in time.** The cluster runs on while its files are read (no lease is taken):

1. A hold (``storage/holds.py``) asks checkpoints to keep the log entries they cover.
2. The catalog is read, then each shard's folder is listed and copied: its newest
   checkpoint, the log entries after it and any prepared change of rows. The listing is the
   shard's cut; every insert acknowledged before the backup began is durable in its log or
   checkpoint by then. A file that went between the listing and its copy (a checkpoint raced
   the hold) makes the shard listed and copied again.
3. An insert batch spans shards, and the cuts are made one after another: a batch may be in
   one shard's cut and not yet in another's. So once a table's shards are copied, every
   batch id seen in any of its cuts is taken from the others' logs too (the hold kept
   them). A batch no cut saw is in none.
4. The catalog is read again. A table whose layout changed meanwhile (its files: a change of
   rows committed, a truncate, a split or merge; a plain move shares the files and does
   not count) is copied again, up to :data:`MAX_ROUNDS` times. The catalog stored is that
   last one, so every prepared change it holds as committed is in the files (recovery puts it
   in effect), and every shard it names is there.
5. Each shard's ``holder.json`` is copied last (the newest record of the copies that wrote
   it: recovery leaves out the entries of a holder superseded since).

So a backup holds every row acknowledged before it began, and of the inserts acknowledged
while it ran, each whole or not at all. A restore writes the files into an empty data
directory and the catalog last; a cluster started on it recovers the shards as after a
restart, on any number of workers (the units of nodes it does not have get new owners).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import posixpath
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.fs as pafs

from shardflow.catalog import Catalog, CatalogStore, DataDir
from shardflow.catalog.store import CATALOG_FOLDER, fsync_dir
from shardflow.catalog.version import FORMAT_FILE, read_format, release
from shardflow.errors import ConfigError, StorageError
from shardflow.records import BackupInfo
from shardflow.storage import holds
from shardflow.storage.holds import ARCHIVE_FOLDER, Hold
from shardflow.storage.partition import batch_units
from shardflow.storage.point_in_time import manifest_as_of
from shardflow.storage.shard_store import (
    HOLDER_FILE,
    LOGGED_AT,
    _entry_of,
    _is_checkpoint,
    _is_log_entry,
    _is_parquet_base,
    _lsn_of,
    _meta_name,
)

log = logging.getLogger(__name__)

BACKUP_FORMAT = 1
CHUNK_BYTES = 256 << 10
"""DuckDB's block size: a checkpoint file's chunks are its blocks."""
DUCKDB_HEADER = 12 << 10
"""DuckDB's file headers before its first block (a chunk of their own)."""
PACK_BYTES = 64 << 20
"""A pack file is closed and the next one started past this size."""
MAX_ROUNDS = 8
"""Times the tables changed meanwhile are copied again before a backup gives up."""
COPY_THREADS = 2
UNIT_ATTEMPTS = 20
"""Times a shard is listed and copied again when a file went between listing and copy."""
SETTLE_S = 0.5
"""A backup takes the entries of batches it saw until none came for this long (the parts of
one insert reach their shards at about the same time; a part a move's fence held comes
once the move ends, and the backup waits for that too)."""
SETTLE_POLL_S = 0.05
MOVE_WAIT_S = 60.0
PART_WAIT_S = 60.0
"""The longest a backup waits for the rest of a batch it holds in part (a retry after a
failover places it within the session's ``retry_deadline_s``)."""
"""The longest a backup waits for a move to end (a coordinator gone leaves its record)."""
HOLDING_PHASE = "catch_up"
"""The phase a move's record shows from its catch-up to its switch, while its fence may
hold writes (the phases between are not written: ``runtime/coordinator/migrator.py``)."""
MIGRATIONS = "migrations"
PACKS = "packs"
MARKERS = "markers"
RUNNING = "running"
PRUNING = "pruning"
ACTS = {RUNNING: "backup", PRUNING: "prune"}
MARKER_TTL_S = 86400.0
"""A marker older than this is left by a process that died: not heeded."""
PRIORITIES = ("idle", "low", "normal")
"""The CPU priorities a backup's copy may run at (see :func:`backup`)."""
BACKUPS = "backups"

Where = tuple[str, int, int, int]
"""Where a chunk lies: its pack, offset and length there, and its own size (more than the
length where it is stored compressed)."""
Progress = Callable[[int], None]
"""Told the bytes of each chunk read (a backup) or written (a restore, a check)."""


@dataclass(frozen=True)
class CheckReport:
    """What ``shardflow backup verify`` found."""

    backups: int
    chunks: int
    bytes: int
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def info_of(manifest: dict[str, Any]) -> BackupInfo:
    """A backup's summary, from its manifest."""
    return BackupInfo(
        manifest["id"],
        manifest["started_at"],
        manifest["finished_at"],
        manifest["catalog"]["version"],
        len(manifest["catalog"]["tables"]),
        len(manifest["files"]),
        manifest["bytes"],
        manifest["bytes_written"],
        manifest["rounds"],
    )


def open_root(uri: str, *, create: bool) -> DataDir:
    """A backup root; ``StorageError`` where it does not exist and ``create`` is False."""
    if not create:
        if "://" in uri:
            fs, path = pafs.FileSystem.from_uri(uri)
        else:
            fs, path = pafs.LocalFileSystem(), os.path.abspath(uri)
        if fs.get_file_info(path).type != pafs.FileType.Directory:
            raise StorageError(f"no backups at {uri!r}: it does not exist")
    return DataDir.resolve(uri)


def backups(root: DataDir) -> list[str]:
    """The ids of the backups in ``root``, oldest first."""
    return [
        name[: -len(".json")] for name in root.list(root.path(BACKUPS)) if name.endswith(".json")
    ]


def read_manifest(root: DataDir, backup_id: str | None = None) -> dict[str, Any]:
    """A backup's manifest (the newest where ``backup_id`` is None), its checksum checked."""
    ids = backups(root)
    if not ids:
        raise StorageError(f"no backups at {root.uri!r}")
    if backup_id is None:
        backup_id = ids[-1]
    elif backup_id not in ids:
        raise StorageError(f"no backup {backup_id!r} at {root.uri!r} (it has {', '.join(ids)})")
    try:
        manifest: dict[str, Any] = json.loads(root.read(root.path(BACKUPS, f"{backup_id}.json")))
    except ValueError:
        raise StorageError(f"backup {backup_id}: its manifest does not read as JSON") from None
    found = manifest.pop("checksum", None)
    if found != _digest_of(manifest):
        raise StorageError(f"backup {backup_id}: its manifest does not match its checksum")
    if manifest.get("backup_format") != BACKUP_FORMAT:
        raise StorageError(
            f"backup {backup_id} is in backup format {manifest.get('backup_format')}; this "
            f"shardflow ({release()}) reads format {BACKUP_FORMAT}"
        )
    return manifest


def _digest_of(manifest: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


# -- taking a backup -----------------------------------------------------------------------
def backup(
    data_dir: DataDir,
    to: str,
    progress: Progress | None = None,
    *,
    priority: str = "idle",
    max_rate_mb_s: float = 0.0,
    keep_log: bool = False,
) -> BackupInfo:
    """Back ``data_dir`` up into the backup root ``to`` while its cluster serves (see the
    module's text); the chunks the root holds already are not written again.

    ``keep_log`` has the data directory keep its log from now on (``storage/holds.py``):
    the next backups then hold every insert between them, and :func:`restore` can put any
    point between two of them together (``as_of``). Once kept, every backup takes the log
    kept since the one before, whatever ``keep_log`` says.

    ``priority`` (:data:`PRIORITIES`) is the CPU priority of the threads that copy: ``idle``
    (the default) runs them only where nothing else would run (Linux's ``SCHED_IDLE``), so
    that queries keep their latency; ``low`` is the lowest nice value; ``normal`` leaves
    them as the process's other threads. ``max_rate_mb_s`` caps the bytes read a second
    (0: none), as ``migration_bandwidth_mb_s`` caps a move's copy."""
    if priority not in PRIORITIES:
        raise ConfigError(
            f"backup priority must be one of {', '.join(PRIORITIES)}, not {priority!r}"
        )
    if not isinstance(max_rate_mb_s, int | float) or max_rate_mb_s < 0:
        raise ConfigError(f"max_rate_mb_s must be 0 (no cap) or more, not {max_rate_mb_s!r}")
    if not data_dir.list(data_dir.path(CATALOG_FOLDER)):
        raise StorageError(f"{data_dir.uri!r} holds no shardflow data (no catalog)")
    root = open_root(to, create=True)
    with _Marker(root, RUNNING, f"{time.time():.6f}-{secrets.token_hex(3)}", refuse=PRUNING):
        if keep_log:
            holds.keep_log(data_dir)
        copy = _Backup(data_dir, root, progress, _Pacer(max_rate_mb_s))
        return _on_thread_of_priority(copy.run, priority)


class _Marker:
    """A file in the root's ``markers/`` saying a backup (``running-*``) or a prune
    (``pruning-*``) works on it while the ``with`` block runs; entering refuses where one
    of the kind ``refuse`` younger than :data:`MARKER_TTL_S` is there (a prune never
    deletes packs a backup still writes, nor a backup reuses chunks a prune deletes).
    Made after a look, not atomically: two started in the same moment can both go on;
    then the backup's own check of its packs (:meth:`_Backup.run`) fails it."""

    def __init__(self, root: DataDir, kind: str, name: str, refuse: str) -> None:
        self.root = root
        self.kind = kind
        self.path = root.path(MARKERS, f"{kind}-{name}")
        self.refuse = refuse

    def __enter__(self) -> _Marker:
        now = time.time()
        for name in self.root.list(self.root.path(MARKERS)):
            if name.startswith(f"{self.refuse}-"):
                try:
                    at = float(name.split("-")[1])
                except (IndexError, ValueError):
                    continue  # not a marker this writes
                if now - at < MARKER_TTL_S:
                    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))
                    raise StorageError(
                        f"{self.root.uri!r}: a {ACTS[self.refuse]} runs there since {since}; "
                        f"run this {ACTS[self.kind]} when it has ended (a marker its process "
                        f"left when it died is heeded for a day: {MARKERS}/{name})"
                    )
        self.root.fs.create_dir(self.root.path(MARKERS), recursive=True)
        self.root.write_atomic(self.path, b"", fenced=False)
        return self

    def __exit__(self, *exc: object) -> None:
        self.root.delete(self.path, fenced=False)


def _on_thread_of_priority(work: Callable[[], BackupInfo], priority: str) -> BackupInfo:
    """``work()`` on a thread of its own with the CPU priority asked (the threads it starts
    inherit it; the process's other threads keep theirs)."""
    done: list[BackupInfo] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            if priority == "idle":
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # this thread
            elif priority == "low":
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError) as error:  # not on this system: as it is
            log.info("backup: priority %s not taken: %s", priority, error)
        try:
            done.append(work())
        except BaseException as error:
            failed.append(error)

    thread = threading.Thread(target=run, name="backup", daemon=True)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return done[0]


class _Pacer:
    """Holds the copy to ``mb_s`` megabytes a second (0: no cap)."""

    def __init__(self, mb_s: float) -> None:
        self.rate = mb_s * 1e6
        self.began: float | None = None
        self.taken = 0
        self.lock = threading.Lock()

    def take(self, size: int) -> None:
        if not self.rate:
            return
        with self.lock:
            if self.began is None:
                self.began = time.monotonic()
            self.taken += size
            due = self.began + self.taken / self.rate
        ahead = due - time.monotonic()
        if ahead > 0.005:
            time.sleep(ahead)


@dataclass
class _UnitCopy:
    files: dict[str, dict[str, Any]]
    """Per path under the data directory, its size and chunks."""
    base_lsn: int
    batches: set[str]
    """The batches of the log entries taken."""
    in_base: set[str] = field(default_factory=set)
    """The batches its checkpoint's record names (recent ones)."""
    units_of: dict[str, set[int]] = field(default_factory=dict)
    """Per batch taken, the units its entries say the batch was routed to."""
    newer_record: tuple[str, set[str]] | None = None
    """The newest checkpoint written since the cut, and the batches its record names."""
    archived: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Log entries its checkpoint covers, still there (a hold kept them): the log kept
    between backups (``keep_log``) takes them."""

    def take_entry(
        self, rel: str, batch: str, entry: dict[str, Any], units: list[int] | None
    ) -> None:
        self.files[rel] = entry
        self.batches.add(batch)
        if units is not None:
            self.units_of.setdefault(batch, set()).update(units)

    def drop_batch(self, batch: str) -> None:
        """Leave a batch out (its entries taken here go)."""
        for rel in [r for r in self.files if _is_log_entry(posixpath.basename(r))]:
            if _entry_of(posixpath.basename(rel))[0] == batch:
                del self.files[rel]
        self.batches.discard(batch)
        self.units_of.pop(batch, None)


@dataclass
class _TableCopy:
    uid: str
    group: str | None
    units: dict[str, _UnitCopy]
    layout: tuple[Any, ...] = ()
    """The table's layout in the catalog it was cut by (:func:`_layout`)."""

    def seen(self) -> set[str]:
        """The batches of every entry taken of the table's shards, and those their
        checkpoints' records name (a shard cut after the others may hold in its checkpoint
        a batch that came after their cuts: their parts of it are taken too)."""
        return {batch for unit in self.units.values() for batch in (*unit.batches, *unit.in_base)}

    def files(self) -> dict[str, dict[str, Any]]:
        return {rel: entry for unit in self.units.values() for rel, entry in unit.files.items()}

    def archived(self) -> dict[str, dict[str, Any]]:
        return {rel: e for unit in self.units.values() for rel, e in unit.archived.items()}

    def in_part(self) -> dict[str, set[str]]:
        """Per batch seen, the table's units its entries name that hold none of it (neither
        an entry taken nor their checkpoint's record); units no longer in the table (a
        split or merge since) are not asked."""
        lacking: dict[str, set[str]] = {}
        for batch in self.seen():
            routed = set().union(*(u.units_of.get(batch, set()) for u in self.units.values()))
            missing = {
                shard
                for shard in map(str, routed)
                if shard in self.units
                and batch not in self.units[shard].batches
                and batch not in self.units[shard].in_base
            }
            if missing:
                lacking[batch] = missing
        return lacking

    def leave_out(self, table: str, batches: dict[str, set[str]]) -> None:
        """Leave batches held in part out whole; a part of one in a checkpoint fails."""
        for batch, missing in batches.items():
            if any(batch in unit.in_base for unit in self.units.values()):
                raise StorageError(
                    f"{table}: insert batch {batch} stayed in part (not in units "
                    f"{', '.join(sorted(missing))}) for {PART_WAIT_S:g} s, and a part of it "
                    "is in a checkpoint already: run the backup again"
                )
            log.warning("backup: %s: insert batch %s left out (never whole)", table, batch)
            for unit in self.units.values():
                unit.drop_batch(batch)


class _Backup:
    def __init__(
        self, data_dir: DataDir, root: DataDir, progress: Progress | None, pacer: _Pacer
    ) -> None:
        self.data_dir = data_dir
        self.root = root
        self.progress = progress
        self.pacer = pacer
        self.backup_id = _new_id()
        self.known: dict[str, Where] = _known_chunks(root)
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="backup")
        """Shards are copied this many at once (reading and hashing run in parallel)."""
        self.packs = _PackWriter(root, self.backup_id)
        self.store = CatalogStore(data_dir, background=False)
        self.began = time.time()
        self.keep_log = holds.keeping_log(data_dir)
        """Since when the data directory keeps its log (None: it does not)."""

    def run(self) -> BackupInfo:
        started = time.time()
        with Hold(self.data_dir, f"backup-{self.backup_id}"):
            try:
                catalog, files, archive, rounds = self._copy_consistent()
                if self.keep_log is not None:
                    archive.update(self._copy_archive(catalog))
            finally:
                self.pool.shutdown()
                self.packs.close()
        manifest: dict[str, Any] = {
            "backup_format": BACKUP_FORMAT,
            "id": self.backup_id,
            "release": release(),
            "data_format": read_format(self.data_dir),
            "started_at": started,
            "finished_at": time.time(),
            "catalog": catalog.to_json(),
            "files": files,
            "bytes": sum(entry["size"] for entry in files.values()),
            "bytes_written": self.packs.written,
            "rounds": rounds,
            "keep_log_since": self.keep_log,
            "archive": archive,
        }
        manifest["checksum"] = _digest_of(manifest)
        named = {chunk[1] for entry in files.values() for chunk in entry["chunks"]}
        gone = named - set(self.root.list(self.root.path(PACKS)))
        if gone:  # a prune that began with this backup deleted packs it reuses
            raise StorageError(
                f"backup {self.backup_id}: packs it reuses were deleted while it ran "
                f"({', '.join(sorted(gone)[:3])}): run it again"
            )
        self.root.fs.create_dir(self.root.path(BACKUPS), recursive=True)
        self.root.write_atomic(
            self.root.path(BACKUPS, f"{self.backup_id}.json"),
            json.dumps(manifest).encode(),
            fenced=False,
        )
        if self.keep_log is not None:
            self._clear_archive(catalog, archive)
        return info_of(manifest)

    def _copy_archive(self, catalog: Catalog) -> dict[str, dict[str, Any]]:
        """The log entries checkpoints archived since the backup before (all of them: the
        hold keeps new ones from coming while this lists), under the paths they had in
        their shard's folder."""
        taken: dict[str, dict[str, Any]] = {}
        for name in catalog.tables:
            uid = catalog.table(name).uid
            for info in self.data_dir.fs.get_file_info(
                pafs.FileSelector(
                    self.data_dir.path(ARCHIVE_FOLDER, uid), recursive=True, allow_not_found=True
                )
            ):
                if info.type != pafs.FileType.File or not _is_log_entry(info.base_name):
                    continue
                shard = posixpath.basename(posixpath.dirname(info.path))
                archived = posixpath.join(ARCHIVE_FOLDER, uid, shard, info.base_name)
                entry = self._copy_file(archived)
                taken[self._rel(uid, shard, info.base_name)] = {**entry, "archived": True}
        return taken

    def _clear_archive(self, catalog: Catalog, taken: dict[str, dict[str, Any]]) -> None:
        """Once the manifest is written: the archived entries it took go from the data
        directory, and the archive of tables dropped since (no later point holds them)."""
        uids = {catalog.table(name).uid for name in catalog.tables}
        for rel, entry in taken.items():
            if entry.get("archived"):
                _, uid, shard, name = rel.split("/")
                self.data_dir.delete(
                    self.data_dir.path(ARCHIVE_FOLDER, uid, shard, name), fenced=False
                )
        for info in self.data_dir.fs.get_file_info(
            pafs.FileSelector(self.data_dir.path(ARCHIVE_FOLDER), allow_not_found=True)
        ):
            if info.type == pafs.FileType.Directory and info.base_name not in uids:
                with contextlib.suppress(FileNotFoundError):
                    self.data_dir.fs.delete_dir(info.path)

    def _catalog(self) -> Catalog:
        for _ in range(UNIT_ATTEMPTS):
            try:
                catalog = self.store.load()
            except FileNotFoundError:  # a snapshot pruned while listed: read again
                continue
            if catalog is None:
                raise StorageError(f"{self.data_dir.uri!r} holds no shardflow data (no catalog)")
            return catalog
        raise StorageError(f"{self.data_dir.uri!r}: its catalog could not be read whole")

    def _copy_consistent(
        self,
    ) -> tuple[Catalog, dict[str, dict[str, Any]], dict[str, dict[str, Any]], int]:
        """The catalog, the files of its tables' cuts and the covered entries the cuts
        found still there, and the rounds it took."""
        copied: dict[str, tuple[tuple[Any, ...], dict[str, Any], dict[str, Any]]] = {}
        catalog = self._catalog()
        for round_ in range(1, MAX_ROUNDS + 1):
            tables: dict[str, _TableCopy] = {}
            for name in sorted(catalog.tables):
                layout = _layout(catalog, name)
                if name not in copied or copied[name][0] != layout:
                    tables[name] = self._cut_table(catalog, name)
            self._settle(tables)
            for name, table in tables.items():
                copied[name] = (_layout(catalog, name), table.files(), table.archived())
            end = self._catalog()
            changed = [n for n in end.tables if n not in copied or copied[n][0] != _layout(end, n)]
            if not changed:
                files = {p: e for n in end.tables for p, e in copied[n][1].items()}
                archive = {p: e for n in end.tables for p, e in copied[n][2].items()}
                return end, files, archive, round_
            catalog = end
        raise StorageError(
            f"tables changed under the backup {MAX_ROUNDS} times ({', '.join(sorted(changed))}):"
            " run it again when fewer changes of rows, truncates, splits or merges run"
        )

    def _cut_table(self, catalog: Catalog, name: str) -> _TableCopy:
        """Each shard's cut (step 2 of the module's text)."""
        spec = catalog.table(name)
        folder = self.data_dir.path("tables", spec.uid)
        if spec.distributed:
            shards = [str(unit.unit_id) for unit in catalog.group_of(name).units]
        else:
            infos = self.data_dir.fs.get_file_info(pafs.FileSelector(folder, allow_not_found=True))
            shards = sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory)
        copies = [self.pool.submit(self._copy_unit, spec.uid, shard) for shard in shards]
        units = {shard: copy.result() for shard, copy in zip(shards, copies, strict=True)}
        return _TableCopy(spec.uid, spec.group, units, _layout(catalog, name))

    def _settle(self, tables: dict[str, _TableCopy]) -> None:
        """Step 3: take every entry of a batch seen in some cut from the other shards of its
        table, over and over, until every seen batch is in each unit its entries say it was
        routed to, none came for :data:`SETTLE_S` and no move of their groups holds writes
        (a fence holds a part of a batch whose other parts are in; it comes once the move
        ends). A batch still in part after :data:`PART_WAIT_S` was never acknowledged (its
        insert failed, or waits on a failover): it is left out whole, or, where a part of it
        is in a checkpoint already, the backup fails. Then each shard's holder record."""
        quiet_since = time.monotonic()
        give_up_on_moves = quiet_since + MOVE_WAIT_S
        give_up_on_parts = quiet_since + PART_WAIT_S
        groups = {t.group for t in tables.values() if t.group}
        while any(t.seen() for t in tables.values()):  # else no insert can be in part
            found = 0
            for table in tables.values():
                seen = table.seen()
                for shard, unit in table.units.items():
                    found += self._complete(table.uid, shard, unit, seen)
            now = time.monotonic()
            if found:
                quiet_since = now
            if now - quiet_since < SETTLE_S:
                time.sleep(SETTLE_POLL_S)
                continue
            in_part = {name: lacking for name, t in tables.items() if (lacking := t.in_part())}
            if in_part and self._relaid(tables, in_part):
                break  # a missing part went to a split's or merge's units: the next round
            holding = self._moves_holding(groups)  # a fence holds a part back
            if (in_part and now < give_up_on_parts) or (holding and now < give_up_on_moves):
                quiet_since = now  # look again once quiet again
                continue
            if holding:
                log.warning("backup: moves of %s kept on; not waited for", sorted(holding))
            for name, batches in in_part.items():
                tables[name].leave_out(name, batches)
            break
        for table in tables.values():
            for shard, unit in table.units.items():
                rel = self._rel(table.uid, shard, HOLDER_FILE)
                with contextlib.suppress(FileNotFoundError):
                    unit.files[rel] = self._copy_file(rel)

    def _relaid(self, tables: dict[str, _TableCopy], in_part: Mapping[str, object]) -> bool:
        """Whether a table holding a batch in part has other files or units in the catalog
        now than when it was cut (a retry placed the missing part in a split's or merge's
        new units: the table is copied again, whole, in the next round)."""
        catalog = self._catalog()
        return any(
            name not in catalog.tables or _layout(catalog, name) != tables[name].layout
            for name in in_part
        )

    def _moves_holding(self, groups: set[str]) -> set[str]:
        """The groups among ``groups`` a move catches up, fences or switches now (as its
        coordinator records it: ``runtime/coordinator/migrator.py``)."""
        folder = self.data_dir.path(MIGRATIONS)
        holding = set()
        for name in self.data_dir.list(folder):
            try:
                record = json.loads(self.data_dir.read(posixpath.join(folder, name)))
                if record["phase"] == HOLDING_PHASE and record["plan"]["group"] in groups:
                    holding.add(record["plan"]["group"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return holding

    def _copy_unit(self, uid: str, shard: str) -> _UnitCopy:
        folder = self.data_dir.path("tables", uid, shard)
        for _ in range(UNIT_ATTEMPTS):
            names = self.data_dir.list(folder)
            try:
                return self._copy_listed(uid, shard, names)
            except FileNotFoundError:
                continue  # a checkpoint or a commit raced the listing: list again
        raise StorageError(f"shard {uid}/{shard}: its files kept changing under the backup")

    def _copy_listed(self, uid: str, shard: str, names: list[str]) -> _UnitCopy:
        bases = sorted(
            (lsn, n)
            for n in names
            if (lsn := _lsn_of(n)) is not None and (_is_checkpoint(n) or _is_parquet_base(n))
        )
        base_lsn = bases[-1][0] if bases else 0
        wanted: list[str] = []
        batches: set[str] = set()
        if bases:
            base = bases[-1][1]
            wanted += [base, _meta_name(base)] if _is_checkpoint(base) else [base]
        entries = []
        covered = []
        for name in names:
            if name.startswith("prep-") and ".tmp-" not in name:
                wanted.append(name)
            elif _is_log_entry(name) and (_lsn_of(name) or 0) > base_lsn:
                entries.append(name)
            elif _is_log_entry(name):
                covered.append(name)
        unit = _UnitCopy({}, base_lsn, batches)
        for name in wanted:
            rel = self._rel(uid, shard, name)
            if bases and name == _meta_name(bases[-1][1]):
                record = self.data_dir.read(self.data_dir.path(rel))
                unit.in_base = set(json.loads(record).get("applied", {}))
                unit.files[rel] = self._copy_file(rel, record)
            else:
                unit.files[rel] = self._copy_file(rel)
        for name in entries:
            self._copy_entry(unit, self._rel(uid, shard, name))
        for name in covered:
            self._note_covered(unit, self._rel(uid, shard, name))
        return unit

    def _note_covered(self, unit: _UnitCopy, rel: str) -> None:
        """A log entry the shard's checkpoint covers, still there (the hold kept it): the
        units its batch was routed to (the checkpoint holds this part: the others must be
        taken too), and, where the log is kept, the entry itself."""
        try:
            content = self.data_dir.read(self.data_dir.path(rel))
        except FileNotFoundError:
            return  # its checkpoint was made before the hold: what the cut saw stands
        units, logged = _routing(content)
        if units is not None and logged > self.began - PART_WAIT_S:  # older: long whole
            batch = _entry_of(posixpath.basename(rel))[0]
            unit.units_of.setdefault(batch, set()).update(units)
        if self.keep_log is not None:
            unit.archived[rel] = self._copy_file(rel, content)

    def _copy_entry(self, unit: _UnitCopy, rel: str) -> None:
        """Take one log entry, with the units its batch was routed to."""
        content = self.data_dir.read(self.data_dir.path(rel))
        units, _ = _routing(content)
        batch = _entry_of(posixpath.basename(rel))[0]
        unit.take_entry(rel, batch, self._copy_file(rel, content), units)

    def _complete(self, uid: str, shard: str, unit: _UnitCopy, seen: set[str]) -> int:
        """Take the entries of batches seen in some shard's cut that came here after this
        shard's own cut; how many."""
        folder = self.data_dir.path("tables", uid, shard)
        names = self.data_dir.list(folder)
        self._check_kept(uid, shard, unit, seen, names)
        found = 0
        for name in names:
            rel = self._rel(uid, shard, name)
            if (
                rel in unit.files
                or not _is_log_entry(name)
                or (_lsn_of(name) or 0) <= unit.base_lsn
            ):
                continue
            if _entry_of(name)[0] not in seen:
                continue
            try:
                self._copy_entry(unit, rel)
            except FileNotFoundError:
                now = self.data_dir.list(folder)
                if any(
                    _is_checkpoint(n) and (_lsn_of(n) or 0) >= (_lsn_of(name) or 0) for n in now
                ):
                    raise StorageError(
                        f"shard {uid}/{shard}: a checkpoint took the log entry {name} the "
                        "backup needs (the hold on log entries was not kept)"
                    ) from None
                continue  # discarded: never acknowledged (its batch failed), so not backed up
            found += 1
        return found

    def _check_kept(
        self, uid: str, shard: str, unit: _UnitCopy, seen: set[str], names: list[str]
    ) -> None:
        """A checkpoint written since the cut must not hold a batch seen whose entry here
        the backup has not taken: the hold kept the entries it covers, or the backup would
        hold part of that batch and not the rest."""
        newer = [n for n in names if _is_checkpoint(n) and (_lsn_of(n) or 0) > unit.base_lsn]
        if not newer:
            return
        newest = max(newer)
        if unit.newer_record is None or unit.newer_record[0] != newest:  # read once, not
            try:  # at every look of the settling
                path = self.data_dir.path("tables", uid, shard, _meta_name(newest))
                applied = set(json.loads(self.data_dir.read(path)).get("applied", {}))
            except FileNotFoundError:
                return  # superseded meanwhile by a newer one (the hold ended?): the entries tell
            unit.newer_record = (newest, applied)
        taken = unit.batches | unit.in_base
        lost = sorted(b for b in unit.newer_record[1] if b in seen and b not in taken)
        entries = {_entry_of(n)[0] for n in names if _is_log_entry(n)}
        if [b for b in lost if b not in entries]:
            raise StorageError(
                f"shard {uid}/{shard}: a checkpoint took the log entries of batches the "
                f"backup needs ({', '.join(lost[:3])}): the hold on log entries was not kept"
            )

    def _copy_file(self, rel: str, content: bytes | None = None) -> dict[str, Any]:
        """Chunk and store one file (``content``: its bytes, read already)."""
        chunks: list[list[Any]] = []
        size = 0
        first = DUCKDB_HEADER if rel.endswith(".duckdb") else CHUNK_BYTES
        opened = (
            pa.BufferReader(content)
            if content is not None
            else self.data_dir.fs.open_input_stream(self.data_dir.path(rel))
        )
        squeeze = not rel.endswith(".duckdb")  # DuckDB compressed its blocks already
        with opened as stream:
            want = first
            while data := stream.read(want):
                digest = hashlib.sha256(data).hexdigest()
                where = self.known.get(digest)
                if where is None:
                    stored = _squeezed(data) if squeeze else data
                    with self.lock:  # one copy of a chunk two shards hold
                        where = self.known.get(digest) or self.packs.put(stored, len(data))
                        self.known[digest] = where
                chunks.append([digest, *where])
                size += len(data)
                want = CHUNK_BYTES
                self.pacer.take(len(data))
                if self.progress is not None:
                    self.progress(len(data))
        return {"size": size, "chunks": chunks}

    @staticmethod
    def _rel(uid: str, shard: str, name: str) -> str:
        return posixpath.join("tables", uid, shard, name)


def _new_id() -> str:
    """A backup's id: when it began (to the microsecond, so that ids sort as backups were
    taken) and a random tail."""
    now = time.time()
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now))
    return f"{stamp}.{int(now % 1 * 1e6):06d}Z-{secrets.token_hex(3)}"


def _layout(catalog: Catalog, name: str) -> tuple[Any, ...]:
    """What a table's files depend on: its files' folder, its commit, its units."""
    spec = catalog.table(name)
    units = (
        tuple((u.unit_id, u.lo, u.hi) for u in catalog.group_of(name).units)
        if spec.distributed
        else ()
    )
    return (spec.uid, spec.commit, units)


def _known_chunks(root: DataDir) -> dict[str, Where]:
    """Every chunk the backups of ``root`` hold, where its pack is there: where it lies."""
    present = set(root.list(root.path(PACKS)))
    known: dict[str, Where] = {}
    for backup_id in backups(root):
        for entry in _stored(read_manifest(root, backup_id)):
            for digest, *where in entry["chunks"]:
                if where[0] in present:
                    known[digest] = tuple(where)  # type: ignore[assignment]
    return known


def _routing(entry: bytes) -> tuple[list[int] | None, float]:
    """The units a log entry's batch was routed to and when it was written, from its
    schema's metadata: (None, inf) where not said or not readable (recovery reads it whole
    and says what is wrong with it)."""
    try:
        schema = pa.ipc.open_stream(pa.BufferReader(entry)).schema
        logged = float((schema.metadata or {}).get(LOGGED_AT, b"inf"))
        return batch_units(schema), logged
    except (pa.ArrowInvalid, ValueError):
        return None, float("inf")


def _stored(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """Every file a manifest names: the backup's own and the log it kept (``archive``)."""
    return [*manifest["files"].values(), *manifest.get("archive", {}).values()]


def _squeezed(data: bytes) -> bytes:
    """``data`` compressed (zstd) where that saves a tenth at least, else as it is: a log
    entry is an uncompressed Arrow stream, its record JSON."""
    packed: bytes = pa.compress(data, codec="zstd", asbytes=True)
    return packed if len(packed) < 0.9 * len(data) else data


class _PackWriter:
    """Appends chunks to the backup's pack files (durable once closed)."""

    def __init__(self, root: DataDir, backup_id: str) -> None:
        self.root = root
        self.backup_id = backup_id
        self.count = 0
        self.name = ""
        self.offset = 0
        self.written = 0
        self.out: BinaryIO | Any = None

    def put(self, data: bytes, size: int) -> Where:
        """Append a chunk of ``size`` bytes, stored as ``data`` (compressed where shorter)."""
        if self.out is None or self.offset >= PACK_BYTES:
            self._next()
        self.out.write(data)
        where = (self.name, self.offset, len(data), size)
        self.offset += len(data)
        self.written += len(data)
        return where

    def _next(self) -> None:
        self._close_pack()
        self.name = f"{self.backup_id}-{self.count:05d}.pack"
        self.count += 1
        self.offset = 0
        folder = self.root.path(PACKS)
        self.root.fs.create_dir(folder, recursive=True)
        path = posixpath.join(folder, self.name)
        self.out = open(path, "wb") if self.root.local else self.root.fs.open_output_stream(path)

    def _close_pack(self) -> None:
        if self.out is None:
            return
        if self.root.local:
            self.out.flush()
            os.fsync(self.out.fileno())
        self.out.close()
        self.out = None

    def close(self) -> None:
        self._close_pack()
        if self.count and self.root.local:
            fsync_dir(self.root.path(PACKS))


# -- reading it back -----------------------------------------------------------------------
class _PackReader:
    """Chunks read out of a root's packs, each checked against its sha256."""

    def __init__(self, root: DataDir) -> None:
        self.root = root
        self.handles: dict[str, pafs.NativeFile] = {}
        self.lock = threading.Lock()

    def read(self, digest: str, pack: str, offset: int, length: int, size: int) -> bytes:
        """The chunk of ``size`` bytes stored as ``length`` bytes at ``offset``."""
        with self.lock:  # a pack opened once; reads at an offset run side by side
            handle = self.handles.get(pack)
            if handle is None:
                try:
                    handle = self.root.fs.open_input_file(self.root.path(PACKS, pack))
                except FileNotFoundError:
                    raise StorageError(f"pack {pack} is missing") from None
                self.handles[pack] = handle
        data = handle.read_at(length, offset)
        if len(data) == length and length < size:
            try:
                data = pa.decompress(data, size, codec="zstd", asbytes=True)
            except (OSError, pa.ArrowException):
                data = b""  # damaged: does not match below
        if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
            raise StorageError(f"pack {pack}: the chunk at {offset} does not match its checksum")
        return bytes(data)

    def close(self) -> None:
        for handle in self.handles.values():
            handle.close()
        self.handles.clear()


def restore(
    source: str,
    data_dir: DataDir,
    backup_id: str | None = None,
    progress: Progress | None = None,
    *,
    as_of: float | None = None,
) -> BackupInfo:
    """Write the backup ``backup_id`` (the newest where None) of the root ``source`` into
    the empty data directory ``data_dir``: the files, then ``FORMAT``, then the catalog.
    Every chunk is checked as it is read; on any error what was written is removed.

    ``as_of`` (seconds since the epoch) restores the data directory as it was then instead,
    from the backup before it and the log the one after it kept
    (``storage/point_in_time.py``): every insert acknowledged by then, each whole."""
    root = open_root(source, create=False)
    if data_dir.list(data_dir.path(CATALOG_FOLDER)) or _has_tables(data_dir):
        raise StorageError(
            f"{data_dir.uri!r} holds shardflow data already: restore into a new data directory"
        )
    if as_of is None:
        manifest = read_manifest(root, backup_id)
    elif backup_id is not None:
        raise ConfigError("restore: a backup's id or a time to restore to, not both")
    else:
        manifest = _manifest_as_of(root, as_of)
    reader = _PackReader(root)
    try:
        with ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="restore") as pool:
            written = [
                pool.submit(_write_file, data_dir, rel, _chunks_of(reader, entry, progress))
                for rel, entry in sorted(manifest["files"].items())
            ]
            folders = {folder.result() for folder in written}
        for folder in sorted(folders):
            data_dir.sync_dir(folder)
        data_dir.write_atomic(
            data_dir.path(FORMAT_FILE),
            json.dumps({"format": manifest["data_format"], "written_by": release()}).encode(),
            fenced=False,
        )
        CatalogStore(data_dir, background=False).save(Catalog.from_json(manifest["catalog"]))
    except BaseException:
        for folder in ("tables", CATALOG_FOLDER):
            with contextlib.suppress(FileNotFoundError):
                data_dir.fs.delete_dir(data_dir.path(folder))
        data_dir.delete(data_dir.path(FORMAT_FILE), fenced=False)
        raise
    finally:
        reader.close()
    return info_of(manifest)


def _manifest_as_of(root: DataDir, at: float) -> dict[str, Any]:
    reader = _PackReader(root)

    def read(entry: dict[str, Any]) -> bytes:
        return b"".join(_chunks_of(reader, entry, None))

    try:
        manifests = [read_manifest(root, backup_id) for backup_id in backups(root)]
        return manifest_as_of(manifests, at, read, _layout)
    finally:
        reader.close()


def _has_tables(data_dir: DataDir) -> bool:
    infos = data_dir.fs.get_file_info(
        pafs.FileSelector(data_dir.path("tables"), allow_not_found=True)
    )
    return bool(infos)


def _chunks_of(
    reader: _PackReader, entry: dict[str, Any], progress: Progress | None
) -> Iterator[bytes]:
    for digest, pack, offset, length, size in entry["chunks"]:
        data = reader.read(digest, pack, offset, length, size)
        if progress is not None:
            progress(len(data))
        yield data


def _write_file(data_dir: DataDir, rel: str, chunks: Iterator[bytes]) -> str:
    """Write one file (synced; nothing reads the data directory before its catalog is
    written, last); answers its folder, which the caller syncs once."""
    path = data_dir.path(rel)
    folder = posixpath.dirname(path)
    data_dir.fs.create_dir(folder, recursive=True)
    if not data_dir.local:
        with data_dir.fs.open_output_stream(path) as out:
            for data in chunks:
                out.write(data)
        return folder
    with open(path, "wb") as out:
        for data in chunks:
            out.write(data)
        out.flush()
        os.fsync(out.fileno())
    return folder


@dataclass(frozen=True)
class PruneReport:
    """What ``shardflow backup prune`` removed."""

    backups: list[str]
    packs: int
    bytes: int


def prune(source: str, keep: int) -> PruneReport:
    """Delete all but the newest ``keep`` backups of the root ``source``, then every pack
    no backup left names (and those of a backup that never finished, a day after it
    began). Manifests go first: a prune cut short leaves packs no backup names, never a
    backup that names a pack gone. Refused while a backup runs there (its marker)."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ConfigError(f"keep must be 1 or more (the newest backups kept), not {keep!r}")
    root = open_root(source, create=False)
    with _Marker(root, PRUNING, f"{time.time():.6f}-{secrets.token_hex(3)}", refuse=RUNNING):
        ids = backups(root)
        dropped, kept = ids[:-keep], ids[-keep:]
        named = {
            chunk[1]
            for backup_id in kept
            for entry in _stored(read_manifest(root, backup_id))
            for chunk in entry["chunks"]
        }
        for backup_id in dropped:
            root.delete(root.path(BACKUPS, f"{backup_id}.json"), fenced=False)
        finished = set(ids)
        removed = freed = 0
        now = time.time()
        for info in root.fs.get_file_info(
            pafs.FileSelector(root.path(PACKS), allow_not_found=True)
        ):
            name = info.base_name
            if name in named or not name.endswith(".pack"):
                continue
            backup_id = name.rsplit("-", 1)[0]
            begun = info.mtime.timestamp() if info.mtime is not None else now
            if backup_id not in finished and now - begun < MARKER_TTL_S:
                continue  # a backup that has not finished (or died under a day ago)
            root.delete(info.path, fenced=False)
            removed += 1
            freed += info.size or 0
    return PruneReport(dropped, removed, freed)


def verify(
    source: str, backup_id: str | None = None, progress: Progress | None = None
) -> CheckReport:
    """Check every backup of the root ``source`` (or one): each manifest against its
    checksum, and every chunk they name (read once) against its sha256."""
    root = open_root(source, create=False)
    ids = backups(root) if backup_id is None else [backup_id]
    if not ids:
        raise StorageError(f"no backups at {source!r}")
    problems: list[str] = []
    chunks: dict[tuple[str, int], tuple[str, int, int]] = {}
    for one in ids:
        try:
            manifest = read_manifest(root, one)
        except StorageError as error:
            problems.append(str(error))
            continue
        for entry in _stored(manifest):
            for digest, pack, offset, length, size in entry["chunks"]:
                chunks[(pack, offset)] = (digest, length, size)
    reader = _PackReader(root)
    checked = 0
    try:
        for (pack, offset), (digest, length, size) in sorted(chunks.items()):
            try:
                reader.read(digest, pack, offset, length, size)
            except StorageError as error:
                if str(error) not in problems:  # a missing pack is said once
                    problems.append(str(error))
                continue
            checked += size
            if progress is not None:
                progress(size)
    finally:
        reader.close()
    return CheckReport(len(ids), len(chunks), checked, problems)
