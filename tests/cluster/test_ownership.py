"""One owner per data directory. A second ``connect`` in the same process shares the running
cluster; one in another program is refused while the first serves; a killed owner is
replaced at once; and an owner that hung past its lease cannot write after another cluster
took over (its late insert is refused, nothing of it lands)."""

from __future__ import annotations

import fcntl
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import shardflow
from shardflow.catalog import lease

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 120.0


def rows(start: int, count: int) -> pa.Table:
    return pa.table({"id": pa.array(range(start, start + count), pa.int64())})


def count_and_sum(db: shardflow.Database) -> tuple[int, int]:
    row = db.sql("SELECT count(*) AS n, coalesce(sum(id), 0) AS s FROM events").to_pylist()[0]
    return int(row["n"]), int(row["s"])


def expected(*ranges: tuple[int, int]) -> tuple[int, int]:
    ids = [i for start, count in ranges for i in range(start, start + count)]
    return len(ids), sum(ids)


class OwnerProcess:
    """Another program using the data directory (tests/support/owner_process.py)."""

    def __init__(self, data_dir: Path, lease_ttl_s: float = 60.0) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.support.owner_process", str(data_dir), str(lease_ttl_s)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.ready = self.expect("ready")

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line)

    def expect(self, *events: str) -> dict[str, Any]:
        try:
            event: dict[str, Any] = json.loads(self._lines.get(timeout=WAIT_S))
        except queue.Empty:
            raise AssertionError(f"the other program said nothing within {WAIT_S}s") from None
        assert event["event"] in events, event
        return event

    def send(self, command: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.send("close")
            self.expect("closed")
        self._finish()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self._finish()

    def _finish(self) -> None:
        self.process.wait(timeout=WAIT_S)
        self._reader.join(timeout=WAIT_S)
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def test_two_connects_in_one_process_share_one_cluster(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    first = shardflow.connect(workers=2, data_dir=data_dir)
    try:
        second = shardflow.connect(workers=3, data_dir=data_dir)
        first.create_table("events", rows(0, 100), distributed_by="id")
        second.insert("events", rows(100, 100))
        first.insert("events", rows(200, 100))
        assert count_and_sum(second) == expected((0, 300))
        assert count_and_sum(first) == expected((0, 300))
        assert [n.node_id for n in second.cluster.nodes()] == ["node-0", "node-1"]  # shared
    finally:
        first.close()
    # the cluster serves as long as one of its databases is open
    second.insert("events", rows(300, 100))
    assert count_and_sum(second) == expected((0, 400))
    second.close()
    with shardflow.connect(workers=2, data_dir=data_dir) as db:
        assert count_and_sum(db) == expected((0, 400))


def test_a_second_program_is_refused_while_the_first_serves_and_takes_over_once_killed(
    tmp_path: Path,
) -> None:
    data_dir = tmp_path / "data"
    other = OwnerProcess(data_dir, lease_ttl_s=3600.0)  # expiry cannot be what frees it
    try:
        other.send("create 0 1000")
        other.expect("acked")
        pid = other.ready["coordinator_pid"]
        with pytest.raises(shardflow.DataDirInUseError, match=rf"pid {pid} .*connect\(address"):
            shardflow.connect(workers=2, data_dir=data_dir)
        with pytest.raises(shardflow.DataDirInUseError, match=rf"pid {pid} "):
            shardflow.connect(data_dir=data_dir, in_process=True)  # a one-shot command's way
        other.send("insert 1000 1000")  # the owner is unharmed
        other.expect("acked")
    finally:
        other.kill()  # SIGKILL: its embedded cluster goes down with it
    coordinator = other.ready["coordinator_pid"]
    deadline = time.monotonic() + WAIT_S
    while running(coordinator):
        assert time.monotonic() < deadline, "the killed program's cluster did not stop"
        time.sleep(0.2)
    with shardflow.connect(workers=2, data_dir=data_dir) as db:
        assert count_and_sum(db) == expected((0, 2000))


def hang(pid: int, data_dir: Path) -> None:
    """Stop ``pid`` (SIGSTOP) at a moment it holds no lock on the lease: stopped inside a
    renewal (milliseconds), it would hold it until resumed, and the takeover this test is
    about would be refused as waiting on a frozen process (tests/unit/test_lease.py)."""
    for _ in range(100):
        os.kill(pid, signal.SIGSTOP)
        fd = os.open(data_dir / lease.LOCK_FILE, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: the stopped one holds none
            return
        except BlockingIOError:
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.05)
        finally:
            os.close(fd)
    raise AssertionError(f"process {pid} kept holding the lease's lock")


def test_an_owner_that_hung_past_its_lease_cannot_write_late(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    other = OwnerProcess(data_dir, lease_ttl_s=2.0)
    coordinator = other.ready["coordinator_pid"]
    taken_over: shardflow.Database | None = None
    try:
        other.send("create 0 100")
        other.expect("acked")
        hang(coordinator, data_dir)  # no more lease renewals
        deadline = time.monotonic() + WAIT_S
        while taken_over is None:
            try:
                taken_over = shardflow.connect(workers=2, data_dir=data_dir)
            except shardflow.DataDirInUseError:
                assert time.monotonic() < deadline, "the expired lease was never taken over"
                time.sleep(0.5)
        # the old owner's workers still run, but their late write is refused
        other.send("insert 100 100")
        failed = other.expect("failed", "acked")
        assert failed["event"] == "failed", failed
        assert failed["error"] == "OwnershipLostError"
        assert "owned by another cluster" in failed["message"]
        assert count_and_sum(taken_over) == expected((0, 100))
        taken_over.insert("events", rows(1000, 10))
    finally:
        os.kill(coordinator, signal.SIGCONT)
        other.stop()
        if taken_over is not None:
            taken_over.close()
    with shardflow.connect(workers=2, data_dir=data_dir) as db:
        assert count_and_sum(db) == expected((0, 100), (1000, 10))
