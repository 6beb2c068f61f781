"""One real local Ray cluster with TPC-H SF 0.1 loaded, shared by the cluster tests that do
not kill or restart anything (those start clusters of their own)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import shardflow
from shardflow import tpch
from shardflow.tools import netns
from tests.support.chromium import CHROMIUM, Chromium


@pytest.fixture
def chromium(tmp_path: Path) -> Iterator[Chromium]:
    """Debian's headless Chromium for the browser tests (the console, the profile page)."""
    if not os.path.exists(CHROMIUM):
        missing = (
            f"{CHROMIUM} is missing: install Debian's chromium (sudo apt-get install chromium; "
            "`make test` does so where it runs as root)"
        )
        if os.environ.get("SHARDFLOW_REQUIRE_BROWSER") == "1":  # CI: the tests must run
            pytest.fail(f"{missing}, and SHARDFLOW_REQUIRE_BROWSER=1")
        pytest.skip(missing)
    browser = Chromium(tmp_path / "chromium")
    yield browser
    browser.close()


@pytest.fixture(scope="session")
def redis_server() -> str:
    """Debian's redis-server, for the clusters that survive their head (``--ha``)."""
    found = shutil.which("redis-server")
    if found is None:
        missing = (
            "redis-server is missing: install Debian's redis-server (sudo apt-get install "
            "redis-server; `make test` does so where it runs as root)"
        )
        if os.environ.get("SHARDFLOW_REQUIRE_REDIS") == "1":  # CI: the tests must run
            pytest.fail(f"{missing}, and SHARDFLOW_REQUIRE_REDIS=1")
        pytest.skip(missing)
    return found


@pytest.fixture(scope="session")
def network_namespaces() -> None:
    """Root, iproute2, iptables and nsenter, for clusters in network namespaces."""
    why = netns.available()
    if why is not None:
        missing = f"a cluster in network namespaces cannot run here: {why}"
        if os.environ.get("SHARDFLOW_REQUIRE_NETNS") == "1":  # CI: the tests must run
            pytest.fail(f"{missing}, and SHARDFLOW_REQUIRE_NETNS=1")
        pytest.skip(missing)


def listening_sockets() -> set[str]:
    out = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True, check=True).stdout
    return {line.split()[3] for line in out.splitlines() if line.strip()}


@pytest.fixture(scope="session")
def sockets_before() -> set[str]:
    return listening_sockets()


@pytest.fixture(scope="session")
def db(
    tpch_small: Path, tmp_path_factory: pytest.TempPathFactory, sockets_before: set[str]
) -> Iterator[shardflow.Database]:
    database = shardflow.connect(
        workers=4,
        data_dir=tmp_path_factory.mktemp("cluster"),
        initial_shard_bytes=0,  # small as TPC-H SF 0.1 is, spread over every worker
    )
    tpch.load(database, tpch_small)
    yield database
    database.close()


@pytest.fixture(scope="session")
def small_oracle(tpch_small: Path) -> Iterator[object]:
    con = tpch.duckdb_oracle(tpch_small)
    yield con
    con.close()


def sigkill_worker(db: shardflow.Database, node: str) -> None:
    """Kill ``node``'s worker process with SIGKILL, as a crash would."""
    os.kill(db._backend.handle.workers.get(node).pid().get(), signal.SIGKILL)


def wait_for_failover(db: shardflow.Database, seconds: float = 30.0) -> None:
    """Wait until the coordinator has failed a dead worker's shards over (or ``seconds``
    passed: the test's own assertions say what is missing)."""
    deadline = time.monotonic() + seconds
    while not db.cluster.failovers() and time.monotonic() < deadline:
        time.sleep(0.1)
