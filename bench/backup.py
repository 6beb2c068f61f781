"""Online backup and restore beside a plain copy of the same files: TPC-H ``lineitem`` and
``orders`` on N workers; readers run point lookups all along. Measured, in one run:

* a plain copy of the data directory's table files (each file synced, as a backup's packs
  are): the bytes per second a backup and a restore are held against;
* a full backup while the readers run (their p99 against the same readers without it);
* an incremental backup after 1 % of lineitem's rows were inserted (bytes it wrote against
  the full backup's);
* a restore of the full backup into a new data directory, started on 2 workers, its rows
  counted against the source's.

The last line is ``backup_mb_s=A restore_mb_s=B backup_p99_ratio=C incremental_ratio=D``.

    python bench/backup.py --sf 1 --workers 4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import shardflow
from shardflow import tpch
from shardflow.catalog import DataDir
from shardflow.storage import backup as backups

TABLES = ("lineitem", "orders")
ROUNDS = 5
"""Full backups taken (each alternated with a window of reads without one)."""
T = TypeVar("T")
COUNT = "SELECT (SELECT count(*) FROM lineitem) AS l, (SELECT count(*) FROM orders) AS o"


CHILD = """
import json, os, sys
from shardflow.catalog import DataDir
from shardflow.storage import backup
for line in sys.stdin:  # one backup per line: the data directory, then the folder
    data_dir, to = json.loads(line)
    info = backup.backup(
        DataDir.resolve(data_dir), to, priority=sys.argv[1], max_rate_mb_s=float(sys.argv[2])
    )
    print(json.dumps([info.backup_id, info.finished_at - info.started_at]), flush=True)
"""


class BackupProcess:
    """Backups taken by a process of their own, as ``shardflow backup`` takes them (started
    ahead, so that a backup's window holds the backup, not Python's start)."""

    def __init__(self, priority: str, max_rate_mb_s: float) -> None:
        self.child = subprocess.Popen(
            [sys.executable, "-c", CHILD, priority, str(max_rate_mb_s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def backup(self, data_dir: Path, to: str) -> tuple[str, float]:
        """The backup's id and its own seconds."""
        assert self.child.stdin is not None and self.child.stdout is not None
        self.child.stdin.write(json.dumps([str(data_dir), to]) + "\n")
        self.child.stdin.flush()
        backup_id, seconds = json.loads(self.child.stdout.readline())
        return backup_id, seconds

    def close(self) -> None:
        assert self.child.stdin is not None
        self.child.stdin.close()
        self.child.wait()


def p99(latencies: list[float]) -> float:
    """In milliseconds."""
    taken = sorted(latencies)
    return 1000 * taken[int(0.99 * (len(taken) - 1))]


def plain_copy(source: Path, target: Path) -> tuple[int, float]:
    """Copy every file under ``source`` (synced one by one); bytes and seconds."""
    began = time.perf_counter()
    copied = 0
    for folder, _, names in os.walk(source):
        into = target / Path(folder).relative_to(source)
        into.mkdir(parents=True, exist_ok=True)
        for name in names:
            shutil.copyfile(Path(folder) / name, into / name)
            with open(into / name, "rb+") as handle:
                os.fsync(handle.fileno())
            copied += (into / name).stat().st_size
    return copied, time.perf_counter() - began


