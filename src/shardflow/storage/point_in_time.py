"""A restore as of a time between two backups: the backup before it, and the log up to it.

Where a data directory keeps its log (``shardflow backup --keep-log``: ``storage/holds.py``),
the log entries a checkpoint covers are archived until the next backup takes them, so two
backups of one folder, ``before`` and ``after``, hold between them every log entry written
from ``before``'s cuts on. A point ``at`` between them (after ``before`` finished, before
``after`` began) is put together as:

- ``before``'s files: each shard's checkpoint and what else its cut took, but its log
  entries only as they pass below; ``after``'s holder records (they know of the copies that
  held a shard since, and so of the entries no copy acknowledged);
- every log entry of ``before`` and ``after`` (their cuts and the log they kept) past the
  checkpoint ``before`` took of its shard, of an insert batch some part of which was written
  at ``at`` or earlier (each entry carries the time it was written), and only where every
  unit the batch was routed to has its part (in an entry or in the checkpoint). An insert
  acknowledged by ``at`` was whole in the log by then; one acknowledged later is whole or
  left out, never in part;
- ``before``'s catalog.

That holds only where a table's files are the same shards with the same rows at both ends
but for appends: a table split or merged, changed by DELETE, UPDATE or TRUNCATE, created or
dropped between the two backups is refused (:class:`StorageError` naming the tables and
the two backups that can be restored whole). So does a stretch the log was not kept for,
and entries of a release that wrote no time (0.2.0 and before).
"""

from __future__ import annotations

import io
import json
import posixpath
import time
from collections import defaultdict
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from shardflow.catalog import Catalog
from shardflow.errors import StorageError
from shardflow.storage.partition import batch_units
from shardflow.storage.shard_store import (
    HOLDER_FILE,
    LOGGED_AT,
    Holder,
    _entry_of,
    _is_checkpoint,
    _is_log_entry,
    _is_parquet_base,
    _lsn_of,
    _meta_name,
    _superseded,
)

Read = Callable[[dict[str, Any]], bytes]
"""The bytes of a file a manifest names (its chunks, read and checked)."""


@dataclass
class _Entry:
    rel: str
    folder: str
    lsn: int
    batch: str
    logged_at: float
    units: list[int] | None
    file: dict[str, Any]


def _when(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))


def manifest_as_of(
    manifests: list[dict[str, Any]], at: float, read: Read, layout: Callable[..., Any]
) -> dict[str, Any]:
    """The manifest of the data directory as it was at ``at`` (seconds since the epoch),
    from the manifests of a backup folder, oldest first (see the module's text).
    ``layout(catalog, table)`` says what a table's files depend on."""
    before, after = _around(manifests, at)
    old = Catalog.from_json(before["catalog"])
    new = Catalog.from_json(after["catalog"])
    changed = sorted(
        name
        for name in set(old.tables) | set(new.tables)
        if name not in old.tables
        or name not in new.tables
        or layout(old, name) != layout(new, name)
    )
    if changed:
        raise StorageError(
            f"no point between backups {before['id']} and {after['id']} can be put together: "
            f"{', '.join(changed)} changed other than by inserts in between (a split or "
            "merge, a change of rows, a truncate, a table created or dropped); restore one "
            "of the two whole (--id)"
        )
    files = {rel: f for rel, f in before["files"].items() if not _is_log_entry(_name(rel))}
    folders = {posixpath.dirname(rel) for rel in before["files"]}
    for rel, found in after["files"].items():  # the newer holder records
        if _name(rel) == HOLDER_FILE and posixpath.dirname(rel) in folders:
            files[rel] = found
    bases = _bases(files, read)
    limits = {
        posixpath.dirname(rel): _superseded(
            [Holder(**h) for h in json.loads(read(found))["holders"]]
        )
        for rel, found in files.items()
        if _name(rel) == HOLDER_FILE
    }
    entries: dict[str, _Entry] = {}
    for source in (before["files"], after.get("archive", {}), after["files"]):
        for rel, found in source.items():
            folder = posixpath.dirname(rel)
            name = _name(rel)
            if not _is_log_entry(name) or folder not in folders or rel in entries:
                continue
            lsn = _lsn_of(name) or 0
            batch, writer = _entry_of(name)
            if lsn <= bases[folder][0] or lsn > limits.get(folder, {}).get(writer, lsn):
                continue  # in the checkpoint, or never acknowledged (a later copy took over)
            entries[rel] = _read_entry(rel, folder, lsn, batch, found, read)
    for rel in _whole_batches_by(entries.values(), folders, bases, at):
        files[rel] = entries[rel].file
    return {
        **before,
        "files": files,
        "archive": {},
        "finished_at": at,
        "bytes": sum(found["size"] for found in files.values()),
    }


