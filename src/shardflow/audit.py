"""The audit log: one JSON line per refused login, denied call, control action and change
of data, chained by hashes so that an edited or removed line shows (:class:`AuditLog`).
Written by the network service and by the workers' Flight endpoints (a refused ticket),
from any process that reaches the data directory; read by ``shardflow audit``."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import stat
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from shardflow.errors import ConfigError


def aware(moment: datetime) -> datetime:
    """``moment`` with a time zone; a naive one is taken as local time."""
    return moment if moment.tzinfo is not None else moment.astimezone()


@contextlib.contextmanager
def locked(folder: Path) -> Iterator[None]:
    """This process alone among all others in ``folder`` (made private if missing):
    ``flock`` on its ``.lock`` file."""
    make_private_dir(folder)
    fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def make_private_dir(path: Path) -> None:
    if not path.is_dir():
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(path, 0o700)  # mkdir's mode is masked by the umask


def _jsonable(value: Any) -> Any:
    """``value`` as JSON can hold it: containers walked, anything else unknown as text."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_jsonable(v) for v in value]
    return str(value)


AUDIT_FILE = "audit.jsonl"
GENESIS = "0" * 64
"""The ``prev`` of the first entry of an audit log."""
CHAIN_FIELDS = ("prev", "hash")
TAIL_BYTES = 1 << 20
"""How far back from a file's end its last entry is looked for (an entry is far shorter)."""