def copy_in_child(source: Path, target: Path) -> tuple[int, float]:
    """:func:`plain_copy` in a process of its own (started, then timed)."""
    script = (
        "import json, sys; sys.path.insert(0, sys.argv[3]); from backup import plain_copy; "
        "from pathlib import Path; print(json.dumps(plain_copy(Path(sys.argv[1]), "
        "Path(sys.argv[2]))))"
    )
    bench = str(Path(__file__).parent)
    done = subprocess.run(
        [sys.executable, "-c", script, str(source), str(target), bench],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    copied, seconds = json.loads(done.stdout.splitlines()[-1])
    return int(copied), float(seconds)


class Readers:
    """Point lookups on orders at a steady rate (``rate`` a second over ``threads``
    threads; a service's readers, not a loop that takes every cycle it is given, whose
    latency would only say how the cores were shared); latencies per window."""

    def __init__(
        self, db: shardflow.Database, keys: list[int], rate: float, threads: int = 2
    ) -> None:
        self.db = db
        self.keys = keys
        self.every = threads / rate
        self.stop = threading.Event()
        self.window: list[float] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._read, args=(i,)) for i in range(threads)]
        for thread in self.threads:
            thread.start()

    def _read(self, seed: int) -> None:
        index = seed
        due = time.perf_counter()
        while not self.stop.is_set():
            due += self.every
            self.stop.wait(max(0.0, due - time.perf_counter()))
            key = self.keys[index % len(self.keys)]
            index += 7
            began = time.perf_counter()
            self.db.sql(f"SELECT o_totalprice FROM orders WHERE o_orderkey = {key}")
            with self.lock:
                self.window.append(time.perf_counter() - began)

    def window_of(self, action: Callable[[], T]) -> tuple[list[float], T]:
        """The reads' latencies while ``action`` runs, and what it answered."""
        with self.lock:
            self.window = []
        result = action()
        with self.lock:
            return list(self.window), result

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sf", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--home", type=Path, default=Path(".shardflow-bench"))
    parser.add_argument(
        "--to", type=Path, help="Where the backups go (default: beside the data directory)."
    )
    parser.add_argument(
        "--read-rate", type=float, default=100.0, help="Point lookups a second, all along."
    )
    parser.add_argument(
        "--max-rate-mb-s", type=float, default=0.0, help="The backup's cap (0: none)."
    )
    parser.add_argument(
        "--priority", default="idle", help="The backup's CPU priority: idle, low or normal."
    )
    args = parser.parse_args()
    data = tpch.generate(args.sf, args.home / f"tpch-sf{args.sf:g}")
    with tempfile.TemporaryDirectory(prefix="shardflow-bench-backup-", dir=args.home) as work:
        home = Path(work)
        data_dir = home / "data"
        root = str(Path(args.to or home) / f"backups-{os.getpid()}")
        with shardflow.connect(workers=args.workers, data_dir=str(data_dir)) as db:
            tpch.load(db, data, tables=TABLES)
            keys = db.sql("SELECT o_orderkey FROM orders USING SAMPLE 2000 ROWS")
            readers = Readers(db, keys.column(0).to_pylist(), args.read_rate)
            try:
                readers.window_of(lambda: time.sleep(2.0))  # warm
                copying: list[float] = []
                plain_s: list[float] = []
                for _ in range(ROUNDS):  # in a process of its own too, as `cp` would be
                    during, (plain_bytes, seconds) = readers.window_of(
                        lambda: copy_in_child(data_dir / "tables", home / "plain")
                    )
                    copying += during
                    plain_s.append(seconds)
                    shutil.rmtree(home / "plain")
                plain_mb_s = plain_bytes / 1e6 / statistics.median(plain_s)
                print(f"plain copy: {plain_bytes / 1e6:.0f} MB in {min(plain_s):.2f}-"
                      f"{max(plain_s):.2f} s ({plain_mb_s:.0f} MB/s); readers' p99 "
                      f"{p99(copying):.1f} ms while it ran")  # fmt: skip
                with_backup: list[float] = []
                without: list[float] = []
                took_s: list[float] = []
                taker = BackupProcess(args.priority, args.max_rate_mb_s)
                for attempt in range(ROUNDS):  # alternated; each into a fresh folder
                    folder = root if attempt == 0 else f"{root}-{attempt}"
                    began = time.perf_counter()
                    during, (_, seconds) = readers.window_of(
                        lambda f=folder: taker.backup(data_dir, f)
                    )
                    took_s.append(seconds)
                    with_backup += during
                    window = time.perf_counter() - began
                    without += readers.window_of(lambda t=window: time.sleep(t))[0]
                    if attempt:
                        shutil.rmtree(folder)
                taker.close()
                full = backups.info_of(backups.read_manifest(backups.open_root(root, create=False)))
                print(f"full backup: {full.bytes / 1e6:.0f} MB in {min(took_s):.2f}-"
                      f"{max(took_s):.2f} s ({ROUNDS} runs, a process of its own, priority "
                      f"{args.priority}); readers' p99 {p99(with_backup):.1f} ms while it ran, "
                      f"{p99(without):.1f} ms without ({len(with_backup)} and {len(without)} "
                      "reads)")  # fmt: skip
                backup_s = statistics.median(took_s)
                backup_mb_s = full.bytes / 1e6 / backup_s
                rows = db.sql("SELECT count(*) FROM lineitem").column(0)[0].as_py()
                extra = db.sql(f"SELECT * FROM lineitem LIMIT {max(1, rows // 100)}")
                for part in extra.to_batches(max(1, extra.num_rows // 20)):
                    db.insert("lineitem", part)
                incremental = backups.backup(DataDir.resolve(str(data_dir)), root)
                incremental_ratio = incremental.bytes_written / full.bytes_written
                print(f"incremental after {extra.num_rows} rows inserted: "
                      f"{incremental.bytes_written / 1e6:.1f} MB written of "
                      f"{incremental.bytes / 1e6:.0f} MB")  # fmt: skip
                expected = db.sql(COUNT).to_pylist()
            finally:
                readers.close()
        report = backups.verify(root)
        assert report.ok, report.problems
        target = home / "restored"
        began = time.perf_counter()
        backups.restore(root, DataDir.resolve(str(target)), incremental.backup_id)
        restore_s = time.perf_counter() - began
        restore_mb_s = incremental.bytes / 1e6 / restore_s
        print(f"restore: {incremental.bytes / 1e6:.0f} MB in {restore_s:.2f} s")
        with shardflow.connect(workers=2, data_dir=str(target)) as db:
            restored = db.sql(COUNT).to_pylist()
        assert restored == expected, (restored, expected)
        print(f"restored on 2 workers: {restored[0]} rows, as the source")
        if args.to is not None:
            shutil.rmtree(root)
        ratio = p99(with_backup) / p99(without)
        print(f"plain_copy_mb_s={plain_mb_s:.0f} backup_s={backup_s:.2f} restore_s={restore_s:.2f}")
        print(
            f"backup_mb_s={backup_mb_s:.0f} restore_mb_s={restore_mb_s:.0f} "
            f"backup_p99_ratio={ratio:.2f} incremental_ratio={incremental_ratio:.3f}"
        )


if __name__ == "__main__":
    main()
