"""Network partitions, made here: the local cluster runs in network namespaces this test
makes (each Ray node with an address of its own, the drill in the clients' namespace with a
Ray node of its own), and the drill's nemesis cuts links with iptables inside them — a data
node from the head and the coordinator, this client from a data node, what a data node
sends this client — and heals them, under the checked workload: no operation fails, no row
is lost or doubled, no read misses an acknowledged row. Every connection stays inside the
test's own network or on loopback, and the namespaces are gone afterwards.

A node cut off from the coordinator is failed over while it still runs; that it then takes
no write and serves no read for the shards given to others is the per-shard fence, shown to
fail when switched off in ``tests/runtime/test_shard_fencing.py``."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardflow.tools.localcluster import LocalRayCluster
from tests.cluster.test_multinode import run_drill

pytestmark = pytest.mark.cluster

SEED = 7
"""A schedule with each of the three cuts once."""


@pytest.fixture
def partitioned(tmp_path: Path, network_namespaces: None) -> Iterator[LocalRayCluster]:
    local = LocalRayCluster(tmp_path / "data")
    local.up(3, network=True)
    network = local.network
    assert network is not None
    try:
        yield local
    finally:
        local.down()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert network.prefix not in listed, "the cluster left network namespaces behind"


def test_partitions_lose_nothing_and_fail_no_operation(partitioned: LocalRayCluster) -> None:
    nodes = {n.name: n.ip for n in partitioned.nodes()}
    assert len(set(nodes.values())) == len(nodes), "each Ray node has an address of its own"
    report, out, off_network = run_drill(
        partitioned, "--rows", "5000", "--moves", "2",
        "--nemesis", "partition", "--faults", "3", "--seed", str(SEED),
    )  # fmt: skip
    cuts = sorted(fault.split()[1] for fault in report["faults"])
    assert cuts == ["client", "node", "one-way"], out
    assert report["failed_ops"] == 0, report["failures"]
    assert report["lost_rows"] == report["duplicated_rows"] == report["stale_reads"] == 0, out
    assert report["wrong_answers"] == 0, report["failures"]
    assert report["inserts"] > 0 and report["queries"] > 0
    assert len(report["joined"]) == 1, "a node joins in place of the one cut off"
    assert max(report["fault_recovery_s"]) < 60, out
    assert off_network == [], off_network[:5]
    assert out.strip().splitlines()[-1].startswith("faults=3 failed_ops=0 lost=0 dup=0")
