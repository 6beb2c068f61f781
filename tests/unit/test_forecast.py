"""Predictive balancing on plain data: the load history learns a daily cycle and a level,
survives a restart, hands its profile to split halves; the decision made ahead moves in
quiet hours before a forecast overload, never into another one, waits when it is neither
quiet nor urgent, and falls back to the reactive balancer without history."""

from __future__ import annotations

import dataclasses
import math

import pytest

from shardflow.control.balancer import BalancerSettings, NodeState, UnitState, plan
from shardflow.control.forecast import (
    ForecastSettings,
    LoadHistory,
    moves_ahead,
    plan_ahead,
)

HOUR = 3600.0
DAY = 24 * HOUR
DAILY = ForecastSettings(period_s=DAY, slots=24, horizon_s=DAY, lead_s=3 * HOUR)
SETTINGS = BalancerSettings(max_moves=4, max_unit_bytes=1 << 50, min_unit_bytes=1)


def working_day(peak_hour: float, t: float, high: float = 1.0) -> float:
    """``high`` for eight hours around ``peak_hour``, a tenth of it otherwise."""
    hour = (t % DAY) / HOUR
    away = min(abs(hour - peak_hour), 24 - abs(hour - peak_hour))
    return high if away <= 4 else 0.1 * high


def learned(profiles: dict[int, float], days: int = 2, step: float = 600.0) -> LoadHistory:
    """A history fed ``days`` of each unit's working day (unit -> its peak hour)."""
    history = LoadHistory(DAILY)
    t = 0.0
    while t < days * DAY:
        history.observe(t, {u: working_day(h, t) for u, h in profiles.items()})
        t += step
    return history


def test_the_history_learns_a_daily_cycle_and_follows_its_level() -> None:
    history = learned({1: 12.0}, days=1)
    assert history.coverage(1) == pytest.approx(23 / 24)  # the last slot is being filled
    history.observe(DAY, {1: working_day(12.0, DAY)})
    assert history.coverage(1) == 1.0 and history.known([1]) and not history.known([1, 2])
    assert not learned({1: 12.0}, days=1, step=4 * 3600.0).known([1])  # 6 of 24 slots
    assert history.forecast(1, 2 * DAY + 12 * HOUR) == pytest.approx(1.0)
    assert history.forecast(1, 2 * DAY + 0.5 * HOUR) == pytest.approx(0.1)
    assert history.peak(1, 2 * DAY, 2 * DAY + 6 * HOUR) == pytest.approx(0.1)
    assert history.peak(1, 2 * DAY, 3 * DAY) == pytest.approx(1.0)
    # the unit doubles its load: the level follows before the profile has caught up
    t = DAY
    while t < 3 * DAY:
        history.observe(t, {1: 2 * working_day(12.0, t)})
        t += 600.0
    assert history.forecast(1, 3 * DAY + 12 * HOUR) == pytest.approx(2.0, rel=0.15)
    assert history.forecast(1, 3 * DAY + 0.5 * HOUR) == pytest.approx(0.2, rel=0.15)


def test_the_history_is_kept_and_read_back_and_split_halves_inherit_it() -> None:
    history = learned({1: 12.0, 2: 0.0})
    again = LoadHistory.from_json(history.to_json(), DAILY)
    for t in (0.0, 5 * HOUR, 12 * HOUR, 20 * HOUR):
        assert again.forecast(1, t) == history.forecast(1, t)
        assert again.forecast(2, t) == history.forecast(2, t)
    other = ForecastSettings(period_s=DAY, slots=48)
    assert LoadHistory.from_json(history.to_json(), other).units == {}  # another shape
    again.inherit(3, [1], 0.5)  # a split half
    again.inherit(4, [1, 2], 1.0)  # a merge
    assert again.forecast(3, 12 * HOUR) == pytest.approx(0.5 * history.forecast(1, 12 * HOUR))
    merged = history.forecast(1, 0.0) + history.forecast(2, 0.0)  # type: ignore[operator]
    assert again.forecast(4, 0.0) == pytest.approx(merged)
    assert again.known([3, 4])
    again.forget([1])
    assert again.forecast(1, 0.0) is None and not again.known([1])


def cluster_for(history: LoadHistory, t: float) -> tuple[list[NodeState], list[UnitState]]:
    """Two equal nodes; node-0 holds both morning tenants (units 1, 2), node-1 both evening
    ones (3, 4). Each tenant's day alone is 40 % of a node: node-0 is at 80 % each morning
    while node-1 idles, and the other way round each evening."""
    peaks = {1: 9.0, 2: 9.0, 3: 21.0, 4: 21.0}
    units = [
        UnitState(u, f"g{u}", "node-0" if u <= 2 else "node-1", 0, 1, 1 << 30,
                  0.4 * working_day(h, t))
        for u, h in peaks.items()
    ]  # fmt: skip
    used = {n: sum(u.load for u in units if u.node == n) for n in ("node-0", "node-1")}
    nodes = [NodeState(n, 1.0, utilization=used[n]) for n in ("node-0", "node-1")]
    return nodes, units


