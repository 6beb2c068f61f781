"""The balancer: from observed per-node and per-unit load and size, the splits, merges and
moves that bring every node's load per unit of capacity within the tolerance of the mean,
moving as few bytes as it can. Pure: plain data in, a decision out.

Load is what the workers measured (seconds of execution per second, per unit), in the
median node's seconds (``control/cost.py``); where a unit's operator mix is known, it costs
each node according to that node's speed for the mix. While the cluster is (nearly) idle,
size stands in for load, so that a node that joins an idle cluster still receives its share
of the data.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from shardflow.control.cost import capacity_for


@dataclass(frozen=True)
class NodeState:
    node: str
    capacity: float
    """Relative speed (1.0 = reference node); a node of capacity 0.5 gets half the work."""
    utilization: float = 0.0
    """Busy fraction over the last window (device utilisation where telemetry has it)."""
    speeds: Mapping[str, float] = field(default_factory=dict)
    """Throughput per calibrated operator relative to the median node (empty: unknown)."""
    memory: int = 0
    """Bytes of shards the node can keep in its engine's memory (a GPU worker's device
    cache budget, ``device_cache_mb``; 0: no bound). No move takes a node past it."""


@dataclass(frozen=True)
class UnitState:
    unit_id: int
    group: str
    node: str
    lo: int
    hi: int
    bytes: int
    load: float = 0.0
    """Execution seconds per second spent on this unit's shards, in the median node's
    seconds."""
    mix: Mapping[str, float] = field(default_factory=dict)
    """Shares of that load by calibrated operator (empty: unknown)."""


@dataclass(frozen=True)
class BalancerSettings:
    """Every threshold of the balancer (documented on :class:`shardflow.Settings`)."""

    utilization_threshold: float = 0.80
    tolerance: float = 0.10
    load_swing: float = 0.20
    max_moves: int = 2
    max_unit_bytes: int = 1 << 40
    min_unit_bytes: int = 256 << 20
    idle_load: float = 0.05
    """Below this much cluster load (busy seconds per second) size stands in for load."""


@dataclass(frozen=True)
class Split:
    unit_id: int
    reason: str


@dataclass(frozen=True)
class Merge:
    first: int
    second: int
    reason: str


@dataclass(frozen=True)
class Move:
    unit_id: int
    to: str
    bytes: int
    reason: str


Action = Split | Merge | Move
SINK_SEARCH = 32
"""How many of the least loaded nodes a move considers before it gives up on a unit."""
OVERSHOOT = 2.0
"""A unit carrying more than this times what its node must shed is split, not moved whole:
moving the excess (half of it next round) costs fewer bytes."""
Weight = Callable[[UnitState, str], float]
"""What a unit weighs on a node (its load there, or its bytes), against the node's share."""


@dataclass(frozen=True)
class Decision:
    actions: tuple[Action, ...]
    reason: str
    measure: str
    """What was balanced: "load" or "bytes"."""
    spread: float
    """Largest deviation of a node's load/capacity from the mean, before the actions."""
    total_load: float
    projected: dict[str, float] = field(default_factory=dict)
    """Each node's load/capacity relative to the mean after the planned moves."""


def target_unit_bytes(unit: UnitState, cost_per_byte: float, settings: BalancerSettings) -> float:
    """The size a unit should have: between the minimum and maximum, smaller when the queries
    that hit it cost more per byte than the cluster's typical query (``cost_per_byte`` is the
    median over units)."""
    low, high = float(settings.min_unit_bytes), float(settings.max_unit_bytes)
    middle = math.sqrt(low * high)
    if unit.bytes <= 0 or unit.load <= 0 or cost_per_byte <= 0:
        return high
    heavier = (unit.load / unit.bytes) / cost_per_byte
    return min(high, max(low, middle / heavier))


