"""Where the catalog lives: a log of changes and snapshots in the data directory.

The data directory is any pyarrow filesystem URI or a local path. Each catalog change is
written as a new object (``catalog/delta-<version>.json``, see :class:`CatalogStore`) and
never overwritten, so a crash mid-write leaves every version before it intact on every
filesystem, object stores included. Local writes are fsync'ed before rename.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import posixpath
import signal
import threading
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs

from shardflow.catalog import delta
from shardflow.catalog.model import Catalog, collector_paused
from shardflow.errors import OwnershipLostError, StorageError

CATALOG_FOLDER = "catalog"
DELTA_PREFIX = "delta-"
SNAPSHOT_PREFIX = "snapshot-"
SNAPSHOT_EVERY = 1000
"""Changes between two snapshots of the whole catalog (``CatalogStore``)."""
KEEP_SNAPSHOTS = 2
CATALOG_FAULT_VARIABLE = "SHARDFLOW_TEST_FAULT_CATALOG"
"""Tests only: "torn-delta" writes the next catalog change half, where it lies, and kills
the process (SIGKILL): a crash in the middle of writing it, on a filesystem without
atomic puts. The load must pass over it, and the version before must be whole."""
UNFENCED_VARIABLE = "SHARDFLOW_TEST_UNFENCED"
"""Tests only: the checks switched off (``storage/shard_store.py`` lists them); here
``listing``: a local folder is listed as Arrow lists it, where a file renamed meanwhile can
be missed under both its names, and its test must then fail; ``prepared``: a change
written ahead is committed without comparing it with the change made."""
PREPARED_SUFFIX = ".prepared"
"""A change written ahead of its commit (``CatalogStore.prepare``): a name no load reads."""
LEASE_FILE = "owner.json"
"""The data directory's owner record (see ``shardflow.catalog.lease``)."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OwnerToken:
    """The cluster that owns a data directory and its fencing epoch."""

    owner: str
    epoch: int


