"""The operator's handlers as plain functions, against a real ``shardflow serve`` on a real
multi-node Ray cluster (3 Ray nodes, named as their pods would be) and an in-memory
Kubernetes (no API server can run here): a scale-down drains the pod going away before
KubeRay is told to delete it, a ShardMigration moves a shard and its status follows the
move's phases, a refused or rolled-back move says so. Every status they return is checked
against our CRD's status schema."""

from __future__ import annotations

import copy
import hashlib
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import shardflow
from shardflow.errors import ClusterError
from shardflow.k8s.handlers import (
    NotYet,
    carry_out_migration,
    reconcile_cluster,
)
from shardflow.k8s.render import ClusterSpec
from shardflow.service.auth import TOKEN_PREFIX
from shardflow.tools.localcluster import LocalRayCluster
from tests.k8s.manifests import validate_ray_cluster, validate_status
from tests.service.conftest import Served, start_service

pytestmark = pytest.mark.cluster
ROWS = 60_000


@dataclass
class MemoryKube:
    """The Kubernetes API the handlers use, kept in memory: what a RayCluster runs now, the
    pods KubeRay made for it, Secrets, and what the handlers applied."""

    ray_clusters: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    pods: list[dict[str, Any]] = field(default_factory=list)
    secrets: dict[tuple[str, str], str] = field(default_factory=dict)
    applied: list[dict[str, Any]] = field(default_factory=list)

    def get_ray_cluster(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.ray_clusters.get((namespace, name))

    def list_pods(self, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        return [p for p in self.pods if p["metadata"]["namespace"] == namespace
                and labels.items() <= p["metadata"]["labels"].items()]  # fmt: skip

    def apply(self, manifest: dict[str, Any]) -> None:
        self.applied.append(copy.deepcopy(manifest))
        if manifest["kind"] == "RayCluster":
            meta = manifest["metadata"]
            self.ray_clusters[(meta["namespace"], meta["name"])] = copy.deepcopy(manifest)

    def ensure_token(self, namespace: str, secret: str) -> str:
        return self.secrets.setdefault(
            (namespace, secret), TOKEN_PREFIX + secrets.token_urlsafe(32)
        )


def cluster_body(replicas: int, generation: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": "shardflow.io/v1alpha1",
        "kind": "ShardflowCluster",
        "metadata": {"name": "sf", "namespace": "analytics", "generation": generation},
        "spec": {
            "image": "shardflow/shardflow:0.2.0",
            "dataDir": {"uri": "file:///var/lib/shardflow", "volumeClaim": "data"},
            "nodeGroups": [{"name": "cpu", "deviceClass": "cpu", "replicas": replicas}],
        },
    }


def pod(name: str, created: str, group: str = "cpu") -> dict[str, Any]:
    labels = {"ray.io/cluster": "sf", "ray.io/group": group, "ray.io/node-type": "worker"}
    return {
        "metadata": {"name": name, "namespace": "analytics", "labels": labels,
                     "creationTimestamp": created},
        "status": {"phase": "Running"},
    }  # fmt: skip


@dataclass
class Multinode:
    local: LocalRayCluster
    served: Served
    token: str

    def connect(self, spec: ClusterSpec, token: str) -> Any:
        assert token == self.token  # the token of the cluster's Secret
        return shardflow.connect(self.served.uri, token=token).cluster


def run_cli(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "shardflow.cli", *args],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


@pytest.fixture(scope="module")
def multinode(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Multinode]:
    """3 Ray nodes (ray-1..ray-3, as pods of group cpu) with ``shardflow serve`` attached,
    accepting the operator token from a file as the head pod's Secret gives it."""
    data_dir = tmp_path_factory.mktemp("k8s") / "data"
    local = LocalRayCluster(data_dir)
    local.up(3, object_store_mb=128)
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    token_file = data_dir.parent / "operator-token"
    token_file.write_text(token + "\n")
    served = None
    try:
        served = start_service(
            data_dir,
            "--address",
            local.address,
            "--operator-token-file",
            str(token_file),
            "--set",
            "test_hold_copy_s=2",
            workers=None,
        )  # fmt: skip  (each move waits in its copy: the status sees its phases)
        with shardflow.connect(served.uri, token=token) as db:
            ids = range(ROWS)
            pad = ["x" * 64] * ROWS
            db.create_table("events", pa.table({"id": list(ids), "pad": pad}), distributed_by="id")
        yield Multinode(local, served, token)
    finally:
        try:
            if served is not None:
                served.stop()
            run_cli("serve", "--stop", "--address", local.address, "--data-dir", str(data_dir))
        finally:
            local.down()


def kube_for(node: Multinode, running: int) -> MemoryKube:
    kube = MemoryKube()
    kube.secrets[("analytics", "sf-operator-token")] = node.token
    kube.ray_clusters[("analytics", "sf")] = {
        "spec": {"workerGroupSpecs": [{"groupName": "cpu", "replicas": running}]}
    }
    kube.pods = [pod(n.name, f"2026-12-0{i + 1}T00:00:00Z")
                 for i, n in enumerate(node.local.nodes()) if not n.head]  # fmt: skip
    return kube


def count(node: Multinode) -> int:
    with shardflow.connect(node.served.uri, token=node.token) as db:
        return int(db.sql("SELECT count(*) AS n FROM events").column("n")[0].as_py())


def test_scaling_down_drains_the_pod_going_away_before_kuberay_deletes_it(
    multinode: Multinode,
) -> None:
    kube = kube_for(multinode, running=3)
    with shardflow.connect(multinode.served.uri, token=multinode.token) as db:
        held = {n.ray_node_name: n.shards for n in db.cluster.nodes() if n.alive}
    status = reconcile_cluster(cluster_body(replicas=2), kube, multinode.connect)
    validate_status("ShardflowCluster", status)
    ray_cluster = next(m for m in kube.applied if m["kind"] == "RayCluster")
    validate_ray_cluster(ray_cluster, required=False)  # the drain is checked either way
    (group,) = ray_cluster["spec"]["workerGroupSpecs"]
    assert group["replicas"] == 2
    (going,) = group["scaleStrategy"]["workersToDelete"]
    fewest = min(held.values())  # the pod with the least to move; of equals, the newest
    assert going == max(name for name, count in held.items() if count == fewest)
    with shardflow.connect(multinode.served.uri, token=multinode.token) as db:
        on_it = [n for n in db.cluster.nodes() if n.ray_node_name == going and n.alive]
        assert on_it == [], "a worker still serves on the pod KubeRay is told to delete"
        assert sum(n.shards for n in db.cluster.nodes() if n.alive) > 0
    assert count(multinode) == ROWS
    assert status["phase"] == "Scaling" and status["nodes"] == 2
    assert [c["status"] for c in status["conditions"]] == ["True", "True", "False"]
    # once KubeRay removed the pod, the next reconcile is steady and asks for no deletion
    kube.pods = [p for p in kube.pods if p["metadata"]["name"] != going]
    status = reconcile_cluster(cluster_body(replicas=2, generation=2), kube, multinode.connect)
    validate_status("ShardflowCluster", status)
    assert status["phase"] == "Running" and status["observedGeneration"] == 2
    assert "scaleStrategy" not in kube.applied[-2]["spec"]["workerGroupSpecs"][0]


def test_a_shard_migration_moves_the_shard_and_its_status_follows_the_phases(
    multinode: Multinode,
) -> None:
    with shardflow.connect(multinode.served.uri, token=multinode.token) as db:
        nodes = [n.node_id for n in db.cluster.nodes() if n.alive]
        shard = db.cluster.shards().to_pylist()[0]
        target = next(n for n in nodes if n != shard["node"])
        control = db.cluster
        seen: list[dict[str, Any]] = []
        spec = {"cluster": "sf", "shard": shard["shard"], "to": target}
        status = carry_out_migration(spec, control, seen.append)
        moved_to = {s["shard"]: s["node"] for s in db.cluster.shards().to_pylist()}
    validate_status("ShardMigration", status)
    for update in seen:
        validate_status("ShardMigration", update)
    assert status["phase"] == "done" and status["outcome"] == "done"
    assert moved_to[shard["shard"]] == target and status["to"] == [target]
    assert status["bytes"] > 0 and status["durationSeconds"] > 0
    assert any(u["phase"] not in ("done", "rolled_back") for u in seen), seen  # while it ran
    assert count(multinode) == ROWS


def test_a_refused_migration_reports_why(multinode: Multinode) -> None:
    with shardflow.connect(multinode.served.uri, token=multinode.token) as db:
        shard = db.cluster.shards().to_pylist()[0]["shard"]
        spec = {"cluster": "sf", "shard": shard, "to": "node-404"}
        status = carry_out_migration(spec, db.cluster)
    validate_status("ShardMigration", status)
    assert status["phase"] == "Failed" and "node-404" in status["outcome"]


def test_an_unreachable_service_holds_a_scale_down_but_not_a_start(tmp_path: Path) -> None:
    def unreachable(spec: ClusterSpec, token: str) -> Any:
        db = shardflow.connect("grpc://127.0.0.1:9", token=token)
        return db.cluster.nodes()  # raises: nothing listens there

    starting = MemoryKube()
    status = reconcile_cluster(cluster_body(replicas=2), starting, unreachable)
    validate_status("ShardflowCluster", status)
    assert status["phase"] == "Starting" and [m["kind"] for m in starting.applied] == [
        "RayCluster", "Service"]  # fmt: skip
    shrinking = MemoryKube(ray_clusters=copy.deepcopy(starting.ray_clusters))
    with pytest.raises(NotYet, match="does not answer"):
        reconcile_cluster(cluster_body(replicas=1), shrinking, unreachable)
    assert shrinking.applied == []  # nothing may go before its shards moved
    with pytest.raises(ClusterError):
        unreachable(None, "x")  # type: ignore[arg-type]


def test_a_rolled_back_move_reports_its_rollback(tmp_path: Path) -> None:
    """A service whose moves corrupt their copies on purpose (the fault hook): verification
    fails, the move rolls back, and the ShardMigration's status says so."""
    data_dir = tmp_path / "data"
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    (tmp_path / "token").write_text(token)
    served = start_service(data_dir, "--operator-token-file", str(tmp_path / "token"),
                           "--set", "test_fault_move_copy=drop_row")  # fmt: skip
    try:
        with shardflow.connect(served.uri, token=token) as db:
            db.create_table("t", pa.table({"id": list(range(5000))}), distributed_by="id")
            shard = db.cluster.shards().to_pylist()[0]
            target = next(n.node_id for n in db.cluster.nodes() if n.node_id != shard["node"])
            spec = {"cluster": "sf", "shard": shard["shard"], "to": target}
            status = carry_out_migration(spec, db.cluster)
            still = {s["shard"]: s["node"] for s in db.cluster.shards().to_pylist()}
            assert db.sql("SELECT count(*) AS n FROM t").column("n")[0].as_py() == 5000
    finally:
        served.stop()
    validate_status("ShardMigration", status)
    assert status["phase"] == "rolled_back" and status["rollbackReason"]
    assert still[shard["shard"]] == shard["node"]  # the source kept serving


def test_a_cancelled_shard_migration_rolls_its_move_back_and_stops_its_drain(
    tmp_path: Path,
) -> None:
    """A ShardMigration marked cancelled (or deleted) while its move copies: the move rolls
    back and the source keeps the shard; a drain stops and its node keeps serving. The
    service holds every move's copy 2 s (a test setting) so that the cancel comes in the
    middle; a ShardMigration cancelled before it began starts nothing."""
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    (tmp_path / "token").write_text(token)
    held = ("--set", "test_hold_copy_s=2", "--set", "shards_per_worker=2")
    served = start_service(
        tmp_path / "data", "--operator-token-file", str(tmp_path / "token"), *held
    )
    try:
        with shardflow.connect(served.uri, token=token) as db:
            db.create_table("t", pa.table({"id": list(range(8000))}), distributed_by="id")
            before = {s["shard"]: s["node"] for s in db.cluster.shards().to_pylist()}
            shard, source = next(iter(before.items()))
            target = next(n.node_id for n in db.cluster.nodes() if n.node_id != source)
            seen: list[dict[str, Any]] = []
            move = {"cluster": "sf", "shard": shard, "to": target}
            moved = carry_out_migration(move, db.cluster, seen.append, lambda: bool(seen))
            drain = {"cluster": "sf", "drain": source}
            looks: list[int] = []

            def after_two_looks() -> bool:  # the first look is before the drain starts
                looks.append(1)
                return len(looks) > 2

            drained = carry_out_migration(drain, db.cluster, cancelled=after_two_looks)
            never = carry_out_migration(move, db.cluster, cancelled=lambda: True)
            after = {s["shard"]: s["node"] for s in db.cluster.shards().to_pylist()}
            alive = {n.node_id for n in db.cluster.nodes() if n.alive}
            outcomes = [m.outcome for m in db.cluster.migrations()]
            assert db.sql("SELECT count(*) AS n FROM t").column("n")[0].as_py() == 8000
    finally:
        served.stop()
    for status in (moved, drained, never, *seen):
        validate_status("ShardMigration", status)
    assert moved["phase"] == "rolled_back" and moved["outcome"].startswith("cancelled"), moved
    assert drained["phase"] == "rolled_back" and "cancelled" in drained["outcome"], drained
    assert never["phase"] == "Failed" and never["outcome"] == "cancelled before it started"
    assert after == before and source in alive  # nothing moved; the drained node stays
    assert sum(o.startswith("cancelled") for o in outcomes) == 2, outcomes


def worker_groups(kube: MemoryKube) -> dict[str, dict[str, Any]]:
    ray_cluster = kube.ray_clusters[("analytics", "sf")]
    return {g["groupName"]: g for g in ray_cluster["spec"]["workerGroupSpecs"]}


def image_of(group: Mapping[str, Any]) -> str:
    return str(group["template"]["spec"]["containers"][0]["image"])


def test_an_image_change_replaces_the_group_once_the_new_pods_serve(multinode: Multinode) -> None:
    """KubeRay replaces no running pod when a group's template changes: the operator starts
    the new image's pods as a group of their own, and once every one serves, drains the old
    pods (their shards move live) and has KubeRay delete them, then drops their group. Runs
    last in this module: it drains the module's Ray nodes."""
    kube = kube_for(multinode, running=3)
    reconcile_cluster(cluster_body(replicas=3), kube, multinode.connect)  # 0.2.0 runs
    body = cluster_body(replicas=2, generation=2)
    body["spec"]["image"] = new_image = "shardflow/shardflow:0.3.0"
    new = f"cpu-{hashlib.sha256(new_image.encode()).hexdigest()[:6]}"
    status = reconcile_cluster(body, kube, multinode.connect)
    validate_status("ShardflowCluster", status)
    groups = worker_groups(kube)
    assert set(groups) == {"cpu", new}
    assert image_of(groups["cpu"]) == "shardflow/shardflow:0.2.0"
    assert groups["cpu"]["replicas"] == 3 and "scaleStrategy" not in groups["cpu"]
    assert image_of(groups[new]) == new_image and groups[new]["replicas"] == 2
    assert status["phase"] == "Upgrading" and "0 of 2 pods" in status["conditions"][2]["message"]
    old_pods = sorted(p["metadata"]["name"] for p in kube.pods)
    with shardflow.connect(multinode.served.uri, token=multinode.token) as db:
        old_nodes = {n.ray_node_name for n in db.cluster.nodes() if n.alive}
    # KubeRay starts the new group's pods: Ray nodes named as the pods, workers join them
    added = [multinode.local.add_node(object_store_mb=128).name for _ in range(2)]
    deadline = time.monotonic() + 90
    with shardflow.connect(multinode.served.uri, token=multinode.token) as db:
        while {n.ray_node_name for n in db.cluster.nodes() if n.alive} < {*old_nodes, *added}:
            assert time.monotonic() < deadline, "no workers joined the new pods"
            time.sleep(0.5)
    kube.pods += [pod(name, "2026-12-09T00:00:00Z", group=new) for name in added]
    status = reconcile_cluster(body, kube, multinode.connect)
    validate_status("ShardflowCluster", status)
    groups = worker_groups(kube)
    assert groups["cpu"]["replicas"] == 0
    assert groups["cpu"]["scaleStrategy"]["workersToDelete"] == old_pods
    with shardflow.connect(multinode.served.uri, token=multinode.token) as db:
        serving = {n.ray_node_name for n in db.cluster.nodes() if n.alive and n.shards}
    assert serving and serving <= set(added), "a pod KubeRay is told to delete still serves"
    assert count(multinode) == ROWS
    # KubeRay deleted the old pods: their group is dropped, the cluster is steady
    kube.pods = [p for p in kube.pods if p["metadata"]["labels"]["ray.io/group"] == new]
    status = reconcile_cluster(body, kube, multinode.connect)
    validate_status("ShardflowCluster", status)
    assert set(worker_groups(kube)) == {new} and status["phase"] == "Running", status
    assert count(multinode) == ROWS