def plan(
    nodes: Sequence[NodeState],
    units: Sequence[UnitState],
    settings: BalancerSettings,
    previous_load: float | None = None,
    busy: frozenset[int] = frozenset(),
    excluded: frozenset[str] = frozenset(),
) -> Decision:
    """What to do now. ``busy`` units are being moved already and are left alone.
    ``excluded`` nodes (suspect or failing, :mod:`shardflow.control.health`) get no share:
    their units move off, the most loaded first, before anything else moves."""
    if not nodes:
        return Decision((), "no nodes", "load", 0.0, 0.0)
    total_load = sum(u.load for u in units)
    measure = "load" if total_load >= settings.idle_load else "bytes"

    capacity = {n.node: max(n.capacity, 1e-9) for n in nodes}
    weight = _weight(measure, capacity, {n.node: n.speeds for n in nodes if n.speeds})

    held: dict[str, float] = defaultdict(float)
    for unit in units:
        if unit.node in capacity:
            held[unit.node] += weight(unit, unit.node)
    total = sum(held.values())
    excluded = frozenset(n for n in excluded if n in capacity)
    serving = [n for n in capacity if n not in excluded]
    memory = {n.node: n.memory for n in nodes if n.memory > 0}
    stored: dict[str, int] = defaultdict(int)
    for unit in units:
        stored[unit.node] += unit.bytes
    # a node's share is at most what its engine's memory keeps, at the cluster's average
    # weight per byte: the rest is shared among the others
    per_byte = total / max(sum(stored.values()), 1)
    bound = {n: memory[n] * per_byte for n in serving if n in memory}
    share = _shares(total, {n: capacity[n] for n in serving}, bound)
    share.update({n: 0.0 for n in capacity if n not in serving})
    ratio = {n: (held[n] / share[n] if share[n] > 0 else 0.0) for n in capacity}
    spread = max((abs(ratio[n] - 1.0) for n in serving), default=0.0) if total > 0 else 0.0
    # any unit counts, also one without load (a table only written to)
    evacuating = sorted({u.node for u in units if u.node in excluded})
    hot = [n.node for n in nodes if n.utilization > settings.utilization_threshold]
    swing = (
        previous_load is not None
        and previous_load > 0
        and abs(total_load - previous_load) / previous_load > settings.load_swing
    )

    free = [u for u in units if u.unit_id not in busy]
    if evacuating and serving:  # first of all; splits, merges and balancing come after
        leaving = [u for u in free if u.node in excluded]
        room = _Room(memory, stored)
        moves = _evacuate(leaving, excluded, capacity, held, share, settings, weight, room)
        why = f"{len(moves)} move(s): evacuating suspect node(s) " + ", ".join(evacuating)
        why = "; ".join([why, *_beyond_memory(memory, room.stored)])
        projected = {n: held[n] / share[n] for n in serving if share[n] > 0}
        return Decision(tuple(moves), why, measure, spread, total_load, projected)
    free = [u for u in free if u.node not in excluded]

    actions: list[Action] = []
    reasons: list[str] = []
    actions += _splits(free, settings, share, measure)
    if actions:
        reasons.append(f"{len(actions)} shard(s) too big or too hot")
    # a group keeps a unit per node, excluded ones counted: they may be re-admitted
    merges = _merges(
        free, settings, {a.unit_id for a in actions if isinstance(a, Split)}, len(nodes)
    )
    if merges:
        reasons.append(f"{len(merges)} pair(s) of small cold shards")
    actions += merges

    unbalanced = spread > settings.tolerance and total > 0
    projected = {n: ratio[n] for n in serving}
    if (unbalanced or hot or swing) and len(actions) < settings.max_moves:
        touched = {a.unit_id for a in actions if isinstance(a, Split)}
        touched |= {u for a in actions if isinstance(a, Merge) for u in (a.first, a.second)}
        # a node whose dense units are being split waits for the halves rather than
        # shedding its sparser units now (that would move more bytes for the same load)
        waiting = {u.node for u in free if u.unit_id in touched}
        candidates = [u for u in free if u.unit_id not in touched]
        moves, projected = _moves(
            candidates,
            capacity,
            held,
            share,
            settings,
            weight,
            settings.max_moves - len(actions),
            set(hot),
            waiting,
            _Room(memory, stored),
        )
        actions += moves
        if moves:
            why = (
                "hot nodes " + ", ".join(sorted(hot))
                if hot
                else (
                    f"{measure}/capacity spread {spread:.0%} > {settings.tolerance:.0%}"
                    if unbalanced
                    else "load swung since the last poll"
                )
            )
            reasons.append(f"{len(moves)} move(s): {why}")
    if not reasons and unbalanced:
        reasons.append(
            f"{measure}/capacity spread {spread:.0%} > {settings.tolerance:.0%}, but no move"
            " brings a node closer to its share"
        )
    # said on every decision while it lasts: no move here takes a node back under it
    reasons += _beyond_memory(memory, stored)
    reason = "; ".join(reasons) if reasons else "balanced"
    return Decision(tuple(actions), reason, measure, spread, total_load, projected)


