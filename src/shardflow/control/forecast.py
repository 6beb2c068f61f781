"""Predictive balancing: each unit's load history, a forecast of its next hours, and a
balancing decision made on the forecast rather than on the last window alone. Pure: plain
data in, a decision out.

The model is multiplicative Holt-Winters without its trend term. A period (a day by
default) is cut into slots (48 of 30 minutes). Each unit keeps a level and, per slot, a
seasonal factor: the level is the smoothed ratio of what the unit did to what its profile
expected (clipped to [0.5, 2]; a unit whose load grows or shrinks is forecast at its new
level within hours), the slot's factor the smoothed ratio of what it did in that slot to
its level (``smoothing``: the weight of the newest day). The forecast for a time is the
level times the slot's factor. A unit is known
once its profile covers ``min_coverage`` of the period's slots.

Deciding ahead (:func:`plan_ahead`): once every unit is known, moves are planned on the
forecast of every slot of the coming ``horizon_s`` (the whole period by default), where
the unit's slot now counts what it does now if that is more (a spike nobody forecast). A
node forecast over the threshold at some hour sheds units to nodes that stay under it at
every hour (:func:`moves_ahead`): units that peak together end up on different nodes
before their peak, and a placement good for the whole day stops the moves that chase a
daily cycle back and forth (the reactive balancer's spread is not acted on). Moves for a
forecast overload (reason ``predicted``) are made in quiet windows (the quietest quarter
of the period by the cluster's forecast load) unless the overload is due within
``lead_s``; moves for what is observed now (a hot node, a spike, a node being evacuated;
reason ``observed``) are made at once, and splits and merges as before. A node that joins
(it holds no unit yet) gets its share from the balancer at once, as before.
``bench/balancer_sim.py --trace diurnal`` compares this with the reactive balancer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from shardflow.control.balancer import BalancerSettings, Decision, Move, NodeState, UnitState, plan

LEVEL_CLIP = (0.5, 2.0)
"""The most a unit's level may scale its profile (a day's load against earlier days)."""
TRIGGER = 0.95
"""A node forecast busier than this share of ``utilization_threshold`` is relieved."""
AIM = 0.9
"""A node takes a unit if it stays under this share of ``utilization_threshold``."""
MIN_GAIN = 0.05
"""Where no node can take a unit and stay under 90 % of the threshold, a move is still made
if it lowers the busiest moment of the two nodes by at least this much utilisation."""
SWAP_SEARCH = 8
"""How many units of each side, and how many other nodes, a swap considers."""
LEVEL_SMOOTHING = 0.2
"""The weight of the newest slot in a unit's level."""
SEASON_FLOOR = 1e-6
"""A slot whose profile is below this (an idle hour) says nothing about the level."""


@dataclass(frozen=True)
class ForecastSettings:
    """Every knob of the forecast (documented on :class:`shardflow.Settings`)."""

    period_s: float = 86_400.0
    slots: int = 48
    smoothing: float = 0.3
    min_coverage: float = 0.9
    horizon_s: float = 86_400.0
    lead_s: float = 3 * 3_600.0
    quiet_quantile: float = 0.25

    def __post_init__(self) -> None:
        if self.period_s <= 0 or self.slots < 1:
            raise ValueError("a forecast needs a positive period and at least one slot")
        if not 0 < self.smoothing <= 1 or not 0 < self.min_coverage <= 1:
            raise ValueError("smoothing and min_coverage are fractions in (0, 1]")
        if self.horizon_s < 0 or self.lead_s < 0 or not 0 <= self.quiet_quantile <= 1:
            raise ValueError("horizon and lead are >= 0 seconds, quiet_quantile in [0, 1]")

    @property
    def slot_s(self) -> float:
        return self.period_s / self.slots


