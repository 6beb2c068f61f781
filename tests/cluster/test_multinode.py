"""A real multi-node cluster on this machine: a head and 3 data nodes, each its own raylet,
object store and workers (``shardflow cluster up``'s LocalRayCluster), with shardflow started
on it by ``shardflow serve`` and reached by clients in other processes. Every check talks to
it from a separate process: this pytest process may run an embedded cluster of its own.

While it serves, ``ss`` shows every socket of every one of its processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from shardflow.runtime.ray.local import _folder_beside_head
from shardflow.runtime.ray.membership import JOIN_INTERVAL_S
from shardflow.tools.localcluster import LocalRayCluster, descendants

pytestmark = pytest.mark.cluster
SHARDFLOW = [sys.executable, "-m", "shardflow.cli"]


@dataclass
class Running:
    local: LocalRayCluster
    data_dir: Path

    @property
    def address(self) -> str:
        return self.local.address


def run(*args: str, timeout: float = 240) -> str:
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{args[:4]} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    data_dir = tmp_path_factory.mktemp("multinode") / "data"
    local = LocalRayCluster(data_dir)
    local.up(3, object_store_mb=128)
    try:
        # a detached service: the command exits, coordinator and workers keep serving
        out = run(
            *SHARDFLOW,
            "serve",
            "--address",
            local.address,
            "--data-dir",
            str(data_dir),
            "--set",
            "migration_bandwidth_mb_s=2",
            "--set",
            "initial_shard_bytes=0",
            "--set",
            "migration_share=1.0",
        )  # fmt: skip  (moves take a while, and go back to back: the drill's churn)
        assert "with 3 worker(s)" in out
        yield Running(local, data_dir)
    finally:
        try:
            run(*SHARDFLOW, "serve", "--stop", "--address", local.address, "--data-dir",
                str(data_dir), timeout=60)  # fmt: skip
        finally:
            local.down()


def our_pids(local: LocalRayCluster, *clients: int) -> set[int]:
    """Every process of the cluster (each node's process tree) and of the clients."""
    roots = [n.pid for n in local.nodes()] + list(clients)
    return {pid for root in roots for pid in (root, *descendants(root))}


def non_loopback_sockets(pids: set[int]) -> list[str]:
    """TCP sockets (listening or connected) of ``pids`` bound to or talking to an address
    off loopback, listeners on every interface included."""
    out = subprocess.run(["ss", "-tanpH"], capture_output=True, text=True, check=True).stdout
    bad = []
    for line in out.splitlines():
        owners = {int(part.split(",")[0]) for part in line.split("pid=")[1:]}
        if not owners & pids:
            continue
        mine, peer = (_host(a) for a in line.split()[3:5])
        if not _loopback(mine) or not (_loopback(peer) or peer in ("*", "0.0.0.0", "::")):
            bad.append(line)
    return bad


def off_the_network(local: LocalRayCluster) -> list[str]:
    """In a cluster in network namespaces, the connections of its namespaces with an
    address neither on loopback nor in the cluster's own network (none elsewhere)."""
    network = local.network
    if network is None:
        return []
    ours = (f"{network.subnet}.", "127.")
    return [
        f"{member}: {mine} -> {peer}"
        for member, mine, peer in network.sockets()
        if not all(_host(a).startswith(ours) for a in (mine, peer))
    ]


def run_drill(
    local: LocalRayCluster, *args: str, watch: tuple[int, ...] = ()
) -> tuple[dict[str, Any], str, list[str]]:
    """Run the drill (``args``) in a process of its own against ``local`` (in its clients'
    namespace, for a cluster in network namespaces); returns its report, its output, and
    the sockets off loopback (or off the cluster's own network) that the cluster, the drill
    or the processes ``watch`` had meanwhile (the proof, while the cluster serves and
    heals)."""
    drill = subprocess.Popen(
        local.client_command([sys.executable, "-m", "shardflow.tools.drill",
                              "--address", local.address, "--data-dir", local.data_dir, *args]),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    off_loopback: list[str] = []
    try:
        while True:  # its output read as it comes: a full pipe would stop it
            off_loopback += non_loopback_sockets(our_pids(local, drill.pid, *watch))
            off_loopback += off_the_network(local)
            try:
                out, err = drill.communicate(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                continue
    finally:
        if drill.poll() is None:
            drill.kill()
            drill.wait()
    assert drill.returncode == 0, err[-4000:]
    report = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
    return report, out, off_loopback


def _host(address: str) -> str:
    return address.rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:")


def _loopback(host: str) -> bool:
    return host.startswith("127.") or host == "::1"


def test_service_outlives_its_command_and_pins_one_worker_per_ray_node(cluster: Running) -> None:
    out = run(*SHARDFLOW, "cluster", "status", "--data-dir", str(cluster.data_dir))
    rows = [line for line in out.splitlines() if "node-" in line]
    assert len(rows) == 3, out
    assert {r.split("│")[2].strip() for r in rows} == {"ray-1", "ray-2", "ray-3"}
    assert all("127.0.0.1" in r and " yes " in r for r in rows), out
    assert "health: ok" in out
    assert non_loopback_sockets(our_pids(cluster.local)) == []
    assert _folder_beside_head(cluster.address) is None  # its head shares the folder: Ray's way


def test_moves_and_whole_node_losses_under_load(cluster: Running) -> None:
    """Under an inserter and two readers: 2 Ray nodes join (5 data nodes), 20 shards move
    live between Ray nodes, one node is drained away, a data node holding results a query
    has not read yet and then the coordinator's node are SIGKILLed (two nodes lost one after
    the other: the query runs again; the coordinator was in the middle of a move between two
    other nodes, which its successor finishes or rolls back), and a node comes back under a
    lost node's name. No client operation fails, no
    row is lost or doubled, every answer matches DuckDB's, and the returning node joins as
    a new node."""
    report, out, off_loopback = run_drill(
        cluster.local, "--rows", "10000", "--grow", "2", "--moves", "20", "--drain", "ray-1",
        "--kill", "results", "--kill", "coordinator-mid-move", "--rejoin", "lost",
    )  # fmt: skip
    assert "drill_events" in out.splitlines()[-1] and "stay in" in out.splitlines()[-1], out[-500:]
    assert report["failures"] == []
    assert report["failed_ops"] == 0 and report["wrong_answers"] == 0
    assert report["lost_rows"] == 0 and report["duplicated_rows"] == 0
    assert report["moves"] == 20 and report["move_failures"] == 0
    assert len(report["recovery_s"]) == 2 and report["queries"] > 0 and report["inserts"] > 0
    # the held scan ran again, and answered right
    assert report["results_recomputed"] >= 1, report["held_scan"]
    [interrupted] = report["interrupted_moves"]  # the restarted coordinator ended it
    assert interrupted.startswith(("done", "rolled_back")), interrupted
    assert len(report["joined"]) == 3  # the 2 grown, and the one back under an old name
    assert not {"node-0", "node-1", "node-2"} & set(report["joined"])
    assert off_loopback == []
    status = run(*SHARDFLOW, "cluster", "status", "--data-dir", str(cluster.data_dir))
    rejoined = [line for line in status.splitlines() if report["joined"][-1] in line]
    assert len(rejoined) == 1 and report["lost"][0] in rejoined[0], status
    assert "health: ok" in status


def test_a_node_removed_gracefully_is_drained_first(cluster: Running) -> None:
    run(*SHARDFLOW, "cluster", "add-node", "--data-dir", str(cluster.data_dir))
    name = cluster.local.nodes()[-1].name
    out = run(*SHARDFLOW, "cluster", "remove-node", name, "--data-dir", str(cluster.data_dir))
    assert f"drained {name}" in out and f"Ray node {name} stopped" in out
    status = run(*SHARDFLOW, "cluster", "status", "--data-dir", str(cluster.data_dir))
    assert name not in status and "health: ok" in status
    count = run(*SHARDFLOW, "sql", "SELECT count(*) AS n FROM drill_facts", "--address",
                cluster.address, "--data-dir", str(cluster.data_dir))  # fmt: skip
    assert "10000" in count


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="a node with a disk of its own needs a mount namespace (root, unshare)",
)
def test_a_node_that_cannot_reach_the_data_directory_never_serves(cluster: Running) -> None:
    """A Ray node whose view of the data directory's path is its own (empty) disk: a new
    service that would use it is refused with a ConfigError naming it, and the running
    service's auto_join gives it no worker."""
    shared = cluster.data_dir.parent  # holds this cluster's data directory and the next one
    node = cluster.local.add_node(object_store_mb=128, hide=str(shared))
    try:
        refused = subprocess.run(
            [*SHARDFLOW, "serve", "--address", cluster.address, "--data-dir",
             str(shared / "another")],
            capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        said = refused.stdout + refused.stderr
        assert refused.returncode == 2, said[-3000:]
        assert "ConfigError" in said and "cannot reach the data directory" in said
        assert node.name in said
        time.sleep(3 * JOIN_INTERVAL_S)  # the running service looked at the new node
        status = run(*SHARDFLOW, "cluster", "status", "--data-dir", str(cluster.data_dir))
        members = [line for line in status.splitlines() if "node-" in line]
        assert members and not [line for line in members if node.name in line], status
        assert "health: ok" in status
    finally:
        cluster.local.remove_node(node.name, kill=True)
