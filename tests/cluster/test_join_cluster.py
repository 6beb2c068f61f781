"""connect(address=...) joins a Ray cluster started on its own (here with ``ray start`` on
loopback), and a second session on the same data directory shares the running actors."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def ray_head(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    ray = Path(sys.executable).parent / "ray"
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    log = open(tmp_path / "head.log", "w")
    head = subprocess.Popen(
        [
            str(ray),
            "start",
            "--head",
            "--node-ip-address=127.0.0.1",
            f"--port={port}",
            "--include-dashboard=false",
            "--num-cpus=2",
            "--disable-usage-stats",
            "--block",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield f"127.0.0.1:{port}"
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:  # `ray start --block` took the whole 10 s it was given: a test's head, killed
            head.wait(timeout=3)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        log.close()


FIRST = """
import sys
import pyarrow as pa
import shardflow

db = shardflow.connect(address=sys.argv[1], workers=2, data_dir=sys.argv[2])
db.create_table("t", pa.table({"id": list(range(100))}), distributed_by="id")
print("READY", flush=True)
sys.stdin.readline()  # the second session runs now
print("FIRST", db.sql("SELECT sum(id) FROM t")[0][0].as_py(), flush=True)
db.close()
"""

SECOND = """
import sys
import pyarrow as pa
import shardflow

db = shardflow.connect(address=sys.argv[1], workers=2, data_dir=sys.argv[2])
db.insert("t", pa.table({"id": [1000]}))
print("SECOND", db.sql("SELECT sum(id) FROM t")[0][0].as_py(), len(db.cluster.nodes()))
db.close()
"""


def wait_for_head(address: str) -> None:
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, int(port)), timeout=1):
                return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"the Ray head at {address} did not start")


def test_two_sessions_share_a_cluster(ray_head: str, tmp_path: Path) -> None:
    wait_for_head(ray_head)
    data_dir = str(tmp_path / "data")
    first = subprocess.Popen(
        [sys.executable, "-c", FIRST, ray_head, data_dir],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert first.stdout is not None and first.stdin is not None
        ready = first.stdout.readline()
        assert ready.startswith("READY"), first.stderr.read() if first.stderr else ""
        second = subprocess.run(
            [sys.executable, "-c", SECOND, ray_head, data_dir],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 0, second.stderr[-3000:]
        # the second session saw the first one's table and the first one's workers
        assert "SECOND 5950 2" in second.stdout
        first.stdin.write("go\n")
        first.stdin.flush()
        out, err = first.communicate(timeout=120)
        assert first.returncode == 0, err[-3000:]
        assert "FIRST 5950" in out  # and the first session sees the second one's insert
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