@dataclass
class UnitHistory:
    """One unit's seasonal profile (a smoothed mean per slot; None: never seen), its level,
    and the slot it is filling now (absolute slot number, sum, samples)."""

    profile: list[float | None]
    level: float = 1.0
    slot: int = -1
    total: float = 0.0
    samples: int = 0


class LoadHistory:
    """Load history per unit, bounded (one number per slot of the period and unit)."""

    def __init__(self, settings: ForecastSettings | None = None) -> None:
        self.settings = settings or ForecastSettings()
        self.units: dict[int, UnitHistory] = {}

    # -- learning -------------------------------------------------------------------------
    def observe(self, now: float, loads: Mapping[int, float]) -> None:
        """The load each unit had over the window ending ``now``. Units not named lose
        nothing; a unit seen for the first time starts an empty profile."""
        slot = int(now // self.settings.slot_s)
        for unit_id, load in loads.items():
            history = self.units.get(unit_id)
            if history is None:
                history = self.units[unit_id] = UnitHistory([None] * self.settings.slots)
            if history.slot != slot:
                self._fold(history)
                history.slot, history.total, history.samples = slot, 0.0, 0
            history.total += max(0.0, float(load))
            history.samples += 1

    def _fold(self, history: UnitHistory) -> None:
        """Fold the slot being filled into the level and the profile (multiplicative
        Holt-Winters without trend: the level follows what the unit did over what its
        profile expected, the slot's profile what it did over its level)."""
        if history.samples == 0 or history.slot < 0:
            return
        mean = history.total / history.samples
        index = history.slot % self.settings.slots
        season = history.profile[index]
        if season is None:
            history.profile[index] = mean / history.level
            return
        if season > SEASON_FLOOR:
            ratio = min(max(mean / season, LEVEL_CLIP[0]), LEVEL_CLIP[1])
            level = (1 - LEVEL_SMOOTHING) * history.level + LEVEL_SMOOTHING * ratio
            history.level = min(max(level, LEVEL_CLIP[0]), LEVEL_CLIP[1])
        alpha = self.settings.smoothing
        history.profile[index] = (1 - alpha) * season + alpha * mean / history.level

    def forget(self, unit_ids: Iterable[int]) -> None:
        for unit_id in unit_ids:
            self.units.pop(unit_id, None)

    def inherit(self, unit_id: int, parents: Sequence[int], share: float) -> None:
        """A unit made by a split (``share`` 0.5 of one parent) or a merge (``share`` 1.0 of
        both) starts with its parents' profile, scaled."""
        known = [self.units[p] for p in parents if p in self.units]
        if not known:
            return
        profile: list[float | None] = []
        for index in range(self.settings.slots):
            values = [h.profile[index] for h in known]
            seen = [v * h.level for v, h in zip(values, known, strict=True) if v is not None]
            profile.append(sum(seen) * share if len(seen) == len(known) else None)
        self.units[unit_id] = UnitHistory(profile)

    # -- forecasting ----------------------------------------------------------------------
    def coverage(self, unit_id: int) -> float:
        history = self.units.get(unit_id)
        if history is None:
            return 0.0
        return sum(v is not None for v in history.profile) / self.settings.slots

    def known(self, unit_ids: Iterable[int]) -> bool:
        """Whether every one of these units has history enough to be forecast."""
        ids = list(unit_ids)
        return bool(ids) and all(self.coverage(u) >= self.settings.min_coverage for u in ids)

    def forecast(self, unit_id: int, at: float) -> float | None:
        """The unit's load expected at time ``at`` (None: that slot was never seen)."""
        history = self.units.get(unit_id)
        if history is None:
            return None
        value = history.profile[int(at // self.settings.slot_s) % self.settings.slots]
        return None if value is None else value * history.level

    def peak(self, unit_id: int, start: float, end: float) -> float | None:
        """The most load the unit is expected to have in [start, end]."""
        seen = [v for t in self.times(start, end) if (v := self.forecast(unit_id, t)) is not None]
        return max(seen) if seen else None

    def times(self, start: float, end: float) -> list[float]:
        """One time in each slot from ``start`` to ``end`` (at most a period's worth)."""
        step = self.settings.slot_s
        count = max(1, min(self.settings.slots, math.ceil((end - start) / step) + 1))
        return [start + i * step for i in range(count)]

    # -- persistence ----------------------------------------------------------------------
    def to_json(self) -> dict[str, object]:
        return {
            "period_s": self.settings.period_s,
            "slots": self.settings.slots,
            "units": {
                str(u): {"profile": h.profile, "level": h.level, "slot": h.slot,
                         "total": h.total, "samples": h.samples}
                for u, h in self.units.items()
            },
        }  # fmt: skip

    @classmethod
    def from_json(cls, data: Mapping[str, object], settings: ForecastSettings) -> LoadHistory:
        """A kept history; one kept under another period or slot count starts afresh."""
        history = cls(settings)
        if data.get("period_s") != settings.period_s or data.get("slots") != settings.slots:
            return history
        units = data.get("units")
        if not isinstance(units, dict):
            return history
        for key, kept in units.items():
            profile = kept.get("profile") if isinstance(kept, dict) else None
            if not isinstance(profile, list) or len(profile) != settings.slots:
                continue
            history.units[int(key)] = UnitHistory(
                [None if v is None else float(v) for v in profile],
                float(kept.get("level", 1.0)),
                int(kept.get("slot", -1)),
                float(kept.get("total", 0.0)),
                int(kept.get("samples", 0)),
            )
        return history


def plan_ahead(
    nodes: Sequence[NodeState],
    units: Sequence[UnitState],
    history: LoadHistory,
    now: float,
    settings: BalancerSettings,
    previous_load: float | None = None,
    busy: frozenset[int] = frozenset(),
    excluded: frozenset[str] = frozenset(),
    move_s_per_byte: float = 0.0,
) -> Decision:
    """The balancer's decision made ahead, on forecasts, where every unit is known; else
    the reactive balancer's (:func:`shardflow.control.balancer.plan`) on observed load.
    Every action's reason starts with ``predicted:`` or ``observed:`` (see the module's
    docstring). ``move_s_per_byte`` is how long moves take now (they slow down under
    load, see ``control/admission.py``): moves due before an overload start that much
    earlier than ``lead_s`` before it."""
    decision = plan(nodes, units, settings, previous_load, busy, excluded)
    evacuating = any(u.node in excluded for u in units)
    held = {u.node for u in units}
    joined = any(n.node not in held and n.node not in excluded for n in nodes)
    # the balancer's own decision where the forecast has nothing to say: a node to empty,
    # a node that just joined (it gets its share now, not at the next forecast overload),
    # units without a day of history. (Not an idle cluster: its bytes would be balanced
    # every quiet night and the forecast's placement undone each time.)
    if evacuating or joined or not history.known(u.unit_id for u in units):
        return _marked(decision, "observed")
    # splits and merges as the balancer decides them; moves by the forecast alone: a
    # spread that the day's cycle makes and unmakes is no reason to move anything
    reshape = tuple(a for a in decision.actions if not isinstance(a, Move))
    if reshape:
        return _marked(dataclasses.replace(decision, actions=reshape), "observed")
    moves, first = moves_ahead(nodes, units, history, now, settings, busy, excluded)
    if not moves:
        return dataclasses.replace(decision, actions=(), reason="balanced for the forecast")
    taking = move_s_per_byte * sum(m.bytes for m in moves)  # one after another, at worst
    soon = first is not None and first <= now + history.settings.lead_s + taking
    if not soon and not quiet(history, units, now):
        why = f"predicted: {len(moves)} move(s) wait for a quiet window"
        return dataclasses.replace(decision, actions=(), reason=why)
    kinds = sorted({m.reason.split(":", 1)[0] for m in moves})
    why = "/".join(kinds) + f": {len(moves)} move(s) ahead of forecast overload"
    return dataclasses.replace(decision, actions=tuple(moves), reason=why)


def moves_ahead(
    nodes: Sequence[NodeState],
    units: Sequence[UnitState],
    history: LoadHistory,
    now: float,
    settings: BalancerSettings,
    busy: frozenset[int] = frozenset(),
    excluded: frozenset[str] = frozenset(),
) -> tuple[list[Move], float | None]:
    """Moves that keep every node under ``utilization_threshold`` (``TRIGGER`` of it) at
    every slot of the coming ``horizon_s``, and when the first forecast overload is (None:
    none is).

    Each unit's load per slot is its forecast (now: what it does now, where that is more,
    so a spike counts); a node's utilisation is its units' load over its capacity. Nodes
    are relieved in the order their overload comes, each shedding its units of the most
    load per byte at its worst slot (now, when it is over now) to the node whose worst
    slot stays lowest with the unit added, where that stays under 90 % of the threshold
    (a move does not make the overload it cures elsewhere) or else is lower than the
    shedding node's worst slot (see ``MIN_GAIN``); where no one unit can go, two nodes
    busy at different hours trade a unit each (:func:`_swap`); at most ``max_moves``
    moves."""
    times = history.times(now, now + history.settings.horizon_s)
    capacity = {n.node: max(n.capacity, 1e-9) for n in nodes}
    load: dict[int, list[float]] = {}
    for unit in units:
        row = [history.forecast(unit.unit_id, t) for t in times]
        load[unit.unit_id] = [unit.load if v is None else v for v in row]
        load[unit.unit_id][0] = max(load[unit.unit_id][0], unit.load)
    busyness: dict[str, list[float]] = {n: [0.0] * len(times) for n in capacity}
    on_node: dict[str, list[UnitState]] = {n: [] for n in capacity}
    for unit in units:
        if unit.node in capacity:
            on_node[unit.node].append(unit)
            for k, value in enumerate(load[unit.unit_id]):
                busyness[unit.node][k] += value / capacity[unit.node]
    # a forecast is acted on a little below the threshold: a day is seldom its average
    limit = TRIGGER * settings.utilization_threshold
    aim = AIM * settings.utilization_threshold

    def first_over(node: str) -> int | None:
        return next((k for k, u in enumerate(busyness[node]) if u > limit), None)

    over = {n: slot for n in capacity if (slot := first_over(n)) is not None}
    first = times[min(over.values())] if over else None
    targets = [n for n in capacity if n not in excluded]
    moves: list[Move] = []
    for node in sorted(over, key=lambda n: (over[n], n)):
        while len(moves) < settings.max_moves and first_over(node) is not None:
            # over now (a spike): relieve now; else the worst slot to come
            now_over = busyness[node][0] > limit
            worst = 0 if now_over else max(range(len(times)), key=lambda k: busyness[node][k])
            candidates = sorted(
                (u for u in on_node[node] if u.unit_id not in busy),
                key=lambda u: -load[u.unit_id][worst] / max(u.bytes, 1),
            )
            placed = _place(candidates, node, targets, load, busyness, capacity, aim)
            if placed is None and len(moves) + 2 <= settings.max_moves:
                placed = _swap(candidates, node, targets, load, busyness, capacity, on_node, busy)
            if placed is None:
                break
            when = "now" if worst == 0 else f"in {(times[worst] - now) / 3600:.1f} h"
            before = busyness[node][worst]
            for unit, source, to in placed:
                for k, value in enumerate(load[unit.unit_id]):
                    busyness[source][k] -= value / capacity[source]
                    busyness[to][k] += value / capacity[to]
                on_node[source].remove(unit)
                on_node[to].append(unit)
                spike = worst == 0 and unit.load >= load[unit.unit_id][0]
                kind = "observed" if spike else "predicted"
                moves.append(
                    Move(unit.unit_id, to, unit.bytes, f"{kind}: {node} at {before:.0%} {when}")
                )
    return moves, first


def _place(
    candidates: Sequence[UnitState],
    node: str,
    targets: Sequence[str],
    load: Mapping[int, list[float]],
    busyness: Mapping[str, list[float]],
    capacity: Mapping[str, float],
    aim: float,
) -> list[tuple[UnitState, str, str]] | None:
    """The first candidate some other node takes while its worst slot stays under ``aim``
    (or, where none can, stays lower than ``node``'s worst slot is now: the busiest moment
    of the two nodes gets lower), to the node whose worst slot stays lowest."""
    source_peak = max(busyness[node])
    fallback: list[tuple[UnitState, str, str]] | None = None
    for unit in candidates:
        row = load[unit.unit_id]
        best: tuple[float, str] | None = None
        for to in targets:
            if to == node:
                continue
            peak = max(b + v / capacity[to] for b, v in zip(busyness[to], row, strict=True))
            if best is None or (peak, to) < best:
                best = (peak, to)
        if best is None:
            return None
        if best[0] <= aim:
            return [(unit, node, best[1])]
        if fallback is None and best[0] < source_peak - MIN_GAIN:
            fallback = [(unit, node, best[1])]
    return fallback


def _swap(
    candidates: Sequence[UnitState],
    node: str,
    targets: Sequence[str],
    load: Mapping[int, list[float]],
    busyness: Mapping[str, list[float]],
    capacity: Mapping[str, float],
    on_node: Mapping[str, list[UnitState]],
    busy: frozenset[int],
) -> list[tuple[UnitState, str, str]] | None:
    """Two moves where no one move helps: a unit of ``node`` for one of another node (two
    nodes busy at different hours trade units), the pair that lowers the busier of the two
    nodes' worst slots most (by at least ``MIN_GAIN``). The ``SWAP_SEARCH`` densest units of
    each side are tried, with the nodes whose worst slot is lowest."""

    def peak_with(target: str, out: list[float], into: list[float]) -> float:
        scale = capacity[target]
        rows = zip(busyness[target], out, into, strict=True)
        return max(b + (i - o) / scale for b, o, i in rows)

    best: tuple[float, UnitState, str, UnitState] | None = None
    others = sorted((n for n in targets if n != node), key=lambda n: max(busyness[n]))
    for to in others[:SWAP_SEARCH]:
        now_worst = max(max(busyness[node]), max(busyness[to]))
        theirs = [u for u in on_node[to] if u.unit_id not in busy][:SWAP_SEARCH]
        for mine in candidates[:SWAP_SEARCH]:
            a = load[mine.unit_id]
            for their in theirs:
                b = load[their.unit_id]
                worst = max(peak_with(node, a, b), peak_with(to, b, a))
                if worst < now_worst - MIN_GAIN and (best is None or worst < best[0]):
                    best = (worst, mine, to, their)
    if best is None:
        return None
    _, mine, to, their = best
    return [(mine, node, to), (their, to, node)]


def quiet(history: LoadHistory, units: Sequence[UnitState], now: float) -> bool:
    """Whether the cluster's forecast load now is at or below the period's quantile."""
    ahead = history.settings

    def cluster_load(at: float) -> float:
        return sum(history.forecast(u.unit_id, at) or 0.0 for u in units)

    slots = sorted(cluster_load(i * ahead.slot_s) for i in range(ahead.slots))
    return cluster_load(now) <= slots[int(ahead.quiet_quantile * (len(slots) - 1))]


def _marked(decision: Decision, kind: str) -> Decision:
    """The decision with each action's reason (and its own) starting with ``kind``."""
    actions = tuple(dataclasses.replace(a, reason=f"{kind}: {a.reason}") for a in decision.actions)
    reason = f"{kind}: {decision.reason}" if actions else decision.reason
    return dataclasses.replace(decision, actions=actions, reason=reason)