def _weight(
    measure: str, capacity: dict[str, float], speeds: dict[str, Mapping[str, float]]
) -> Weight:
    """What a unit weighs on a node: its bytes, or its load scaled by how much slower (or
    faster) the node is for the unit's operator mix than its capacity says."""

    def size(unit: UnitState, node: str) -> float:
        return float(unit.bytes)

    def load(unit: UnitState, node: str) -> float:
        return unit.load

    def load_for_mix(unit: UnitState, node: str) -> float:
        if not unit.mix or node not in speeds:
            return unit.load
        return unit.load * capacity[node] / max(capacity_for(speeds[node], unit.mix), 1e-9)

    if measure == "bytes":
        return size
    return load_for_mix if speeds else load


def _shares(
    total: float, capacity: Mapping[str, float], bound: Mapping[str, float]
) -> dict[str, float]:
    """``total`` shared in proportion to capacity, no node's share above its ``bound``: what
    a bounded node cannot take goes to the others, again in proportion to capacity. Where
    every node is bounded and the total exceeds the bounds, the excess is shared too."""
    share: dict[str, float] = {}
    left, open_nodes = total, dict(capacity)
    while open_nodes:
        weight = sum(open_nodes.values())
        capped = {
            n: bound[n]
            for n, c in open_nodes.items()
            if n in bound and left * c / weight > bound[n]
        }
        if not capped:
            share.update({n: left * c / weight for n, c in open_nodes.items()})
            return share
        share.update(capped)
        left -= sum(capped.values())
        for node in capped:
            del open_nodes[node]
    weight = sum(capacity.values())
    return {n: share[n] + left * c / weight for n, c in capacity.items()} if weight else share


class _Room:
    """The bytes of shards each node holds, against what its engine's memory keeps."""

    def __init__(self, memory: Mapping[str, int], stored: Mapping[str, int]) -> None:
        self.memory = memory
        self.stored = dict(stored)

    def fits(self, unit: UnitState, node: str) -> bool:
        bound = self.memory.get(node, 0)
        return bound <= 0 or self.stored.get(node, 0) + unit.bytes <= bound

    def move(self, unit: UnitState, src: str, dst: str) -> None:
        self.stored[src] = self.stored.get(src, 0) - unit.bytes
        self.stored[dst] = self.stored.get(dst, 0) + unit.bytes


def _beyond_memory(memory: Mapping[str, int], stored: Mapping[str, int]) -> list[str]:
    """A note per node holding more bytes of shards than its engine's memory keeps (its
    least recently read shards are built again when read)."""
    return [
        f"{node} holds {stored.get(node, 0) / 2**20:.0f} MiB of shards, its device cache keeps"
        f" {bound / 2**20:.0f} MiB (device_cache_mb)"
        for node, bound in sorted(memory.items())
        if stored.get(node, 0) > bound
    ]


