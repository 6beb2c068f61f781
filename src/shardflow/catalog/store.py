"""Where the catalog lives: versioned JSON documents in the data directory.

The data directory is any pyarrow filesystem URI or a local path. Each catalog version is
written as a new object (``catalog/<version>.json``) and never overwritten, so a crash
mid-write leaves the previous version intact on every filesystem, object stores included;
the reader takes the highest complete version. Local writes are fsync'ed before rename.
"""

from __future__ import annotations

import json
import os
import posixpath
import threading
from dataclasses import dataclass

import pyarrow.fs as pafs

from shardflow.catalog.model import Catalog

KEEP_VERSIONS = 5


@dataclass(frozen=True)
class DataDir:
    """A resolved data directory: a filesystem and the root path inside it."""

    fs: pafs.FileSystem
    root: str
    uri: str

    @classmethod
    def resolve(cls, uri: str) -> DataDir:
        if "://" in uri:
            fs, root = pafs.FileSystem.from_uri(uri)
        else:
            fs, root = pafs.LocalFileSystem(), os.path.abspath(uri)
        fs.create_dir(root, recursive=True)
        return cls(fs, root, uri)

    @property
    def local(self) -> bool:
        return isinstance(self.fs, pafs.LocalFileSystem)

    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def write_atomic(self, path: str, data: bytes, *, sync: bool = True) -> None:
        """Write ``data`` so that ``path`` holds either nothing or all of it; durably (on
        disk before returning) unless ``sync`` is False."""
        if self.local:
            write_local_durable(path, data, sync=sync)
            return
        with self.fs.open_output_stream(path) as out:
            out.write(data)

    def list(self, path: str) -> list[str]:
        """Base names of the files directly under ``path`` (empty when it is missing)."""
        infos = self.fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
        return sorted(info.base_name for info in infos if info.type == pafs.FileType.File)

    def read(self, path: str) -> bytes:
        with self.fs.open_input_stream(path) as stream:
            return bytes(stream.read())

    def delete(self, path: str) -> None:
        try:
            self.fs.delete_file(path)
        except FileNotFoundError:
            pass

    def delete_dir(self, path: str) -> None:
        try:
            self.fs.delete_dir(path)
        except FileNotFoundError:
            pass


def write_local_durable(path: str, data: bytes, *, sync: bool = True) -> None:
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    with open(tmp, "wb") as out:
        out.write(data)
        out.flush()
        if sync:
            os.fsync(out.fileno())
    os.replace(tmp, path)
    if sync:
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
        self._folder = data_dir.path("catalog")
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
