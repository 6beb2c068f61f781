"""Holds on a data directory's log entries: while a backup copies the shards' files, a
checkpoint keeps the entries (and the older checkpoint) it covers instead of deleting them,
so that the backup can still take an insert it saw on one shard from the others (see
``storage/backup.py``). The next checkpoint after the hold ends deletes them, as it deletes
whatever its LSN covers.

A hold is a small file, ``<data dir>/holds/<name>.json``, with the time it ends; its owner
renews it while it works, and one whose owner died without taking it away ends by itself.

**Keeping the log between backups.** Where ``<data dir>/archive/keep-log.json`` is there
(``shardflow backup --keep-log`` writes it), a checkpoint moves the log entries it covers
into ``<data dir>/archive/<table uid>/<shard>/`` instead of deleting them; the next backup
takes them, then deletes them there. So the backups of a folder hold every acknowledged
insert between one and the next, and ``shardflow restore --as-of TIME`` can put a point
between two of them together (``storage/backup.py``).
"""

from __future__ import annotations

import json
import os
import threading
import time

from shardflow.catalog.store import UNFENCED_VARIABLE, DataDir

HOLDS_FOLDER = "holds"
ARCHIVE_FOLDER = "archive"
KEEP_LOG_FILE = "keep-log.json"
HOLD_TTL_S = 600.0
"""How long a hold lasts unless renewed (its owner renews it every tenth of that)."""


def held(data_dir: DataDir) -> bool:
    """Whether a live hold asks checkpoints to keep what they cover."""
    if "backup-hold" in os.environ.get(UNFENCED_VARIABLE, "").split(","):
        return False  # tests only: the hold ignored, and the backup's test must then fail
    folder = data_dir.path(HOLDS_FOLDER)
    now = time.time()
    for name in data_dir.list(folder):
        try:
            record = json.loads(data_dir.read(f"{folder}/{name}"))
            if float(record["until"]) > now:
                return True
        except (OSError, ValueError, KeyError, TypeError):
            continue  # gone meanwhile, or cut short: a hold being written is renewed soon
    return False


def keeping_log(data_dir: DataDir) -> float | None:
    """Since when checkpoints keep the log entries they cover in the archive (a time; None:
    they delete them)."""
    try:
        record = json.loads(data_dir.read(data_dir.path(ARCHIVE_FOLDER, KEEP_LOG_FILE)))
        return float(record["since"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return 0.0  # there but unreadable (being written?): keep, and say since when not known


def keep_log(data_dir: DataDir) -> float:
    """Have checkpoints keep the entries they cover from now on; since when they do."""
    since = keeping_log(data_dir)
    if since:
        return since
    since = time.time()
    data_dir.fs.create_dir(data_dir.path(ARCHIVE_FOLDER), recursive=True)
    data_dir.write_atomic(
        data_dir.path(ARCHIVE_FOLDER, KEEP_LOG_FILE),
        json.dumps({"since": since}).encode(),
        fenced=False,
    )
    return since


class Hold:
    """A hold on ``data_dir``'s log entries while the ``with`` block runs."""

    def __init__(self, data_dir: DataDir, name: str, ttl_s: float = HOLD_TTL_S) -> None:
        self.data_dir = data_dir
        self.path = data_dir.path(HOLDS_FOLDER, f"{name}.json")
        self.ttl_s = ttl_s
        self._stop = threading.Event()
        self._renewing = threading.Event()
        self._renewer = threading.Thread(target=self._renew, daemon=True, name=f"hold-{name}")

    def __enter__(self) -> Hold:
        self.data_dir.fs.create_dir(self.data_dir.path(HOLDS_FOLDER), recursive=True)
        self._write()
        self._renewer.start()
        self._renewing.wait(5.0)  # at its own priority before the copy begins
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._renewer.join()
        self.data_dir.delete(self.path, fenced=False)

    def _write(self) -> None:
        record = {"until": time.time() + self.ttl_s}
        self.data_dir.write_atomic(self.path, json.dumps(record).encode(), fenced=False)

    def _renew(self) -> None:
        try:  # started by a copy at idle priority: renewing must not starve with it
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        except (AttributeError, OSError):
            pass
        self._renewing.set()
        while not self._stop.wait(self.ttl_s / 10):
            self._write()
