"""Where the catalog lives: versioned JSON documents in the data directory.

The data directory is any pyarrow filesystem URI or a local path. Each catalog version is
written as a new object (``catalog/<version>.json``) and never overwritten, so a crash
mid-write leaves the previous version intact on every filesystem, object stores included;
the reader takes the highest complete version. Local writes are fsync'ed before rename.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import posixpath
import threading
from dataclasses import dataclass

import pyarrow.fs as pafs

from shardflow.catalog.model import Catalog
from shardflow.errors import OwnershipLostError, StorageError

KEEP_VERSIONS = 5
CATALOG_FOLDER = "catalog"
LEASE_FILE = "owner.json"
"""The data directory's owner record (see ``shardflow.catalog.lease``)."""


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
        """Base names of the files directly under ``path`` (empty when it is missing)."""
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


class CatalogStore:
    """Loads and saves :class:`Catalog` versions under ``<data dir>/catalog``."""

    def __init__(self, data_dir: DataDir) -> None:
        self._dir = data_dir
        self._folder = data_dir.path(CATALOG_FOLDER)
        data_dir.fs.create_dir(self._folder, recursive=True)

    def load(self) -> Catalog | None:
        for name in reversed(self._versions()):
            try:
                return Catalog.from_json(json.loads(self._dir.read(self._path(name))))
            except (ValueError, KeyError):
                continue  # a torn write on a filesystem without atomic puts: try the older
        return None

    def save(self, catalog: Catalog) -> None:
        payload = json.dumps(catalog.to_json(), separators=(",", ":")).encode()
        self._dir.write_atomic(self._path(f"{catalog.version:012d}.json"), payload)
        for old in self._versions()[:-KEEP_VERSIONS]:
            self._dir.delete(self._path(old))

    def _versions(self) -> list[str]:
        return [n for n in self._dir.list(self._folder) if n.endswith(".json")]

    def _path(self, name: str) -> str:
        return posixpath.join(self._folder, name)