@dataclass(frozen=True)
class DataDir:
    """A resolved data directory: a filesystem and the root path inside it.

    With an ``owner`` token every durable change made through it (writes and deletions)
    first checks that the token still owns the directory, and raises
    :class:`~shardflow.errors.OwnershipLostError` instead of writing when it does not.
    """

    fs: pafs.FileSystem
    root: str
    uri: str
    owner: OwnerToken | None = None

    @classmethod
    def resolve(cls, uri: str, owner: OwnerToken | None = None) -> DataDir:
        if "://" in uri:
            fs, root = pafs.FileSystem.from_uri(uri)
        else:
            fs, root = pafs.LocalFileSystem(), os.path.abspath(uri)
        fs.create_dir(root, recursive=True)
        return cls(fs, root, uri, owner)

    def fenced(self, owner: OwnerToken) -> DataDir:
        """This directory, writing as ``owner``."""
        return dataclasses.replace(self, owner=owner)

    @property
    def local(self) -> bool:
        return isinstance(self.fs, pafs.LocalFileSystem)

    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def probe(self) -> None:
        """Write and remove a small file: raises ``OSError`` (or Arrow's error) when the
        directory cannot be written."""
        path = self.path(f".probe-{os.getpid()}-{threading.get_ident()}")
        self.write_atomic(path, b"probe", sync=False, fenced=False)
        self.delete(path, fenced=False)

    def check_owner(self) -> None:
        """Refuse to change anything once our cluster no longer owns the directory: the
        owner record must name our owner and epoch (a fencing token, checked before every
        durable write)."""
        if self.owner is None:
            return
        try:
            record = json.loads(self.read(self.path(LEASE_FILE)))
            current = OwnerToken(record["owner"], record["epoch"])
            released = bool(record.get("released", False))
        except FileNotFoundError:
            raise OwnershipLostError(
                f"data directory {self.uri!r} has no owner record; this cluster no longer "
                "owns it and writes nothing there"
            ) from None
        except (ValueError, KeyError, TypeError):
            current, released = None, False  # torn mid-write: not ours to trust
        if current != self.owner or released:
            raise OwnershipLostError(
                f"data directory {self.uri!r} is now owned by another cluster "
                f"(epoch {current.epoch if current else '?'}, ours {self.owner.epoch}); "
                "this cluster's write was refused. Reconnect to use the data directory."
            )

    def write_atomic(
        self,
        path: str,
        data: bytes,
        *,
        sync: bool = True,
        fenced: bool = True,
        sync_dir: bool = True,
    ) -> None:
        """Write ``data`` so that ``path`` holds either nothing or all of it; durably (on
        disk before returning) unless ``sync`` is False. ``fenced`` (the default) checks
        ownership first. With ``sync_dir`` False the file is synced but not its folder: the
        caller syncs the folder (:meth:`sync_dir`) before relying on the file."""
        if fenced:
            self.check_owner()
        try:
            if self.local:
                write_local_durable(path, data, sync=sync, sync_dir=sync_dir)
                return
            with self.fs.open_output_stream(path) as out:
                out.write(data)
        except OSError as error:
            refused = storage_refused(error, self.uri)
            if refused is None:
                raise
            if os.environ.get(IGNORE_FULL_VARIABLE) == "1":
                return  # tests only: a write that never reached the disk passes for done
            raise refused from error

    def sync_dir(self, path: str) -> None:
        """Make the files created under ``path`` durable in its listing (local disks; other
        filesystems have no such step)."""
        if self.local:
            fsync_dir(path)

    def list(self, path: str) -> list[str]:
        """Base names of the files directly under ``path`` (empty when it is missing).

        A local folder is read as the system lists it, one name per entry, without
        looking at each entry again: a file renamed while it is listed (a prepared change
        becoming a checkpoint on another node) is then found under one of its names, the
        old one failing when it is opened (its reader lists again). Arrow's listing looks
        at each entry after the folder was read and leaves out one gone meanwhile, so a
        rename could hide both names, and a reader took the checkpoint before as the
        newest (measured: 7,105 listings of 20,000 missed a file renamed back and forth;
        none with this)."""
        if self.local and "listing" not in os.environ.get(UNFENCED_VARIABLE, "").split(","):
            try:
                with os.scandir(path) as entries:
                    return sorted(e.name for e in entries if not e.is_dir(follow_symlinks=False))
            except FileNotFoundError:
                return []
        infos = self.fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
        return sorted(info.base_name for info in infos if info.type == pafs.FileType.File)

    def read(self, path: str) -> bytes:
        with self.fs.open_input_stream(path) as stream:
            return bytes(stream.read())

    def delete(self, path: str, *, fenced: bool = True) -> None:
        """Delete a file (checking ownership first unless ``fenced`` is False: our own
        temporary files may always go)."""
        if fenced:
            self.check_owner()
        try:
            self.fs.delete_file(path)
        except FileNotFoundError:
            pass

    def rename_durable(self, source: str, target: str) -> None:
        """Rename a local file (checking ownership first) and sync its folder: on disk
        under its new name before returning."""
        self.check_owner()
        os.replace(source, target)
        fsync_dir(os.path.dirname(target))

    def delete_dir(self, path: str) -> None:
        self.check_owner()
        try:
            self.fs.delete_dir(path)
        except FileNotFoundError:
            pass


NO_ROOM = {errno.ENOSPC: "full", errno.EDQUOT: "over its quota", errno.EROFS: "read-only"}
"""The errors of a file system that takes no writes now, and what they mean."""


IGNORE_FULL_VARIABLE = "SHARDFLOW_TEST_IGNORE_FULL_DISK"
"""Tests only: "1" makes a write the storage refused (full, read-only) pass for done, as a
system that acknowledged what never reached the disk would; the full-disk tests must fail."""


def storage_refused(error: OSError, where: str) -> StorageError | None:
    """``error`` as a :class:`StorageError` if the storage refused the write (full,
    over quota, read-only); None for any other error."""
    state = NO_ROOM.get(error.errno or 0)
    if state is None:
        return None
    return StorageError(
        f"the data directory {where} is {state} ({os.strerror(error.errno or 0)}): nothing "
        "of this write was kept; it succeeds again once the storage takes writes"
    )