def scaled(history: LoadHistory, factor: float) -> LoadHistory:
    for unit in history.units.values():
        unit.profile = [None if v is None else v * factor for v in unit.profile]
    return history


PEAKS = {1: 9.0, 2: 9.0, 3: 21.0, 4: 21.0}


def test_moves_ahead_pair_tenants_that_peak_apart_in_a_quiet_hour() -> None:
    history = scaled(learned(PEAKS), 0.4)
    at = 2 * DAY + 15 * HOUR  # between the peaks: quiet, and nobody is over now
    nodes, units = cluster_for(history, at)
    assert all(n.utilization < SETTINGS.utilization_threshold for n in nodes)
    decision = plan_ahead(nodes, units, history, at, SETTINGS)
    assert decision.actions, decision.reason
    assert decision.reason.startswith("predicted")
    assert all(a.reason.startswith("predicted: ") for a in decision.actions)
    placed = {u.unit_id: u.node for u in units}
    for move in decision.actions:
        placed[move.unit_id] = move.to  # type: ignore[union-attr]
    # afterwards each node holds one morning and one evening tenant: never over 80 %
    assert {placed[1], placed[2]} == {"node-0", "node-1"}
    assert {placed[3], placed[4]} == {"node-0", "node-1"}
    for hour in range(24):
        for node in ("node-0", "node-1"):
            busy = sum(0.4 * working_day(PEAKS[u], hour * HOUR) for u in PEAKS if placed[u] == node)
            assert busy <= SETTINGS.utilization_threshold * 0.9 + 1e-9


MORNINGS_HEAVY = {1: 9.0, 2: 9.0, 3: 9.0, 4: 21.0, 5: 21.0}
"""Three morning tenants on node-0 (90 % each morning), two evening ones on node-1."""


def mornings_heavy(t: float) -> tuple[list[NodeState], list[UnitState]]:
    units = [
        UnitState(u, f"g{u}", "node-0" if u <= 3 else "node-1", 0, 1, 1 << 30,
                  0.3 * working_day(h, t))
        for u, h in MORNINGS_HEAVY.items()
    ]  # fmt: skip
    return [NodeState("node-0", 1.0), NodeState("node-1", 1.0, utilization=0.6)], units


def test_a_forecast_overload_far_ahead_waits_for_a_quiet_hour() -> None:
    history = scaled(learned(MORNINGS_HEAVY), 0.3)
    late = 2 * DAY + 22 * HOUR  # node-1's evening: busy, and node-0's peak is 7 h away
    decision = plan_ahead(*mornings_heavy(late), history, late, SETTINGS)
    assert decision.actions == () and "wait for a quiet window" in decision.reason
    soon = 2 * DAY + 3.5 * HOUR  # node-0's peak starts in 1.5 h: no waiting
    decision = plan_ahead(*mornings_heavy(soon), history, soon, SETTINGS)
    assert decision.actions and decision.actions[0].reason.startswith("predicted: node-0")
    quiet = 2 * DAY + 15 * HOUR  # the afternoon lull: quiet, the moves are made now
    assert plan_ahead(*mornings_heavy(quiet), history, quiet, SETTINGS).actions


def test_slow_moves_start_earlier_before_a_forecast_overload() -> None:
    """The same cluster at night, node-0's peak 7 h away: with moves as fast as an idle
    cluster's they wait for a quiet window; at the speed moves go under load now (here
    5 h for the GiB to move) the overload is too close to wait."""
    history = scaled(learned(MORNINGS_HEAVY), 0.3)
    late = 2 * DAY + 22 * HOUR
    nodes, units = mornings_heavy(late)
    fast = plan_ahead(nodes, units, history, late, SETTINGS, move_s_per_byte=30 / (1 << 30))
    assert fast.actions == () and "wait for a quiet window" in fast.reason
    slow = plan_ahead(nodes, units, history, late, SETTINGS, move_s_per_byte=5 * HOUR / (1 << 30))
    assert slow.actions and slow.actions[0].reason.startswith("predicted: node-0")


