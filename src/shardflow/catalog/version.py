"""The data directory's format, and which formats this shardflow reads.

A data directory says in ``FORMAT`` (JSON: ``format``, ``written_by``) the layout its files
follow. The rule, for rolling upgrades: a release reads the format it writes and every
older one, and migrates an older one forward when the owner first opens it; a format
newer than it knows is refused with an error that says so, never read by mistake (an
older release sharing a cluster with a newer one sees the newer format only once the new
release has written it, after every node runs it). A directory without ``FORMAT`` was
written before formats were recorded: it is format 1, and the file is written when its
owner first opens it.

Formats:

1. ``catalog/`` (snapshots and deltas), ``lease.json``, ``migrations/``, and per shard
   ``tables/<uid>/<unit>/``: ``ckpt-<lsn>.duckdb`` with its record, ``wal-<lsn>-<batch>``
   entries, ``prep-<lsn>-<statement>`` prepared changes and ``holder.json``; ``holds/``
   (a backup's hold on log entries, ``storage/holds.py``: a release that does not know it
   deletes entries a backup waits for, and the backup then fails rather than hold a batch
   in part).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from importlib import metadata
from typing import Any

from shardflow.catalog.store import DataDir
from shardflow.errors import StorageError

FORMAT = 1
"""The format this shardflow writes."""
FORMAT_FILE = "FORMAT"
MIGRATIONS: dict[int, Callable[[DataDir], None]] = {}
"""Per format older than :data:`FORMAT`, the step that brings a data directory to the next
one (none yet: format 1 is the first)."""


@functools.cache
def release() -> str:
    """This shardflow's release (as installed)."""
    try:
        return metadata.version("shardflow")
    except metadata.PackageNotFoundError:  # pragma: no cover - run from a source tree
        return "unknown"


def _record(data_dir: DataDir) -> dict[str, Any] | None:
    """The ``FORMAT`` record, or None where the data directory has none."""
    try:
        record = json.loads(data_dir.read(data_dir.path(FORMAT_FILE)))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise StorageError(
            f"data directory {data_dir.uri!r}: unreadable {FORMAT_FILE}: {error}"
        ) from None
    if not isinstance(record, dict):
        raise StorageError(f"data directory {data_dir.uri!r}: {FORMAT_FILE} names no format")
    return record


def read_format(data_dir: DataDir) -> int:
    """The format of ``data_dir`` (1 where it records none); ``StorageError`` where its
    ``FORMAT`` file cannot be read, or names a format this shardflow does not read."""
    record = _record(data_dir)
    if record is None:
        return 1
    found = record.get("format")
    if not isinstance(found, int) or isinstance(found, bool) or found < 1:
        raise StorageError(f"data directory {data_dir.uri!r}: {FORMAT_FILE} names no format")
    if found > FORMAT:
        raise StorageError(
            f"data directory {data_dir.uri!r} is in format {found}, written by shardflow "
            f"{record.get('written_by', '?')}; this shardflow ({release()}) reads formats "
            f"1 to {FORMAT}: run the newer release (a node of an older one cannot serve it)"
        )
    return found


def open_format(data_dir: DataDir) -> int:
    """As the data directory's owner opens it: its format checked, migrated forward to
    :data:`FORMAT` where older, and recorded; returns the format it had."""
    recorded = _record(data_dir) is not None
    found = read_format(data_dir)
    for step in range(found, FORMAT):
        MIGRATIONS[step](data_dir)
    if found < FORMAT or not recorded:
        record = {"format": FORMAT, "written_by": release()}
        data_dir.write_atomic(data_dir.path(FORMAT_FILE), json.dumps(record).encode())
    return found
