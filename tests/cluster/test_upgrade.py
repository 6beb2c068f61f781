"""A rolling upgrade under a checked load: a local multi-node cluster started by the release
before this code (installed from the repository's own history into a virtual environment
of its own), serving a client of that release that inserts and reads all along; then this
code's ``shardflow cluster upgrade`` replaces its data nodes one by one with nodes of this
code, the coordinator's node last (the coordinator starts again on a node of this code).
No client operation fails, every acknowledged row is kept, and at the end every worker and
the coordinator run this code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shardflow.catalog.version import release
from tests.support.releases import NoRelease, Release, install, previous_release

pytestmark = pytest.mark.cluster

LOAD = """
import json, pathlib, sys, time
import shardflow
from shardflow.tools.drill import EVENTS, FACTS, Workload, events, facts, oracle

ROWS = 2000
db = shardflow.connect(address=sys.argv[1], data_dir=sys.argv[2])
db.create_table(FACTS, facts(ROWS), distributed_by="id")
db.create_table(EVENTS, events(0, ROWS), distributed_by="id")
print("READY", shardflow.__version__, flush=True)
with Workload(db, oracle(facts(ROWS)), ROWS, ROWS) as load:
    while not pathlib.Path(sys.argv[3]).exists():
        time.sleep(0.2)
got = db.sql(f"SELECT id FROM {EVENTS}").column("id").to_pylist()
acked = set(range(ROWS)) | set(load.acked)
report = load.report
print("RESULT", json.dumps({
    "failed_ops": report.failed_ops, "failures": report.failures,
    "wrong_answers": report.wrong_answers, "stale_reads": report.stale_reads,
    "inserts": report.inserts, "queries": report.queries,
    "lost_rows": len(acked - set(got)), "duplicated_rows": len(got) - len(set(got)),
}), flush=True)
db.close()
"""

LOOK = """
import json, sys
import shardflow
db = shardflow.connect(address=sys.argv[1], data_dir=sys.argv[2])
nodes = [{"ray": n.ray_node_id, "release": n.release} for n in db.cluster.nodes() if n.alive]
print("NODES", json.dumps({"nodes": nodes, "coordinator": db.cluster.coordinator_host()}))
db.close()
"""


@pytest.fixture(scope="module")
def before(tmp_path_factory: pytest.TempPathFactory) -> Release:
    """The release before this code, installed; skipped where the checkout has no history
    (``SHARDFLOW_REQUIRE_HISTORY=1`` makes that a failure)."""
    try:
        version, commit = previous_release()
        return install(version, commit, tmp_path_factory.mktemp("release"))
    except NoRelease as why:
        if os.environ.get("SHARDFLOW_REQUIRE_HISTORY") == "1":
            pytest.fail(f"{why}, and SHARDFLOW_REQUIRE_HISTORY=1")
        pytest.skip(str(why))


def shardflow(python: Path | str, *args: str, timeout: float = 300) -> str:
    done = subprocess.run(
        [str(python), "-m", "shardflow.cli", *args], capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, f"{args[:3]}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def look(python: Path | str, address: str, data_dir: Path) -> dict[str, Any]:
    done = subprocess.run(
        [str(python), "-c", LOOK, address, str(data_dir)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("NODES "))
    found: dict[str, Any] = json.loads(line[6:])
    return found


@pytest.fixture
def old_cluster(before: Release, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A head and 2 data nodes, and shardflow on them, all of the release before."""
    data_dir = tmp_path / "data"
    try:
        shardflow(before.python, "cluster", "up", "--nodes", "2", "--object-store-mb", "128",
                  "--data-dir", str(data_dir), "--set", "initial_shard_bytes=0")  # fmt: skip
        address = shardflow(before.python, "cluster", "address", "--data-dir", str(data_dir))
        yield address.strip(), data_dir
    finally:
        shardflow(sys.executable, "cluster", "down", "--data-dir", str(data_dir), timeout=120)


def test_workers_then_the_coordinator_are_replaced_under_load(
    before: Release, old_cluster: tuple[str, Path], tmp_path: Path
) -> None:
    address, data_dir = old_cluster
    ours = release()
    assert before.version != ours
    was = look(sys.executable, address, data_dir)  # a client of this code, as yet
    assert len(was["nodes"]) == 2 and {n["release"] for n in was["nodes"]} == {""}, was
    stop = tmp_path / "stop"
    load = subprocess.Popen(
        [str(before.python), "-c", LOAD, address, str(data_dir), str(stop)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert load.stdout is not None
        ready = load.stdout.readline()
        assert ready.split() == ["READY", before.version], load.stderr and load.stderr.read()
        out = shardflow(sys.executable, "cluster", "upgrade", "--data-dir", str(data_dir),
                        "--deadline", "120",
                        timeout=600)  # fmt: skip
        assert "2 data node(s) to replace" in out and f"every worker runs release {ours}" in out
        stop.touch()
        out, err = load.communicate(timeout=180)
    finally:
        if load.poll() is None:
            load.kill()
            load.wait()
    assert load.returncode == 0, err[-4000:]
    report = json.loads(next(x for x in out.splitlines() if x.startswith("RESULT "))[7:])
    assert report["inserts"] > 20 and report["queries"] > 20, report
    assert report["failed_ops"] == 0, report
    assert report["lost_rows"] == 0 and report["duplicated_rows"] == 0, report
    assert report["wrong_answers"] == 0 and report["stale_reads"] == 0, report
    now = look(sys.executable, address, data_dir)
    new_nodes = {n["ray"] for n in now["nodes"]}
    assert {n["release"] for n in now["nodes"]} == {ours}, now
    assert not new_nodes & {n["ray"] for n in was["nodes"]}, now
    assert now["coordinator"] in new_nodes and now["coordinator"] != was["coordinator"], now
