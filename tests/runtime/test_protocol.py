"""The protocol itself: both implementations of each interface (workers, their lookup, the
coordinator) speak all of it, its messages survive serialisation as Ray does it, and nothing
calls a remote method by a name in a string."""

from __future__ import annotations

import inspect
import pickle
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from shardflow.control.migration import Checksum, SourceChecksums
from shardflow.errors import WorkerGone
from shardflow.runtime import protocol
from shardflow.runtime.inprocess import LocalCoordinator, LocalWorker, LocalWorkers
from shardflow.runtime.protocol import ChangeSet, FenceResult
from shardflow.runtime.ray.actors import CoordinatorService, WorkerService
from shardflow.runtime.ray.handles import RayCoordinator, RaySourceLink, RayWorker, RayWorkers
from shardflow.storage.shard import Change
from tests.support.local_cluster import LocalCluster

RUNTIME = Path(__file__).parents[2] / "src" / "shardflow" / "runtime"


def methods(cls: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for name, member in vars(cls).items()
        if callable(member) and not name.startswith("_")
    }


def parameters(signature: inspect.Signature) -> list[str]:
    return [p for p in signature.parameters if p != "self"]


def test_both_implementations_speak_the_whole_protocol() -> None:
    for interface, implementations in (
        (protocol.Worker, (RayWorker, LocalWorker)),
        (protocol.Workers, (RayWorkers, LocalWorkers)),
        (protocol.Coordinator, (RayCoordinator, LocalCoordinator)),
    ):
        wanted = methods(interface)
        assert wanted, interface
        for implementation in implementations:
            found = methods(implementation)
            for name, signature in wanted.items():
                assert name in found, f"{implementation.__name__} lacks {name}"
                assert parameters(found[name]) == parameters(signature), (implementation, name)


def test_every_actor_method_the_protocol_uses_is_a_typed_ray_method() -> None:
    """A Ray handle's method calls the actor method of the same name (or the source half's
    export_*); each is declared with @ray.method, so mypy checks every call's arguments
    and answer against the actor's own signature."""
    for actor, handles, some in (
        (WorkerService, (RayWorker, RaySourceLink), {"fence", "finish_import", "export_changes"}),
        (CoordinatorService, (RayCoordinator,), {"catalog", "begin_create", "drain_host"}),
    ):
        source = "".join(inspect.getsource(handle) for handle in handles)
        called = set(re.findall(r"self\.handle\.(\w+)\.remote\(", source))
        assert called >= some
        for name in called:
            assert name in vars(actor) and callable(vars(actor)[name]), name


def test_no_remote_call_names_its_method_in_a_string() -> None:
    paths = [*RUNTIME.rglob("*.py"), RUNTIME.parent / "api.py"]
    assert len(paths) > 20, "the runtime's modules are where this test looks"
    for path in paths:
        text = path.read_text()
        assert not re.search(r"getattr\([^)]*\)\s*\.\s*(remote|options)", text), path
        assert not re.search(r"coordinator_(read|call)\(", text), path


def test_move_messages_survive_serialisation() -> None:
    rows = pa.table({"id": pa.array([1, 2, 3], pa.int64())})
    change = Change(7, "batch", rows, np.array([4, 5, 6], np.int32))
    fenced = FenceResult(
        ChangeSet("node-0", {("t", 3): (change,)}),
        SourceChecksums("node-0", {"t": Checksum(3, 99)}, {"t": 3}),
    )
    again = pickle.loads(pickle.dumps(fenced))
    assert again.sums == fenced.sums and again.changes.rows == 3
    [kept] = again.changes.changes[("t", 3)]
    assert kept.rows.equals(rows) and kept.buckets.tolist() == [4, 5, 6]


def test_a_call_its_worker_stops_under_is_worker_gone_as_over_ray(tmp_path: Path) -> None:
    """A drain's last step stops the worker while a fragment may still run on it: in
    process its engine closes under the call (DuckDB's ConnectionException). That is the
    worker gone, which the caller retries elsewhere (Ray says an actor died), not a fault
    of the query's own; a query failed for it under drains in `test_pacing`."""
    cluster = LocalCluster(tmp_path / "data")
    try:
        node = sorted(cluster.catalog.nodes)[0]
        worker = cluster.workers.get(node)

        def stopped_under() -> object:
            cluster.workers.stop(node)
            return worker.node.engine.execute("SELECT 1")

        with pytest.raises(WorkerGone, match="stopped during the call"):
            worker._call(stopped_under).get()
        with pytest.raises(WorkerGone):
            worker.ping().get()
    finally:
        cluster.close()