def _evacuate(
    units: Sequence[UnitState],
    excluded: frozenset[str],
    capacity: dict[str, float],
    held: dict[str, float],
    share: dict[str, float],
    settings: BalancerSettings,
    weight: Weight,
    room: _Room,
) -> list[Action]:
    """Move units off excluded nodes, the most loaded first, each to the serving node
    furthest below its share (room or not: the units must go; a node whose engine's memory
    has room for the unit first), within the move limit. ``held`` and ``room`` are updated
    as if the moves were done."""
    serving = [n for n in capacity if n not in excluded and share[n] > 0]
    moves: list[Action] = []
    for unit in sorted(units, key=lambda u: (-weight(u, u.node), u.unit_id)):
        if len(moves) >= settings.max_moves or not serving:
            break
        dst = min(
            serving,
            key=lambda n: (not room.fits(unit, n), (held[n] + weight(unit, n)) / share[n], n),
        )
        held[unit.node] -= weight(unit, unit.node)
        held[dst] += weight(unit, dst)
        room.move(unit, unit.node, dst)
        moves.append(Move(unit.unit_id, dst, unit.bytes, f"evacuate suspect node {unit.node}"))
    return moves


def _splits(
    units: Sequence[UnitState],
    settings: BalancerSettings,
    share: dict[str, float],
    measure: str,
) -> list[Action]:
    """Split units bigger than their target size. (Units too hot to move whole are split by
    the mover, which knows whether any node has room for them.)"""
    costs = sorted(u.load / u.bytes for u in units if u.bytes > 0 and u.load > 0)
    median_cost = costs[len(costs) // 2] if costs else 0.0
    splits: list[Action] = []
    for unit in sorted(units, key=lambda u: -u.bytes):
        if unit.hi - unit.lo < 2 or len(splits) >= settings.max_moves:
            continue
        target = target_unit_bytes(unit, median_cost, settings)
        if unit.bytes > settings.max_unit_bytes or unit.bytes > 2 * target:
            splits.append(Split(unit.unit_id, f"{unit.bytes} bytes > target {target:.0f}"))

    return splits


def _merges(
    units: Sequence[UnitState], settings: BalancerSettings, skip: set[int], nodes: int
) -> list[Action]:
    """Join adjacent units of a group on one node when both are small and cold, as long as
    the group keeps a unit per node (its queries still run on every node)."""
    mean_load = sum(u.load for u in units) / len(units) if units else 0.0
    by_group: dict[str, list[UnitState]] = defaultdict(list)
    for unit in units:
        by_group[unit.group].append(unit)
    merges: list[Action] = []
    used: set[int] = set(skip)
    for group_units in by_group.values():
        group_units.sort(key=lambda u: u.lo)
        left = len(group_units)
        for a, b in itertools.pairwise(group_units):
            if left <= nodes:
                break
            if len(merges) >= settings.max_moves:
                return merges
            if a.unit_id in used or b.unit_id in used or a.node != b.node or a.hi != b.lo:
                continue
            small = a.bytes + b.bytes < settings.min_unit_bytes
            cold = a.load <= 0.1 * mean_load and b.load <= 0.1 * mean_load
            if small and cold:
                merges.append(Merge(a.unit_id, b.unit_id, "small and cold neighbours"))
                used |= {a.unit_id, b.unit_id}
                left -= 1
    return merges


def _moves(
    units: Sequence[UnitState],
    capacity: dict[str, float],
    held: dict[str, float],
    share: dict[str, float],
    settings: BalancerSettings,
    weight: Weight,
    budget: int,
    hot: set[str],
    waiting: set[str],
    room: _Room,
) -> tuple[list[Action], dict[str, float]]:
    """Moves only what brings nodes back into the band, carrying the most load per byte,
    never to a node whose engine's memory has no room for the unit.

    Every node above the band (or hot) sheds, densest units first, to the least loaded
    nodes, which may fill up to just under the top of the band; a dense unit too heavy for
    any node's room is split in place (splits move no bytes) and its halves move later.
    Then every node still below the band is filled from the nodes furthest above their
    share."""
    band = settings.tolerance
    top, aim = 1 + band * 0.9, band * 0.9
    load = dict(held)
    on_node: dict[str, list[UnitState]] = defaultdict(list)
    for unit in units:
        on_node[unit.node].append(unit)
    for node, node_units in on_node.items():  # densest first: most load per byte moved
        ranked = sorted((-weight(u, node) / max(u.bytes, 1), i) for i, u in enumerate(node_units))
        on_node[node] = [node_units[i] for _, i in ranked]
    nodes = [n for n in capacity if share[n] > 0]
    actions: list[Action] = []

    def ratio(node: str) -> float:
        return load[node] / share[node]

    def move(unit: UnitState, src: str, dst: str) -> None:
        on_node[src].remove(unit)
        load[src] -= weight(unit, src)
        load[dst] += weight(unit, dst)
        room.move(unit, src, dst)
        actions.append(Move(unit.unit_id, dst, unit.bytes, f"{src} out of balance"))

    def splittable(unit: UnitState) -> bool:
        return unit.hi - unit.lo >= 2 and unit.bytes >= 2 * settings.min_unit_bytes

    sinks = [(ratio(n), n) for n in nodes]
    heapq.heapify(sinks)

    def sink_for(unit: UnitState, exclude: str) -> str | None:
        """The least loaded node (by load/capacity) with room for ``unit``; a node of
        small capacity may have too little room even when it is the least loaded."""
        skipped: list[tuple[float, str]] = []
        found = None
        while sinks and len(skipped) < SINK_SEARCH:
            current, node = heapq.heappop(sinks)
            if current != ratio(node):
                heapq.heappush(sinks, (ratio(node), node))  # stale entry: refresh it
                continue
            skipped.append((current, node))
            has_room = share[node] * top - load[node] >= weight(unit, node)
            if node != exclude and has_room and room.fits(unit, node):
                found = node
                break
        for entry in skipped:
            heapq.heappush(sinks, entry)
        return found

    over = sorted(
        (n for n in nodes if (n in hot or ratio(n) > 1 + band) and n not in waiting),
        key=lambda n: -ratio(n),
    )
    for src in over:
        goal = share[src] * (1 if src in hot else 1 + aim)
        floor = share[src] * (1 - band)
        for unit in list(on_node[src]):
            if load[src] <= goal or len(actions) >= budget:
                break
            excess = load[src] - goal
            here = weight(unit, src)
            # a hot node needs relief now, whatever it costs in bytes
            overshoot = src not in hot and here > OVERSHOOT * excess
            if overshoot and here > 8 * excess:
                continue  # far too big for the little left to shed: a lighter unit will do
            fits = here <= load[src] - floor and not (overshoot and splittable(unit))
            dst = sink_for(unit, src) if fits else None
            if dst is not None:
                move(unit, src, dst)
            elif splittable(unit):
                # split the dense unit and move its halves next round, rather than now
                # shedding sparser units that carry less load per byte
                actions.append(Split(unit.unit_id, "too heavy to place whole"))
                on_node[src].remove(unit)
                break

    if any(ratio(n) > 1 + band for n in nodes):
        # load is still coming from nodes over the band (some wait for splits): taking it
        # from nodes within the band now would move it twice
        return actions, {n: ratio(n) for n in nodes}
    for dst in sorted((n for n in nodes if ratio(n) < 1 - band), key=ratio):
        goal = share[dst] * (1 - aim)
        donors = sorted(
            (n for n in nodes if ratio(n) > 1 and n != dst and n not in waiting),
            key=lambda n: -ratio(n),
        )
        for src in donors:
            if load[dst] >= goal or len(actions) >= budget:
                break
            for unit in list(on_node[src]):
                spare = load[src] - share[src] * (1 - aim)
                if load[dst] >= goal or len(actions) >= budget or spare <= 0:
                    break
                space = share[dst] * top - load[dst]
                if (
                    weight(unit, dst) <= space
                    and weight(unit, src) <= spare
                    and room.fits(unit, dst)
                ):
                    move(unit, src, dst)
    projected = {n: ratio(n) for n in nodes}
    return actions, projected
