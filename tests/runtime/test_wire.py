"""A node added to a running cluster (in process: real workers, DuckDB and files) whose
worker speaks two versions from the coordinator's is refused, stopped, and never joins;
the cluster goes on serving."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from shardflow.errors import ConfigError, WorkerGone
from shardflow.runtime.wire import PROTOCOL
from tests.support.local_cluster import LocalCluster


def test_a_node_of_a_release_too_far_is_refused_and_never_joins(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path / "data", nodes=2, test_protocol=PROTOCOL + 2)
    try:
        cluster.create_table("t", pa.table({"id": list(range(100))}), "id")
        with pytest.raises(ConfigError, match=f"worker node-2 speaks protocol {PROTOCOL + 2}"):
            cluster.session.add_node()
        assert sorted(cluster.catalog.nodes) == ["node-0", "node-1"]
        with pytest.raises(WorkerGone):  # stopped, not left running beside the cluster
            cluster.workers.get("node-2")
        assert cluster.sql("SELECT count(*) AS n FROM t").to_pylist() == [{"n": 100}]
    finally:
        cluster.close()