def write_local_durable(
    path: str, data: bytes, *, sync: bool = True, sync_dir: bool = True
) -> None:
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    try:
        with open(tmp, "wb") as out:
            out.write(data)
            out.flush()
            if sync:
                os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, say: no partial file is left to hold its space
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if sync and sync_dir:
        fsync_dir(directory)


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class PreparedChange:
    """A catalog change written ahead of its commit (:meth:`CatalogStore.prepare`)."""

    version: int
    payload: bytes
    """The change as written: the commit renames it only where the change then made is
    exactly this."""
    path: str
    """Where it waits (a name no load reads)."""


class CatalogStore:
    """Loads and saves :class:`Catalog` versions under ``<data dir>/catalog`` as a log of
    changes: each save writes one small document, ``delta-<version>.json``, with what the
    version changed of the one saved before (``catalog/delta.py``); now and then a whole
    catalog, ``snapshot-<version>.json``, is written in the background, and the changes
    before the older of the two newest snapshots go. A load takes the newest snapshot that
    reads whole and applies the changes after it, each to the version it was made to. Every
    document is a new object written whole (fsync'ed before rename on local disks), so a
    crash mid-write leaves a document that does not parse, which the load passes over: it
    was never acknowledged. Writes check the owner's fencing token, as every durable write.
    """

    def __init__(
        self,
        data_dir: DataDir,
        snapshot_every: int = SNAPSHOT_EVERY,
        background: bool = True,
    ) -> None:
        """``snapshot_every``: changes between snapshots (also one whenever the changes
        since the last snapshot weigh more than it). ``background``: snapshots are written
        on a thread of their own (False: in :meth:`save`, for tests and tools)."""
        self._dir = data_dir
        self._folder = data_dir.path(CATALOG_FOLDER)
        data_dir.fs.create_dir(self._folder, recursive=True)
        self.snapshot_every = snapshot_every
        self._background = background
        self._last: Catalog | None = None
        """The newest version saved or loaded here: the next change is made to it."""
        self._since_snapshot = 0
        self._bytes_since_snapshot = 0
        self._snapshot_bytes = 0
        self._snapshotting: threading.Thread | None = None
        self._lock = threading.Lock()
        self.written = 0
        """Bytes written by :meth:`save` (snapshots included), for the benches."""

    # -- reading ------------------------------------------------------------------------
    def load(self) -> Catalog | None:
        """The newest catalog saved here (None: none yet). A store that loaded or saved
        before reads only the changes written since, where they follow on from it."""
        names = self._dir.list(self._folder)
        changes = sorted(
            (int(name[len(DELTA_PREFIX) : -5]), name) for name in names if _is_delta(name)
        )
        last = self._last
        catalog: Catalog | None
        if last is not None and self._follows(last, changes):
            catalog = self._replay(last, changes)
        else:
            catalog = self._from_snapshots(names, changes)
        if catalog is not None:
            self._last = catalog
        return catalog

    def _follows(self, last: Catalog, changes: list[tuple[int, str]]) -> bool:
        """Whether the changes listed continue from ``last`` (none newer, or the first
        newer one is made to it)."""
        newer = [name for version, name in changes if version > last.version]
        if not newer:
            return True
        change = self._read_change(newer[0])
        return change is not None and change["base"] == last.version

    def _from_snapshots(self, names: list[str], changes: list[tuple[int, str]]) -> Catalog | None:
        snapshots = sorted((v, name) for name in names if (v := _snapshot_version(name)) >= 0)
        for _, name in reversed(snapshots):
            try:
                catalog = Catalog.from_json(_parse(self._dir.read(self._path(name))))
            except (ValueError, KeyError):
                continue  # cut short on a filesystem without atomic puts: an older one
            return self._replay(catalog, changes)
        return None

    def _replay(self, catalog: Catalog, changes: list[tuple[int, str]]) -> Catalog:
        """``catalog`` with the changes after it applied in turn, each to the version it
        was made to (one that does not read whole was never acknowledged: passed over)."""
        for version, name in changes:
            if version <= catalog.version:
                continue
            change = self._read_change(name)
            if change is None or change["base"] != catalog.version:
                continue
            catalog = delta.apply(catalog, change)
        return catalog

    def _read_change(self, name: str) -> dict[str, Any] | None:
        try:
            change = json.loads(self._dir.read(self._path(name)))
        except FileNotFoundError:
            return None  # pruned since it was listed
        except ValueError:
            return None
        return change if isinstance(change, dict) and "base" in change else None

    # -- writing ------------------------------------------------------------------------
    def prepare(self, catalog: Catalog) -> PreparedChange | None:
        """Write ahead the change that would make ``catalog`` the next version (synced,
        under a name no load reads), so that :meth:`save` of that same catalog only
        renames it and syncs the folder. A synced write's slow step, the file's sync
        (7-25 ms on a busy disk, where the folder's sync took 0.3-3.4), is then
        taken before, not while writers wait (a move's switch). None where nothing can be
        prepared: the data directory is not local, or no version was saved or loaded."""
        last = self._last
        if last is None or not self._dir.local or last.version >= catalog.version:
            return None
        payload = _dump(delta.diff(last, catalog))
        path = self._path(f"{DELTA_PREFIX}{catalog.version:012d}.json{PREPARED_SUFFIX}")
        self._dir.write_atomic(path, payload)
        return PreparedChange(catalog.version, payload, path)

    def discard(self, prepared: PreparedChange) -> None:
        """Remove a prepared change that was not committed (committed: nothing to do)."""
        self._dir.delete(prepared.path, fenced=False)

    def discard_all_prepared(self) -> None:
        """Remove every prepared change left here (an owner that stopped before their
        commit): a new owner starts with none."""
        for name in self._dir.list(self._folder):
            if name.endswith(PREPARED_SUFFIX):
                self._dir.delete(self._path(name))

    def save(
        self, catalog: Catalog, prepared: PreparedChange | None = None
    ) -> dict[str, Any] | None:
        """Make ``catalog`` the newest version: the change from the version saved or
        loaded before, which it answers; or the whole catalog if there is none (None).
        With ``prepared``, where it is exactly that change, it becomes the change by a
        rename; otherwise (another version came first) it is discarded and the change
        written whole."""
        last = self._last
        if last is None or last.version >= catalog.version:
            if prepared is not None:
                self.discard(prepared)
            self._write_snapshot(catalog)
            self._last = catalog
            return None
        change = delta.diff(last, catalog)
        payload = json.dumps(change, separators=(",", ":")).encode()
        path = self._path(f"{DELTA_PREFIX}{catalog.version:012d}.json")
        _inject_catalog_fault(path, payload)
        if not self._commit_prepared(prepared, path, catalog.version, payload):
            self._dir.write_atomic(path, payload)
        self._last = catalog
        self.written += len(payload)
        self._since_snapshot += 1
        self._bytes_since_snapshot += len(payload)
        if self._since_snapshot >= self.snapshot_every or (
            self._bytes_since_snapshot > self._snapshot_bytes > 0
        ):
            self._snapshot_soon(catalog)
        return change

    def _commit_prepared(
        self, prepared: PreparedChange | None, path: str, version: int, payload: bytes
    ) -> bool:
        """Rename ``prepared`` to ``path`` where it is this change; whether it was (one
        that is not is discarded)."""
        if prepared is None:
            return False
        if not _fits(prepared, version, payload):
            self.discard(prepared)
            return False
        try:
            self._dir.rename_durable(prepared.path, path)
        except FileNotFoundError:  # gone meanwhile: the change is written whole
            return False
        return True

    def _snapshot_soon(self, catalog: Catalog) -> None:
        with self._lock:
            if self._snapshotting is not None and self._snapshotting.is_alive():
                return  # the next change asks again
            self._since_snapshot = self._bytes_since_snapshot = 0
            if not self._background:
                self._snapshot_and_prune(catalog)
                return
            self._snapshotting = threading.Thread(
                target=self._snapshot_and_prune, args=(catalog,), daemon=True
            )
            self._snapshotting.start()

    def flush(self) -> None:
        """Return once no snapshot is being written."""
        with self._lock:
            thread = self._snapshotting
        if thread is not None:
            thread.join()

    def _snapshot_and_prune(self, catalog: Catalog) -> None:
        try:
            self._write_snapshot(catalog)
            self._prune()
        except Exception as error:  # the changes stay: a load replays them instead
            log.warning("catalog snapshot of version %d not written: %s", catalog.version, error)

    def _write_snapshot(self, catalog: Catalog) -> None:
        payload = _dump(catalog.to_json())
        self._dir.write_atomic(self._path(f"{SNAPSHOT_PREFIX}{catalog.version:012d}.json"), payload)
        self.written += len(payload)
        self._snapshot_bytes = len(payload)

    def _prune(self) -> None:
        """Keep the two newest snapshots and the changes after the older of them (a load
        falls back to it if the newest does not read whole)."""
        names = self._dir.list(self._folder)
        snapshots = sorted(v for name in names if (v := _snapshot_version(name)) >= 0)
        if len(snapshots) < KEEP_SNAPSHOTS:
            return
        oldest_kept = snapshots[-KEEP_SNAPSHOTS]
        for name in names:
            version = _snapshot_version(name)
            if 0 <= version < oldest_kept or (
                _is_delta(name) and int(name[len(DELTA_PREFIX) : -5]) <= oldest_kept
            ):
                self._dir.delete(self._path(name))

    def _path(self, name: str) -> str:
        return posixpath.join(self._folder, name)


