"""A worker's place on its machine: its folder under ``local_dir`` (DuckDB spills there),
its share of the machine's memory, and the check that it reaches the coordinator's data
directory (shared storage on a cluster of several machines)."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile

import pyarrow as pa

from shardflow.catalog import DataDir, OwnerToken, lease
from shardflow.config import MIN_WORKER_MEMORY_MB, Settings
from shardflow.errors import ConfigError
from shardflow.telemetry.devices import machine_memory_bytes


def check_shared(data_dir: DataDir, owner: OwnerToken, node_id: str) -> None:
    """Refuse to serve from a data directory that is not the coordinator's: the lease it
    wrote must be readable here. (A path on a node's own disk instead of shared storage
    holds no lease, or another cluster's.)"""
    record = lease.read_lease(data_dir)
    if record is None or record.owner != owner.owner:
        seen = "no lease" if record is None else f"the lease of another cluster ({record.owner})"
        raise ConfigError(
            f"{node_id} on {socket.gethostname()} cannot reach the data directory "
            f"{data_dir.uri!r} the coordinator uses: it finds {seen} there. A cluster of "
            "several machines needs a data directory on storage every node reaches (a shared "
            "path or a filesystem URI)."
        )


MEMORY_SHARE = 0.75
"""Of the machine's memory, what the workers on it may use together by default."""
LOCAL_DIR = "shardflow-local"


def default_memory_mb(workers_here: int = 1) -> int:
    """A worker's share of this machine's memory (``worker_memory_mb`` = 0), in MiB."""
    share = int(machine_memory_bytes() * MEMORY_SHARE) // max(1, workers_here)
    return max(MIN_WORKER_MEMORY_MB, share >> 20)


def machine_share(settings: Settings, workers_here: int) -> Settings:
    """``settings`` for ``workers_here`` workers sharing this machine (an embedded cluster,
    or one in this process): where not set, each gets its share of the cores for DuckDB's
    threads (oversubscribing them with one thread per core in every worker measured ~8 %
    slower on TPC-H) and of the memory (DuckDB spills beyond it)."""
    if not settings.engine_threads:
        settings = settings.replace(engine_threads=max(1, (os.cpu_count() or 1) // workers_here))
    if not settings.worker_memory_mb:
        settings = settings.replace(worker_memory_mb=default_memory_mb(workers_here))
    return settings


def local_root(local_dir: str) -> str:
    """The ``local_dir`` setting's folder on this machine, made if missing; a
    ``ConfigError`` when it cannot be made or written."""
    root = local_dir or os.path.join(tempfile.gettempdir(), LOCAL_DIR)
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"setting local_dir: cannot make {root!r}: {error}") from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise ConfigError(f"setting local_dir: {root!r} is not writable")
    return root


def local_folder(local_dir: str, node_id: str) -> str:
    """This worker process's own folder under ``local_dir`` (DuckDB spills there). Folders
    of worker processes that are gone (a SIGKILL leaves them) are removed first."""
    root = local_root(local_dir)
    for name in os.listdir(root):
        pid = name.rsplit("-", 1)[-1]
        if pid.isdigit() and not lease.process_running(int(pid)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return os.path.join(root, f"{node_id}-{os.getpid()}")


def release_memory() -> None:
    """Hand memory Arrow's allocator keeps after big work (a load, a move) back to the
    system: the rows live in DuckDB now, and a worker's resident memory should be that."""
    pa.default_memory_pool().release_unused()
