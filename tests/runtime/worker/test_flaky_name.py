"""``test_flaky_node`` names a worker by its shardflow node or by the Ray node it runs on (the
nemesis's flaky node joins under a Ray node name, its shardflow name unknown beforehand)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardflow.config import Settings
from shardflow.errors import NodeFault
from shardflow.runtime.worker.node import WorkerNode


@pytest.mark.parametrize(
    ("node", "host", "flaky"),
    [("node-3", "ray-flaky", True), ("node-1", "ray-flaky", True), ("node-3", "ray-2", False),
     ("node-3", "", False), ("ray-flaky", "", True)],
)  # fmt: skip
def test_a_flaky_node_is_named_by_its_node_or_its_host(
    tmp_path: Path, node: str, host: str, flaky: bool
) -> None:
    settings = Settings(test_flaky_node="ray-flaky=0.5")
    worker = WorkerNode(node, str(tmp_path), settings, host_name=host)
    failed = 0
    for _ in range(4):
        try:
            worker._flaky_fault()
        except NodeFault:
            failed += 1
    assert failed == (2 if flaky else 0)