def test_a_move_never_makes_an_overload_elsewhere() -> None:
    """Three morning tenants on node-0 and an evening one on node-1: node-1 can take one
    morning tenant and stay under 72 % all day, not two."""
    peaks = {1: 9.0, 2: 9.0, 3: 9.0, 4: 21.0}
    history = scaled(learned(peaks), 0.3)
    at = 2 * DAY + 15 * HOUR
    units = [
        UnitState(u, f"g{u}", "node-0" if u <= 3 else "node-1", 0, 1, 1 << 30,
                  0.3 * working_day(h, at))
        for u, h in peaks.items()
    ]  # fmt: skip
    nodes = [NodeState("node-0", 1.0), NodeState("node-1", 1.0)]
    moves, first = moves_ahead(nodes, units, history, at, SETTINGS)
    assert first is not None and first > at  # node-0 is forecast at 90 % tomorrow morning
    assert len(moves) == 1 and moves[0].to == "node-1" and moves[0].unit_id in (1, 2, 3)
    # node-1 with two morning tenants instead: taking a third would put it at 90 % in the
    # morning, as node-0 is: nothing moves (the overload would only change places)
    mornings = [u if u.unit_id != 4 else UnitState(4, "g4", "node-1", 0, 1, 1 << 30, 0.03)
                for u in units] + [UnitState(5, "g5", "node-1", 0, 1, 1 << 30, 0.03)]  # fmt: skip
    history = scaled(learned(dict.fromkeys(range(1, 6), 9.0)), 0.3)
    moves, first = moves_ahead(nodes, mornings, history, at, SETTINGS)
    assert first is not None and moves == []


def test_without_history_or_while_evacuating_the_reactive_balancer_decides() -> None:
    history = LoadHistory(DAILY)
    nodes = [NodeState("node-0", 1.0, utilization=0.95), NodeState("node-1", 1.0)]
    units = [UnitState(u, f"g{u}", "node-0", 0, 1, 1 << 30, 0.3) for u in range(1, 4)]
    decision = plan_ahead(nodes, units, history, 0.0, SETTINGS)
    assert decision.actions and all(a.reason.startswith("observed: ") for a in decision.actions)
    known = scaled(learned({u: 9.0 for u in range(1, 4)}), 0.3)
    leaving = plan_ahead(nodes, units, known, 0.0, SETTINGS, excluded=frozenset({"node-0"}))
    assert leaving.actions and all("evacuate" in a.reason for a in leaving.actions)
    assert all(a.reason.startswith("observed: ") for a in leaving.actions)


def test_a_spike_nobody_forecast_is_relieved_at_once() -> None:
    history = scaled(learned(PEAKS), 0.4)
    at = 2 * DAY + 15 * HOUR
    nodes, units = cluster_for(history, at)
    units = [u if u.unit_id != 3 else UnitState(3, "g3", "node-1", 0, 1, 1 << 30, 0.9)
             for u in units]  # fmt: skip
    moves, first = moves_ahead(nodes, units, history, at, SETTINGS)
    assert first == at and moves and moves[0].reason.startswith("observed: node-1")


def test_forecast_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        ForecastSettings(slots=0)
    with pytest.raises(ValueError):
        ForecastSettings(smoothing=0)
    assert math.isclose(ForecastSettings().slot_s, 1800.0)


def test_a_node_that_joins_gets_its_share_from_the_balancer_at_once() -> None:
    """The forecast keeps nodes under the threshold; filling a new node is the balancer's,
    forecast or not."""
    peaks = {u: 9.0 if u <= 3 else 21.0 for u in range(1, 7)}
    history = scaled(learned(peaks), 0.2)
    at = 2 * DAY + 9 * HOUR  # node-0's three morning tenants at 60 %, node-1 at 6 %
    units = [
        UnitState(u, f"g{u}", "node-0" if u <= 3 else "node-1", 0, 1, 1 << 30,
                  0.2 * working_day(h, at))
        for u, h in peaks.items()
    ]  # fmt: skip
    nodes = [NodeState(n, 1.0) for n in ("node-0", "node-1", "node-2")]
    decision = plan_ahead(nodes, units, history, at, SETTINGS)
    assert decision.actions and all(
        a.to == "node-2" and a.reason.startswith("observed: ")  # type: ignore[union-attr]
        for a in decision.actions
    )
    # an idle cluster is not balanced by bytes once the forecast rules: that would undo the
    # forecast's placement every quiet night
    idle = [dataclasses.replace(u, load=0.0) for u in units[:2]] + [
        dataclasses.replace(u, load=0.0, bytes=8 << 30) for u in units[2:]
    ]
    assert plan(nodes[:2], idle, SETTINGS).actions  # the balancer alone would move bytes
    decision = plan_ahead(nodes[:2], idle, history, 2 * DAY + 15 * HOUR, SETTINGS)
    assert decision.actions == () and decision.reason == "balanced for the forecast"
