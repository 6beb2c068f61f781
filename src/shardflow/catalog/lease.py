"""Who owns a data directory: one cluster at a time, by a lease with a fencing epoch.

A cluster's coordinator takes the lease when it starts and renews it while it runs. The
record (``owner.json`` in the data directory) names the owning cluster, its *epoch* and the
process that holds it. Every durable write of the cluster — catalog versions, log entries,
Parquet bases, deletions — first checks that the record still names its owner and epoch
(:meth:`DataDir.check_owner <shardflow.catalog.store.DataDir.check_owner>`), so a cluster that
lost the directory to another one (it hung past its lease, or was declared gone) cannot
write there any more: its late writes are refused, as a stale leader's are with the epochs of
ZooKeeper-style leases or Kafka's controller.

The lease passes to a new cluster when its holder is gone:

* at once when the record was released (a clean ``close()``), or the holding process ran on
  this machine and has exited (a crash, ``SIGKILL``);
* otherwise once it has not been renewed for ``ttl_s`` (a holder on another machine).

A new owner takes the next epoch and then waits :data:`TAKEOVER_GRACE_S` before it reads
anything, so that a write of the old owner that passed its check just before the new record
was written has landed (a write is one file; it takes milliseconds).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace

from shardflow.catalog.store import LEASE_FILE, DataDir, OwnerToken
from shardflow.errors import DataDirInUseError

LOCK_FILE = "owner.lock"
LOCK_WAIT_S = 10.0
"""How long a lease change waits for another process of this machine to end its own: one
takes milliseconds, so a process that holds the lock this long is frozen (stopped, or its
machine stalled) and would keep every other one waiting for as long as it stays so."""
TAKEOVER_GRACE_S = 1.0
"""How long a new owner waits after taking the lease from a holder that did not release it:
ample for a single write that passed its ownership check before the takeover to finish."""


@dataclass(frozen=True)
class Holder:
    """The process that holds a lease, and the machine it runs on."""

    host: str
    boot_id: str
    pid: int

    @classmethod
    def this_process(cls) -> Holder:
        return cls(socket.gethostname(), _boot_id(), os.getpid())

    def alive(self) -> bool | None:
        """Whether the process still runs: None when it ran on another machine (unknowable
        from here)."""
        me = Holder.this_process()
        if self.host != me.host or self.boot_id != me.boot_id:
            return None if self.host != me.host else False  # same host, rebooted: gone
        return process_running(self.pid)


@dataclass(frozen=True)
class LeaseRecord:
    owner: str
    epoch: int
    holder: Holder
    renewed_at: float
    """Wall-clock time of the last renewal."""
    ttl_s: float
    description: str = ""
    """Who the owner is, for the message a refused cluster shows."""
    released: bool = False

    @property
    def token(self) -> OwnerToken:
        return OwnerToken(self.owner, self.epoch)

    def expired(self, now: float) -> bool:
        return now > self.renewed_at + self.ttl_s

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, payload: bytes) -> LeaseRecord:
        data = json.loads(payload)
        data["holder"] = Holder(**data["holder"])
        return cls(**data)


def read_lease(data_dir: DataDir) -> LeaseRecord | None:
    """The current lease record (None if the directory was never owned)."""
    try:
        payload = data_dir.read(data_dir.path(LEASE_FILE))
    except FileNotFoundError:
        return None
    try:
        return LeaseRecord.from_json(payload)
    except (ValueError, KeyError, TypeError):
        return None  # torn by a crash mid-write on a filesystem without atomic puts


def vacant(record: LeaseRecord | None, owner: str, now: float) -> bool:
    """Whether ``owner`` may take the lease ``record`` describes."""
    if record is None or record.released or record.owner == owner:
        return True
    if record.holder.alive() is False:  # it ran here and has exited
        return True
    return record.expired(now)


def acquire(data_dir: DataDir, owner: str, ttl_s: float, description: str = "") -> OwnerToken:
    """Take the lease of ``data_dir`` for cluster ``owner``; returns its token. A cluster
    that restarts its coordinator keeps its epoch; a new owner takes the next one. Raises
    :class:`DataDirInUseError` while another live cluster holds it."""
    with _exclusive(data_dir):
        now = time.time()
        record = read_lease(data_dir)
        if not vacant(record, owner, now):
            assert record is not None
            raise DataDirInUseError(in_use_message(data_dir, record, now))
        takeover = record is not None and record.owner != owner and not record.released
        if record is None:
            epoch = 1
        elif record.owner == owner and not record.released:
            epoch = record.epoch  # our own coordinator, restarted
        else:
            epoch = record.epoch + 1
        mine = LeaseRecord(owner, epoch, Holder.this_process(), now, ttl_s, description)
        _write(data_dir, mine)
    if not data_dir.local:  # no lock across machines: make sure no one else won the race
        time.sleep(min(0.2, ttl_s / 10))
        if (found := read_lease(data_dir)) is None or found.token != mine.token:
            holder = found or mine
            raise DataDirInUseError(in_use_message(data_dir, holder, time.time()))
    if takeover:
        time.sleep(TAKEOVER_GRACE_S)
    return mine.token


def renew(data_dir: DataDir, token: OwnerToken) -> bool:
    """Extend the lease; False when it is no longer ours (another cluster took it)."""
    with _exclusive(data_dir):
        record = read_lease(data_dir)
        if record is None or record.token != token or record.released:
            return False
        _write(data_dir, replace(record, renewed_at=time.time(), holder=Holder.this_process()))
        return True


def release(data_dir: DataDir, token: OwnerToken) -> None:
    """Give the lease up (a clean shutdown): the next cluster takes it at once."""
    with _exclusive(data_dir):
        record = read_lease(data_dir)
        if record is not None and record.token == token:
            _write(data_dir, replace(record, released=True, renewed_at=time.time()))


def this_process(cluster: str) -> str:
    """A lease's description of ``cluster`` (what kind) run by this process: its pid and
    command line, as a refused second owner is told."""
    return f"the {cluster} of pid {os.getpid()} ({' '.join(sys.argv)[:80]})"


def in_use_message(data_dir: DataDir, record: LeaseRecord, now: float) -> str:
    where = f"pid {record.holder.pid} on {record.holder.host}"
    age = max(0.0, now - record.renewed_at)
    left = max(0.0, record.ttl_s - age)
    who = f" ({record.description})" if record.description else ""
    return (
        f"data directory {data_dir.uri!r} is served by another shardflow cluster{who}, "
        f"{where}, lease renewed {age:.1f}s ago. Close that cluster first (a command's own "
        "cluster closes when the command ends), or connect to its Ray cluster with "
        "connect(address=...). A data directory has one owner at a time; if that cluster is "
        f"gone, its lease expires in {left:.0f}s."
    )


def _write(data_dir: DataDir, record: LeaseRecord) -> None:
    data_dir.write_atomic(data_dir.path(LEASE_FILE), record.to_json(), fenced=False)


@contextlib.contextmanager
def _exclusive(data_dir: DataDir) -> Iterator[None]:
    """Serialise lease changes among the processes of this machine (on local data dirs)."""
    if not data_dir.local:
        yield
        return
    fd = os.open(data_dir.path(LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise DataDirInUseError(
                        f"the lease of data directory {data_dir.uri!r} is being changed by "
                        f"another process of this machine that has held its lock "
                        f"({LOCK_FILE}) for {LOCK_WAIT_S:g} s: it is stopped or frozen; "
                        "resume or end it, then try again"
                    ) from None
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def process_running(pid: int) -> bool:
    """Whether process ``pid`` of this machine runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, owned by someone else
    try:  # a killed process its parent has not reaped yet is gone all the same
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            state = handle.read().rsplit(")", 1)[-1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return True
