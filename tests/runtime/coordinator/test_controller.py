"""The controller without Ray: drains, failover, load observation, capacities and gauges,
over real in-process workers."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from shardflow.control import balancer, forecast
from shardflow.control.forecast import UnitHistory
from shardflow.runtime.coordinator import views
from shardflow.runtime.coordinator.controller import Controller, _evacuation
from shardflow.telemetry.devices import NodeProfile
from tests.support.local_cluster import ROWS, LocalCluster, assert_serves, events


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    local = LocalCluster(tmp_path / "data", shards_per_worker=2)  # several units a node
    local.create_table("events", events(0, ROWS), "id")
    yield local
    local.close()


def test_a_drain_moves_every_unit_off_live(cluster: LocalCluster) -> None:
    held = [u.unit_id for u in cluster.units("events") if u.node == "node-0"]
    report = cluster.controller.drain("node-0", deadline_s=60)
    assert report.drained and report.remaining == 0 and not report.reason
    assert sorted(int(m["plan"]["sources"][0]["unit_id"]) for m in report.moved) == sorted(held)
    assert all(m["phase"] == "done" for m in report.moved)
    assert "node-0" not in cluster.catalog.nodes
    assert all(u.node != "node-0" for u in cluster.units("events"))
    cluster.workers.stop("node-0")  # the session stops it after a drain
    assert_serves(cluster, events(0, ROWS))


def test_a_drain_past_its_deadline_leaves_the_node_serving(cluster: LocalCluster) -> None:
    report = cluster.controller.drain("node-1", deadline_s=0)
    assert not report.drained and report.remaining == 2 and "deadline" in report.reason
    assert "node-1" in cluster.catalog.nodes
    assert_serves(cluster, events(0, ROWS))


def test_load_is_observed_from_typed_reports(cluster: LocalCluster) -> None:
    cluster.controller.observe()  # opens the window
    for _ in range(5):
        cluster.sql("SELECT id % 7 AS k, count(*) FROM events GROUP BY k")
    nodes, units = cluster.controller.observe()
    assert {n.node for n in nodes} == set(cluster.catalog.nodes)
    assert sum(u.load for u in units) > 0 and all(u.bytes > 0 for u in units)
    shard_load = cluster.controller.shard_load
    assert shard_load and all(v >= 0 for v in shard_load.values())
    assert "hash_aggregate" in cluster.state.operator_mix  # the cluster's mix, as observed
    loads = cluster.controller.node_loads()
    assert all(load.utilization is not None for load in loads.values())
    gauges = views.gauges(cluster.controller)
    assert sum(n.shards for n in gauges.nodes) == len(cluster.units("events"))
    assert all(n.memory_used_bytes > 0 for n in gauges.nodes)


def profile(node: str, join_rows_per_s: float) -> NodeProfile:
    calibration = {
        "scan_filter": 400e6,
        "hash_aggregate": 100e6,
        "hash_join": join_rows_per_s,
        "sort": 12e6,
    }
    return NodeProfile(node, "cpu", f"model-{node}", 1 << 30, 4, "duckdb", calibration=calibration)


def test_capacity_is_computed_one_way_for_the_current_operator_mix(cluster: LocalCluster) -> None:
    """node-2 is half as fast at joins: a join-heavy mix gives it less capacity than a scan
    mix does, for placement and the balancer alike."""
    state = cluster.state
    for node, joins in (("node-0", 35e6), ("node-1", 35e6), ("node-2", 17.5e6)):
        state.report_profile(profile(node, joins))
    nodes = list(state.catalog.nodes)
    state.operator_mix = {"scan_filter": 1.0}
    assert state.capacities(nodes) == {"node-0": 1.0, "node-1": 1.0, "node-2": 1.0}
    state.operator_mix = {"hash_join": 1.0}
    joins = state.capacities(nodes)
    assert joins["node-0"] == 1.0 and joins["node-2"] == pytest.approx(0.5, abs=0.01)
    loads = cluster.controller.node_loads()  # what db.cluster.nodes() shows
    assert loads["node-2"].capacity == joins["node-2"]
    # a new table's units are placed by the same capacities: the slow joiner gets fewer
    cluster.create_table("joined", events(0, 3_000), "id")
    held = [u.node for u in cluster.units("joined")]
    assert held.count("node-2") < held.count("node-0")
    assert sum(cluster.sql("SELECT count(*) AS n FROM joined").column("n").to_pylist()) == 3_000


def test_rows_survive_a_worker_restart(cluster: LocalCluster) -> None:
    cluster.insert("events", events(ROWS, 10))
    cluster.restart("node-1")
    assert_serves(cluster, pa.concat_tables([events(0, ROWS), events(ROWS, 10)]))


def test_a_restarted_coordinator_adopts_live_members_and_fails_over_lost_ones(
    cluster: LocalCluster,
) -> None:
    """A coordinator restarted on another node has no member profiles: it asks each member
    for one, and fails over a member whose worker was lost with the old coordinator's node
    (without ``adopt`` it would watch no one, and that member's shards stay unserved)."""
    cluster.state.profiles.clear()  # what a restarted coordinator knows
    cluster.workers.stop("node-1")  # lost together with the old coordinator
    cluster.controller.adopt()
    cluster.controller._adopt_members()
    assert cluster.catalog.nodes == ("node-0", "node-2")
    assert set(cluster.state.profiles) == {"node-0", "node-2"}
    assert not cluster.controller._adopting
    assert_serves(cluster, events(0, ROWS))


def test_the_balancer_decides_ahead_on_a_kept_load_history(cluster: LocalCluster) -> None:
    """node-0's units are forecast at full load within the hour (a day of history says
    so): a dry run plans predicted moves off node-0; the history is kept in the data
    directory and a restarted coordinator's controller reads it back."""
    controller = cluster.controller
    history = controller.load_history
    slots = history.settings.slots
    now = time.time()
    soon = int((now + 1800) // history.settings.slot_s) % slots
    for unit in cluster.units("events"):
        busy = unit.node == "node-0"
        profile: list[float | None] = [0.01] * slots
        profile[soon] = 0.5 if busy else 0.01
        history.units[unit.unit_id] = UnitHistory(profile)
    controller.observe()  # opens the load window
    summary = controller.rebalance(dry_run=True)
    moves = [a for a in summary["actions"] if a["action"] == "move"]
    assert moves, summary["reason"]
    assert all(a["reason"].startswith("predicted: node-0") for a in moves)
    assert {a["to"] for a in moves} <= {"node-1", "node-2"}
    assert summary["reason"].startswith("predicted")

    # a split's halves take half their unit's history each: the forecast stays whole
    unit = next(u for u in cluster.units("events") if u.node == "node-0")
    cluster.split(unit.unit_id)
    halves = [u for u in cluster.units("events") if unit.lo <= u.lo and u.hi <= unit.hi]
    assert len(halves) == 2 and unit.unit_id not in history.units
    for half in halves:
        assert history.forecast(half.unit_id, now + 1800) == pytest.approx(0.25)
    assert history.known(u.unit_id for u in cluster.units("events"))

    controller._keep_history(time.time(), force=True)
    again = Controller(cluster.state, cluster.workers, cluster.settings)
    kept = again.load_history
    assert set(kept.units) == {u.unit_id for u in cluster.units("events")}
    for unit in cluster.units("events"):
        at = now + 1800
        assert kept.forecast(unit.unit_id, at) == history.forecast(unit.unit_id, at)


def test_an_evacuation_is_recognised_however_its_reason_is_marked() -> None:
    """With auto_balance off the balancer still evacuates suspect nodes: its loop finds
    the evacuations in a decision by their reason, marked or not."""
    plain = balancer.Move(1, "node-2", 10, "evacuate suspect node node-1")
    marked = forecast.plan_ahead(
        [balancer.NodeState("node-1", 1.0), balancer.NodeState("node-2", 1.0)],
        [balancer.UnitState(1, "g", "node-1", 0, 1, 10, 0.1)],
        forecast.LoadHistory(),
        0.0,
        balancer.BalancerSettings(),
        excluded=frozenset({"node-1"}),
    ).actions
    assert marked and marked[0].reason.startswith("observed: ")
    assert _evacuation(plain) and _evacuation(marked[0])
    assert not _evacuation(balancer.Move(1, "node-2", 10, "observed: hot nodes node-1"))


@pytest.mark.parametrize("kept", [b"{torn", b"[1, 2]", b'{"period_s": 86400.0, "slots": 48, '
                                  b'"units": {"1": {"profile": ["x"]}}}'])  # fmt: skip
def test_a_kept_load_history_that_cannot_be_read_is_started_afresh(
    cluster: LocalCluster, kept: bytes
) -> None:
    path = cluster.state.data_dir.path("balancer", "load_history.json")
    cluster.state.data_dir.write_atomic(path, kept)
    again = Controller(cluster.state, cluster.workers, cluster.settings)  # starts, all the same
    assert again.load_history.units == {}