class AuditLog:
    """Append-only JSON lines in ``<data_dir>/audit/audit.jsonl``, one per request.

    **Chained.** Each entry carries the hash of the entry before it (``prev``) and its own
    (``hash``: SHA-256 of its other fields, ``prev`` included), so that a line removed,
    edited or moved breaks the chain where it was (:meth:`verify`).

    **Rotated.** Once the file reaches ``max_bytes``, or its first entry is ``max_age_s``
    old, it is renamed ``audit-<UTC time>.jsonl`` and a new one begins; the chain runs on
    from one file to the next. Rotated files are kept (archive or delete the oldest: the
    chain is checked from the oldest file there is).

    Writers (threads, and processes: several service replicas) append under an exclusive
    lock (``flock`` on ``audit/.lock``): read the last entry's hash, write the line in one
    ``write`` to a file opened with ``O_APPEND``, fsync. A line torn by a crash is skipped
    when read and by the chain. Every file is the owner's only (0600, the folder 0700):
    :meth:`check_private` refuses a log others can read.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        max_bytes: int = 64 << 20,
        max_age_s: float = 30 * 86400.0,
    ) -> None:
        self.folder = Path(os.fspath(data_dir)) / "audit"
        self.path = self.folder / AUDIT_FILE
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self._lock = threading.Lock()
        self._last: tuple[tuple[int, int], str] | None = None
        """(inode, size) of the current file after our last look, and its last hash."""
        self._first: tuple[int, datetime | None] | None = None
        """The current file's inode and the time of its first entry."""

    def record(
        self,
        who: str,
        action: str,
        arguments: Mapping[str, Any],
        outcome: str,
        duration_s: float,
        when: datetime | None = None,
    ) -> None:
        """Append one entry; ``outcome`` is "ok", "denied: needs operator", "error: ..."."""
        moment = aware(when) if when is not None else datetime.now(UTC)
        entry: dict[str, Any] = {
            "time": moment.astimezone(UTC).isoformat(timespec="milliseconds"),
            "who": who,
            "action": action,
            "arguments": _jsonable(arguments),
            "outcome": outcome,
            "duration_s": round(float(duration_s), 6),
        }
        with self._lock, self._exclusive():
            self._rotate_if_due()
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                entry["prev"] = self._last_hash(fd)
                entry["hash"] = _entry_hash(entry)
                line = (json.dumps(entry, ensure_ascii=False) + "\n").encode()
                written = os.write(fd, line)
                while written < len(line):  # only on a full disk or an interrupted write
                    written += os.write(fd, line[written:])
                os.fsync(fd)
                found = os.fstat(fd)
                self._last = ((found.st_ino, found.st_size), entry["hash"])
            finally:
                os.close(fd)

    def files(self) -> list[Path]:
        """The log's files, oldest first (rotated ones, then the current one)."""
        try:
            rotated = sorted(p for p in self.folder.glob("audit-*.jsonl"))
        except OSError:
            rotated = []
        return [*rotated, *([self.path] if self.path.exists() else [])]

    def entries(self, since: datetime | None = None) -> list[dict[str, Any]]:
        """The entries in the order written (every file), those at or after ``since`` only
        if given; without their chain fields."""
        start = aware(since) if since is not None else None
        found: list[dict[str, Any]] = []
        for entry, _, _ in self._read():
            if start is not None:
                try:
                    moment = aware(datetime.fromisoformat(str(entry.get("time"))))
                except ValueError:
                    continue
                if moment < start:
                    continue
            found.append({k: v for k, v in entry.items() if k not in CHAIN_FIELDS})
        return found

    def verify(self) -> AuditCheck:
        """Walk the chain through every file: the entries, the torn lines skipped, and the
        first place it breaks (None: intact)."""
        running: str | None = None
        count = torn = 0
        for entry, where, _ in self._read(torn_too=True):
            if entry is None:
                torn += 1
                continue
            count += 1
            if "hash" not in entry:  # written before entries were chained
                if running is not None:
                    return AuditCheck(count, torn, f"{where}: an entry without its hash")
                continue
            if running is not None and entry.get("prev") != running:
                return AuditCheck(
                    count,
                    torn,
                    f"{where}: the chain breaks before it (a line removed, edited or moved)",
                )
            if _entry_hash(entry) != entry["hash"]:
                return AuditCheck(count, torn, f"{where}: this line was edited")
            running = str(entry["hash"])
        return AuditCheck(count, torn, None)

    def check_private(self) -> None:
        """Refuse (``ConfigError``) an audit folder or file that others than its owner may
        read or write."""
        for path in [self.folder, *self.files(), self.folder / ".lock"]:
            try:
                mode = stat.S_IMODE(os.stat(path).st_mode)
            except FileNotFoundError:
                continue
            if mode & 0o077:
                raise ConfigError(
                    f"{path} is open to others (mode {mode:o}); the audit log is its owner's "
                    f"only: chmod {'700' if path.is_dir() else '600'} {path}"
                )

    # -- inside -------------------------------------------------------------------------
    def _exclusive(self) -> contextlib.AbstractContextManager[None]:
        return locked(self.folder)

    def _rotate_if_due(self) -> None:
        try:
            found = os.stat(self.path)
        except FileNotFoundError:
            return
        due = found.st_size >= self.max_bytes
        if not due and self.max_age_s > 0:
            if self._first is None or self._first[0] != found.st_ino:
                self._first = (found.st_ino, _first_time(self.path))
            first = self._first[1]
            due = first is not None and time.time() - first.timestamp() >= self.max_age_s
        if due:
            stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
            os.replace(self.path, self.folder / f"audit-{stamp}.jsonl")
            fsync_folder(self.folder)

    def _last_hash(self, fd: int) -> str:
        """The hash of the last entry before this one (under the lock): of the current
        file, else of the newest rotated file, else :data:`GENESIS`. A torn last line gets
        its newline first, so that this entry starts a line of its own."""
        found = os.fstat(fd)
        if self._last is not None and self._last[0] == (found.st_ino, found.st_size):
            return self._last[1]
        if found.st_size:
            tail = os.pread(fd, min(TAIL_BYTES, found.st_size), max(0, found.st_size - TAIL_BYTES))
            if not tail.endswith(b"\n"):
                os.write(fd, b"\n")
            last = _last_entry_hash(tail)
            if last is not None:
                return last
        for older in reversed(self.files()[:-1]):
            last = _last_entry_hash(_tail(older))
            if last is not None:
                return last
        return GENESIS

    def _read(self, torn_too: bool = False) -> Iterator[tuple[Any, str, Path]]:
        for path in self.files():
            try:
                lines = path.open("rb")
            except FileNotFoundError:  # rotated meanwhile: read where it went
                continue
            with lines:
                for number, raw in enumerate(lines, 1):
                    try:
                        entry = json.loads(raw)
                    except ValueError:  # torn by a crash mid-write (or blank)
                        entry = None
                    if not isinstance(entry, dict):
                        if torn_too and raw.strip():
                            yield None, f"{path.name}:{number}", path
                        continue
                    yield entry, f"{path.name}:{number}", path


@dataclass(frozen=True)
class AuditCheck:
    """What :meth:`AuditLog.verify` found."""

    entries: int
    torn: int
    """Lines torn by a crash mid-write (skipped; the chain runs past them)."""
    broken: str | None
    """Where the chain first breaks (file:line and why), or None."""


def _entry_hash(entry: Mapping[str, Any]) -> str:
    body = {k: v for k, v in entry.items() if k != "hash"}
    canonical = json.dumps(body, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _last_entry_hash(tail: bytes) -> str | None:
    for raw in reversed(tail.split(b"\n")):
        try:
            entry = json.loads(raw)
        except ValueError:
            continue
        if isinstance(entry, dict) and isinstance(entry.get("hash"), str):
            return str(entry["hash"])
    return None


def _tail(path: Path) -> bytes:
    with path.open("rb") as handle:
        size = handle.seek(0, os.SEEK_END)
        handle.seek(max(0, size - TAIL_BYTES))
        return handle.read()


def _first_time(path: Path) -> datetime | None:
    try:
        with path.open("rb") as handle:
            first = json.loads(handle.readline())
        return aware(datetime.fromisoformat(str(first["time"])))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