def _around(manifests: list[dict[str, Any]], at: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """The backup finished last by ``at``, and the one after it; refused where ``at`` is
    not between two, falls while the second ran or the log was not kept between them."""
    if not manifests:
        raise StorageError("no backups to restore from")
    done = [i for i, m in enumerate(manifests) if m["finished_at"] <= at]
    if not done:
        raise StorageError(
            f"no backup there was finished by {_when(at)}: the oldest finished at "
            f"{_when(manifests[0]['finished_at'])}"
        )
    before = manifests[done[-1]]
    if done[-1] + 1 == len(manifests):
        raise StorageError(
            f"no backup after {_when(at)} holds the log up to it (the newest, {before['id']}, "
            f"finished at {_when(before['finished_at'])}): take one (shardflow backup) and "
            "restore again"
        )
    after = manifests[done[-1] + 1]
    if at >= after["started_at"]:
        raise StorageError(
            f"{_when(at)} falls while backup {after['id']} ran ({_when(after['started_at'])} to "
            f"{_when(after['finished_at'])}): restore it whole (--id), or a time outside it"
        )
    since = after.get("keep_log_since")
    if since is None or since > before["started_at"]:
        raise StorageError(
            f"the log was not kept between backups {before['id']} and {after['id']} (keep it "
            "with `shardflow backup --keep-log`): restore one of the two whole (--id)"
        )
    return before, after


def _name(rel: str) -> str:
    return posixpath.basename(rel)


def _bases(files: dict[str, dict[str, Any]], read: Read) -> dict[str, tuple[int, set[str]]]:
    """Per shard folder, the LSN of its base and the batches its checkpoint's record names."""
    bases: dict[str, tuple[int, set[str]]] = defaultdict(lambda: (0, set()))
    for rel in files:
        name = _name(rel)
        lsn = _lsn_of(name)
        if lsn is None or not (_is_checkpoint(name) or _is_parquet_base(name)):
            continue
        folder = posixpath.dirname(rel)
        if lsn < bases[folder][0]:
            continue
        applied: set[str] = set()
        record = posixpath.join(folder, _meta_name(name))
        if _is_checkpoint(name) and record in files:
            applied = set(json.loads(read(files[record])).get("applied", {}))
        bases[folder] = (lsn, applied)
    return bases


def _read_entry(
    rel: str, folder: str, lsn: int, batch: str, found: dict[str, Any], read: Read
) -> _Entry:
    schema = pa.ipc.open_stream(io.BytesIO(read(found))).schema
    stamp = (schema.metadata or {}).get(LOGGED_AT)
    if stamp is None:
        raise StorageError(
            f"log entry {rel} carries no time (written by shardflow 0.2.0 or before): a "
            "restore as of a time needs the log written since by a later release"
        )
    return _Entry(rel, folder, lsn, batch, float(stamp), batch_units(schema), found)


def _whole_batches_by(
    entries: Collection[_Entry],
    folders: set[str],
    bases: dict[str, tuple[int, set[str]]],
    at: float,
) -> list[str]:
    """The entries of batches written in part by ``at`` that every unit they were routed to
    holds (an entry or its checkpoint): the rest is left out whole."""
    by_batch: dict[tuple[str, str], list[_Entry]] = defaultdict(list)
    for entry in entries:
        table = posixpath.dirname(entry.folder)
        by_batch[(table, entry.batch)].append(entry)
    taken: list[str] = []
    for (table, batch), parts in by_batch.items():
        if min(part.logged_at for part in parts) > at:
            continue
        holding = {posixpath.basename(part.folder) for part in parts}
        routed = {str(u) for part in parts for u in (part.units or [])}
        missing = [
            unit
            for unit in routed
            if unit not in holding
            and (folder := posixpath.join(table, unit)) in folders
            and batch not in bases[folder][1]
        ]
        if not missing:
            taken += [part.rel for part in parts]
    return taken
