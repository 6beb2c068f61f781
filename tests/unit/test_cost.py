"""The cost model with plain data: speeds relative to the median node, loads in its
seconds, and a node slower at joins given less join-heavy load."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from shardflow.control.balancer import BalancerSettings, NodeState, UnitState, plan
from shardflow.control.cost import capacity_for, reference_load, relative_speeds
from tests.unit.test_balancer import apply

GiB = 1 << 30
UNIFORM = {"scan_filter": 1.0, "hash_aggregate": 1.0, "hash_join": 1.0, "sort": 1.0}
JOIN_SLOW = {**UNIFORM, "hash_join": 0.85}


def test_speeds_are_relative_to_the_median_node_per_operator() -> None:
    calibrations = {
        "a": {"scan_filter": 200.0, "hash_join": 30.0},
        "b": {"scan_filter": 210.0, "hash_join": 31.0},
        "c": {"scan_filter": 100.0, "hash_join": 25.5},
        "new": {},
    }
    speeds = relative_speeds(calibrations)
    assert speeds["a"] == speeds["b"] == {"scan_filter": 1.0, "hash_join": 1.0}  # noise
    assert speeds["c"] == {"scan_filter": pytest.approx(100 / 200), "hash_join": 0.85}
    assert speeds["new"] == {}  # not calibrated yet: no speeds, no error
    # nodes of one model share their median: one that calibrated while busy is not slower
    models = {"a": "m", "b": "m", "c": "m", "new": "m"}
    assert relative_speeds(calibrations, models)["c"] == speeds["a"]


def test_capacity_for_a_mix_is_the_weighted_geometric_mean_of_speeds() -> None:
    assert capacity_for(JOIN_SLOW, {"hash_join": 1.0}) == pytest.approx(0.85)
    assert capacity_for(JOIN_SLOW, {"scan_filter": 3.0}) == pytest.approx(1.0)
    half = capacity_for(JOIN_SLOW, {"hash_join": 1.0, "scan_filter": 1.0})
    assert half == pytest.approx(math.sqrt(0.85))
    assert capacity_for(JOIN_SLOW) == pytest.approx(0.85**0.25)  # no mix: all alike
    assert capacity_for({}, {"hash_join": 1.0}) == 1.0  # nothing known: the median node


def test_seconds_on_a_slow_node_count_as_fewer_reference_seconds() -> None:
    half_speed = dict.fromkeys(UNIFORM, 0.5)
    assert reference_load({"scan_filter": 2.0}, half_speed) == pytest.approx(1.0)
    # only the join seconds are discounted on a node that is slower at joins only
    assert reference_load({"hash_join": 1.0}, JOIN_SLOW) == pytest.approx(0.85)
    assert reference_load({"scan_filter": 1.0}, JOIN_SLOW) == pytest.approx(1.0)
    assert reference_load({}, JOIN_SLOW) == 0.0


def units(node: str, mix: dict[str, float], count: int, start: int) -> list[UnitState]:
    ids = range(start, start + count)
    return [UnitState(i, "g", node, i * 4, i * 4 + 4, GiB, 1.0, mix) for i in ids]


def test_a_node_slower_at_joins_gets_proportionally_less_join_heavy_load() -> None:
    """Half the units only join, half only scan; node "j" is 15 % slower at joins."""
    nodes = [NodeState("a", 1.0, speeds=UNIFORM), NodeState("j", 1.0, speeds=JOIN_SLOW)]
    joins, scans = {"hash_join": 1.0}, {"scan_filter": 1.0}
    start = [
        *units("a", joins, 8, 0),
        *units("a", scans, 8, 8),
        *units("j", joins, 8, 16),
        *units("j", scans, 8, 24),
    ]
    settings = BalancerSettings(tolerance=0.02, max_moves=4, min_unit_bytes=1 << 20)
    # j spends 8/0.85 + 8 = 17.4 seconds to a's 16: it sheds, and what it sheds are joins
    assert plan(nodes, start, settings).spread > 0.02
    settled = start
    for _ in range(20):
        decision = plan(nodes, settled, settings)
        if not decision.actions:
            break
        settled = apply(settled, decision.actions)
    assert decision.actions == () and decision.spread <= 0.02
    join_on_j = sum(u.load for u in settled if u.node == "j" and u.mix == joins)
    scan_on_j = sum(u.load for u in settled if u.node == "j" and u.mix == scans)
    assert join_on_j < 8 <= scan_on_j
    # the same units on nodes equal at everything stay where they are
    equal = [replace(n, speeds=UNIFORM) for n in nodes]
    assert plan(equal, start, settings).actions == ()
