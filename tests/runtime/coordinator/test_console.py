"""The console server without Ray: the coordinator's controller over in-process workers,
served as the coordinator serves it. What ``/api/state`` says follows the cluster (a move,
a rolled-back move, a failover, queries); ``/metrics`` stays Prometheus'; nothing else is
served."""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from shardflow.control.migration import TERMINAL, Phase
from shardflow.runtime.coordinator.views import console_state
from shardflow.telemetry.console import ConsoleServer
from tests.support.local_cluster import ROWS, LocalCluster, events

IN_FLIGHT = {p.value for p in Phase} - {p.value for p in TERMINAL}


def get(
    server: ConsoleServer, path: str, host: str | None = None, method: str = "GET"
) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection(server.host, server.port, timeout=10)
    try:
        headers = {"Host": host} if host is not None else {}
        connection.request(method, path, headers=headers)
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def state(server: ConsoleServer) -> dict[str, Any]:
    status, headers, body = get(server, "/api/state")
    assert status == 200 and headers["Content-Type"] == "application/json"
    data: dict[str, Any] = json.loads(body)
    return data


def placed(data: dict[str, Any]) -> dict[str, str]:
    """Shard -> node, as the map's cells show it."""
    return {
        s: row["node"] for row in data["map"]["rows"] for c in row["cells"] for s in c["shards"]
    }


def serve(cluster: LocalCluster) -> ConsoleServer:
    return ConsoleServer(0, cluster.registry, partial(console_state, cluster.controller), cache_s=0)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    local = LocalCluster(tmp_path / "data")
    local.create_table("events", events(0, ROWS), "id")
    yield local
    local.close()


def test_the_console_serves_the_page_its_state_and_the_metrics(cluster: LocalCluster) -> None:
    server = serve(cluster)
    try:
        status, headers, page = get(server, "/")
        assert status == 200 and headers["Content-Type"].startswith("text/html")
        assert b'id="updated"' in page and b"api/state" in page
        assert "default-src 'none'" in headers["Content-Security-Policy"]
        assert b"http://" not in page and b"https://" not in page  # nothing from elsewhere

        data = state(server)
        assert [n["name"] for n in data["nodes"]] == ["node-0", "node-1", "node-2"]
        assert all(n["alive"] and n["vendor"] == "cpu" for n in data["nodes"])
        assert sum(n["shards"] for n in data["nodes"]) == len(cluster.units("events"))
        assert sum(n["rows"] for n in data["nodes"]) == ROWS
        units = {f"events#{u.unit_id}": u for u in cluster.units("events")}
        assert placed(data) == {shard: unit.node for shard, unit in units.items()}
        assert data["buckets"] == cluster.catalog.n_buckets
        assert data["moves"] == data["rollbacks"] == data["failovers"] == []

        status, headers, metrics = get(server, "/metrics")
        assert status == 200 and headers["Content-Type"].startswith("text/plain; version=")
        assert b"shardflow_nodes 3.0" in metrics

        assert get(server, "/nope")[0] == 404
        assert get(server, "/api/state/x")[0] == 404
        assert get(server, "/", method="POST")[0] == 501  # read-only: GET alone
        # a page of another site that DNS rebinding pointed here is not answered
        assert get(server, "/api/state", host="evil.example:8080")[0] == 403
        assert get(server, "/", host="evil.example")[0] == 403
        assert get(server, "/api/state", host="localhost:18080")[0] == 200  # a tunnel
        assert get(server, "/api/state", host="[::1]:9")[0] == 200
        assert get(server, "/metrics", host="10.0.0.5:9100")[0] == 200  # scrapers as before
    finally:
        server.close()


def test_the_state_follows_moves_failovers_and_queries(cluster: LocalCluster) -> None:
    server = serve(cluster)
    try:
        epoch = state(server)["epoch"]
        unit = cluster.units("events")[0]
        target = next(n for n in cluster.catalog.nodes if n != unit.node)
        assert cluster.migrate(unit.unit_id, target)["phase"] == "done"
        data = state(server)
        assert placed(data)[f"events#{unit.unit_id}"] == target
        assert data["epoch"] > epoch
        assert data["moves"] == [] and data["rollbacks"] == []  # done: neither

        assert cluster.controller.recorder is not None
        for _ in range(6):
            cluster.controller.recorder.query(0.01, True)
        data = state(server)
        assert data["queries"] == 6 and data["qps"] > 0

        profile = cluster.workers.get("node-2").info().get().profile
        cluster.state.report_profile(profile)  # as it does once calibrated
        cluster.workers.stop("node-2")  # dead, and not failed over yet
        [dead] = [n for n in state(server)["nodes"] if n["name"] == "node-2"]
        assert not dead["alive"] and dead["vendor"] == "cpu" and dead["rows"] == 0
        record = cluster.controller.fail_node("node-2")
        assert record is not None
        data = state(server)
        assert [f["node"] for f in data["failovers"]] == ["node-2"]
        assert data["failovers"][0]["units"] == record.units
        assert "node-2" not in [n["name"] for n in data["nodes"]]
        assert set(placed(data).values()) <= {"node-0", "node-1"}
    finally:
        server.close()


def test_a_rolled_back_move_is_listed(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path / "data", test_fault_move_copy="drop_row")
    server = serve(cluster)
    try:
        cluster.create_table("events", events(0, ROWS), "id")
        unit = cluster.units("events")[0]
        target = next(n for n in cluster.catalog.nodes if n != unit.node)
        assert cluster.migrate(unit.unit_id, target)["phase"] == "rolled_back"
        [rollback] = state(server)["rollbacks"]
        assert rollback["shards"] == [f"events#{unit.unit_id}"]
        assert rollback["to_nodes"] == [target] and rollback["phase"] == "rolled_back"
        assert "rolled back" in rollback["outcome"]
        assert placed(state(server))[f"events#{unit.unit_id}"] == unit.node
    finally:
        server.close()
        cluster.close()


def test_a_move_in_flight_shows_its_phase(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path / "data", migration_bandwidth_mb_s=0.05)  # about 2 s
    server = serve(cluster)
    try:
        cluster.create_table("events", events(0, ROWS), "id")
        unit = cluster.units("events")[0]
        target = next(n for n in cluster.catalog.nodes if n != unit.node)
        results: list[dict[str, Any]] = []
        mover = threading.Thread(
            target=lambda: results.append(cluster.migrate(unit.unit_id, target))
        )
        mover.start()
        seen: list[dict[str, Any]] = []
        while mover.is_alive() and not seen:
            seen = state(server)["moves"]
        mover.join(timeout=60)
        assert results and results[0]["phase"] == "done"
        assert seen, "the move was never seen in flight"
        [move] = seen
        assert move["shards"] == [f"events#{unit.unit_id}"] and move["to_nodes"] == [target]
        assert move["phase"] in IN_FLIGHT, move
        assert state(server)["moves"] == []
    finally:
        server.close()
        cluster.close()