def _parse(payload: bytes) -> Any:
    """JSON read with the cyclic collector paused (see ``model.collector_paused``)."""
    with collector_paused():
        return json.loads(payload)


def _dump(document: Any) -> bytes:
    return json.dumps(document, separators=(",", ":")).encode()


def _fits(prepared: PreparedChange, version: int, payload: bytes) -> bool:
    """Whether ``prepared`` is the change to write: the same version, the same bytes
    (``SHARDFLOW_TEST_UNFENCED=prepared``: any prepared change of the version, and its test
    must then fail)."""
    if prepared.version != version:
        return False
    unfenced = "prepared" in os.environ.get(UNFENCED_VARIABLE, "").split(",")
    return prepared.payload == payload or unfenced


def _is_delta(name: str) -> bool:
    return name.startswith(DELTA_PREFIX) and name.endswith(".json") and name[6:-5].isdigit()


def _snapshot_version(name: str) -> int:
    """The version of a snapshot's file name (also a whole catalog as stores before the
    change log wrote them, ``<version>.json``); -1 for any other name."""
    if not name.endswith(".json"):
        return -1
    stem = name[len(SNAPSHOT_PREFIX) : -5] if name.startswith(SNAPSHOT_PREFIX) else name[:-5]
    return int(stem) if stem.isdigit() else -1


def _inject_catalog_fault(path: str, payload: bytes) -> None:
    """The test-only hook of :data:`CATALOG_FAULT_VARIABLE`: the change is written half,
    in place (as a filesystem without atomic puts would leave it), and the process dies."""
    if os.environ.get(CATALOG_FAULT_VARIABLE) != "torn-delta":
        return
    with open(path, "wb") as out:
        out.write(payload[: len(payload) // 2])
        out.flush()
        os.fsync(out.fileno())
    os.kill(os.getpid(), signal.SIGKILL)


def recorded_catalog(data_dir: str) -> Catalog:
    """The catalog the data directory holds (an empty one for a new directory), read before
    anything starts: a cluster that starts again starts as it was, its nodes under their
    ids, so that no unit moves."""
    return CatalogStore(DataDir.resolve(data_dir)).load() or Catalog()
