"""Versions of the roles' messages, in process (real workers, DuckDB and files): a node
added to a running cluster whose worker speaks two versions from the coordinator's is
refused, stopped, and never joins, the cluster serving on; a session two releases from the
coordinator refuses to attach, one a release apart attaches."""

from __future__ import annotations

import pickle
from pathlib import Path

import pyarrow as pa
import pytest

from shardflow.errors import ConfigError, WorkerGone
from shardflow.runtime import wire
from shardflow.runtime.client.session import Session
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


def test_a_session_two_releases_from_the_coordinator_refuses_to_attach(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session asks the coordinator's version when it starts (``ping`` answers it)."""
    cluster = LocalCluster(tmp_path / "data", nodes=1)
    try:
        monkeypatch.setattr(wire, "PROTOCOL", PROTOCOL + 2)  # a session of a later release
        with pytest.raises(ConfigError, match=f"the coordinator speaks protocol {PROTOCOL} "
                           f"and this session {PROTOCOL + 2}"):  # fmt: skip
            Session(cluster.backend)
        monkeypatch.setattr(wire, "PROTOCOL", PROTOCOL + 1)  # one apart: it attaches
        Session(cluster.backend).close()
    finally:
        cluster.close()


def test_every_wire_type_pickles_by_the_path_the_release_before_reads() -> None:
    """0.2.0's protocol was one module: its workers unpickle ``FenceResult`` & co. as
    ``shardflow.runtime.protocol.<name>``, so the split package must send them by that
    path, or a rolling upgrade's mixed moves fail on the old side."""
    from shardflow.runtime import protocol
    from shardflow.runtime.protocol import messages

    wire_types = [v for v in vars(messages).values() if isinstance(v, type) and v.__doc__]
    assert {"FenceResult", "CopyResult", "WorkerInfo", "ChangeSet"} <= {
        t.__name__ for t in wire_types
    }
    for wire_type in wire_types:
        if wire_type.__module__.startswith("shardflow.runtime.protocol"):
            assert wire_type.__module__ == "shardflow.runtime.protocol", wire_type
            assert getattr(protocol, wire_type.__qualname__) is wire_type
            pickled = pickle.dumps(wire_type)
            assert b"protocol.messages" not in pickled
            assert pickle.loads(pickled) is wire_type
