"""The balancer on a simulated large cluster: 1,000 nodes of mixed capacity, 100,000 units,
skewed load that shifts between rounds. Prints the time per balancing decision, the rounds
it takes to bring every node within the tolerance, and the bytes moved relative to the
minimum any mover would need; the last line is the bytes ratio.

    python bench/balancer_sim.py --nodes 1000 --units 100000

``--trace diurnal`` instead plays days of a daily cycle with unforeseen spikes on a smaller
cluster, once with the reactive balancer and once deciding ahead on forecasts
(``shardflow.control.forecast``), and prints the node-seconds spent above the utilisation
threshold and the bytes moved by each; the last line is
``overload_node_s predictive=P reactive=R bytes predictive=X reactive=Y``.

    python bench/balancer_sim.py --trace diurnal --days 8
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace

from shardflow.control.balancer import (
    BalancerSettings,
    Merge,
    Move,
    NodeState,
    Split,
    UnitState,
    plan,
)
from shardflow.control.forecast import ForecastSettings, LoadHistory, plan_ahead


def make_cluster(nodes: int, units: int, seed: int) -> tuple[list[NodeState], list[UnitState]]:
    rng = random.Random(seed)
    capacities = [rng.choice([0.5, 1.0, 1.0, 2.0]) for _ in range(nodes)]
    cluster = [NodeState(f"node-{i}", c) for i, c in enumerate(capacities)]
    # initial placement proportional to capacity, as the placement policy does it
    weights = [c / sum(capacities) for c in capacities]
    owners = rng.choices(range(nodes), weights=weights, k=units)
    placed = [
        UnitState(i, f"g{i % 50}", f"node-{owners[i]}", 0, 1 << 20, rng.randint(64, 512) << 20)
        for i in range(units)
    ]
    return cluster, skew(placed, rng, hot_fraction=0.05)


def skew(units: list[UnitState], rng: random.Random, hot_fraction: float) -> list[UnitState]:
    """Zipf-like load: a few hot units carry much of it."""
    out = []
    for unit in units:
        load = rng.paretovariate(2.0) * 0.01
        if rng.random() < hot_fraction:
            load *= 5
        out.append(replace(unit, load=load))
    return out


def spread(nodes: list[NodeState], units: list[UnitState]) -> float:
    held: dict[str, float] = defaultdict(float)
    for unit in units:
        held[unit.node] += unit.load
    total = sum(held.values())
    cap = sum(n.capacity for n in nodes)
    return max(abs(held[n.node] / (total * n.capacity / cap) - 1) for n in nodes)


def minimum_bytes(nodes: list[NodeState], units: list[UnitState], tolerance: float) -> float:
    """A lower bound on the bytes any balancer must move: every node above its band sheds
    its excess with its units of the most load per byte, fractionally; and every node below
    its band is filled with the densest units there are, fractionally. The larger of the
    two."""
    held: dict[str, float] = defaultdict(float)
    by_node: dict[str, list[UnitState]] = defaultdict(list)
    for unit in units:
        held[unit.node] += unit.load
        by_node[unit.node].append(unit)
    total = sum(held.values())
    cap = sum(n.capacity for n in nodes)
    shed = 0.0
    deficit = 0.0
    for node in nodes:
        fair = total * node.capacity / cap
        excess = held[node.node] - fair * (1 + tolerance)
        deficit += max(0.0, fair * (1 - tolerance) - held[node.node])
        for unit in sorted(by_node[node.node], key=lambda u: -u.load / u.bytes):
            if excess <= 0:
                break
            take = min(1.0, excess / unit.load) if unit.load else 0.0
            shed += take * unit.bytes
            excess -= unit.load * take
    fill = 0.0
    for unit in sorted(units, key=lambda u: -u.load / u.bytes):
        if deficit <= 0:
            break
        take = min(1.0, deficit / unit.load) if unit.load else 0.0
        fill += take * unit.bytes
        deficit -= unit.load * take
    return max(shed, fill)


def apply(
    units: list[UnitState], actions: tuple[object, ...], next_id: int
) -> tuple[list[UnitState], int, int]:
    by_id = {u.unit_id: u for u in units}
    moved = 0
    for action in actions:
        if isinstance(action, Move):
            unit = by_id[action.unit_id]
            by_id[action.unit_id] = replace(unit, node=action.to)
            moved += unit.bytes
        elif isinstance(action, Split):
            unit = by_id.pop(action.unit_id)
            mid = (unit.lo + unit.hi) // 2
            for lo, hi in ((unit.lo, mid), (mid, unit.hi)):
                by_id[next_id] = replace(
                    unit, unit_id=next_id, lo=lo, hi=hi, bytes=unit.bytes // 2, load=unit.load / 2
                )
                next_id += 1
        elif isinstance(action, Merge):
            a, b = by_id.pop(action.first), by_id.pop(action.second)
            by_id[next_id] = replace(
                a, unit_id=next_id, hi=b.hi, bytes=a.bytes + b.bytes, load=a.load + b.load
            )
            next_id += 1
    return list(by_id.values()), next_id, moved


DAY_S = 86_400.0
TENANT_PEAKS_H = (2.0, 8.0, 14.0, 20.0)
"""Each unit belongs to a tenant whose working day is centred on one of these hours (give or
take); its load is 10 % of its day's outside them."""
WORK_HALF_H = 4.0
RAMP_H = 0.5


@dataclass(frozen=True)
class DiurnalUnit:
    unit_id: int
    bytes: int
    base: float
    peak_h: float


def diurnal_trace(
    nodes: int, units: int, days: int, seed: int, peak: float = 0.7, spikes_per_day: float = 8.0
) -> tuple[list[NodeState], list[DiurnalUnit], Callable[[int, float], float], dict[int, str]]:
    """Nodes of mixed capacity; units whose load follows their tenant's working day, with
    day-to-day noise (+-10 %) and unforeseen spikes (3x for 45 minutes, ``spikes_per_day``
    over the cluster); a first placement by bytes and capacity, blind to load, as a new
    cluster's. Scaled so the busiest moment of the whole cluster is ``peak`` of its
    capacity: balanced, no node need pass the 80 % threshold but for spikes."""
    rng = random.Random(seed)
    cluster = [NodeState(f"node-{i}", rng.choice([0.5, 1.0, 1.0, 2.0])) for i in range(nodes)]
    made = [
        DiurnalUnit(
            i,
            rng.randint(512, 4096) << 20,
            rng.lognormvariate(0.0, 0.5),
            rng.choice(TENANT_PEAKS_H) + rng.gauss(0.0, 1.0),
        )
        for i in range(units)
    ]
    noise = {(u.unit_id, d): rng.uniform(0.9, 1.1) for u in made for d in range(days + 1)}
    spikes: dict[int, list[float]] = defaultdict(list)
    every = units * DAY_S / spikes_per_day if spikes_per_day > 0 else math.inf
    for unit in made:
        t = rng.expovariate(1 / every)
        while t < days * DAY_S:
            spikes[unit.unit_id].append(t)
            t += rng.expovariate(1 / every)

    def shape(unit: DiurnalUnit, t: float) -> float:
        hour = (t % DAY_S) / 3600
        away = min(abs(hour - unit.peak_h) % 24, 24 - abs(hour - unit.peak_h) % 24)
        # the tenant's working hours: 8 hours around its peak, reached in half an hour
        ramp = min(1.0, max(0.0, (WORK_HALF_H + RAMP_H - away) / RAMP_H))
        return unit.base * (0.1 + 0.9 * ramp)

    by_id = {u.unit_id: u for u in made}
    busiest = max(sum(shape(u, h * 900.0) for u in made) for h in range(96))
    scale = peak * sum(n.capacity for n in cluster) / busiest

    def load(unit_id: int, t: float) -> float:
        unit = by_id[unit_id]
        spiking = any(start <= t < start + 2700 for start in spikes[unit_id])
        value = shape(unit, t) * noise[(unit_id, int(t // DAY_S))] * scale
        return value * (3.0 if spiking else 1.0)

    capacity = sum(n.capacity for n in cluster)
    owners = rng.choices(range(nodes), weights=[n.capacity / capacity for n in cluster], k=units)
    placement = {u.unit_id: cluster[owners[u.unit_id]].node for u in made}
    return cluster, made, load, placement


def play(
    predictive: bool,
    nodes: list[NodeState],
    units: list[DiurnalUnit],
    load: Callable[[int, float], float],
    start: dict[int, str],
    days: int,
    step_s: float,
    move_s_per_gb: float,
    settings: BalancerSettings,
) -> tuple[list[float], int, int]:
    """Play the trace with one balancer as the coordinator runs it (a decision every
    ``step_s`` acted on when it asks for moves twice in a row, its moves carried out before
    the next decision; a unit's load stays on its source until its move is done). Returns
    the node-seconds above the utilisation threshold each day, the bytes and the number of
    moves."""
    placement = dict(start)
    capacity = {n.node: n.capacity for n in nodes}
    history = LoadHistory(ForecastSettings())
    busy_until = 0.0
    pending: list[Move] = []
    unbalanced = 0
    overload_s = [0.0] * days
    moved_bytes = moves = 0
    previous: float | None = None
    t = 0.0
    while t < days * DAY_S:
        loads = {u.unit_id: load(u.unit_id, t) for u in units}
        held: dict[str, float] = defaultdict(float)
        for unit_id, value in loads.items():
            held[placement[unit_id]] += value
        utilization = {n: held[n] / capacity[n] for n in capacity}
        over = sum(u > settings.utilization_threshold for u in utilization.values())
        overload_s[int(t // DAY_S)] += step_s * over
        history.observe(t, loads)
        if pending and t >= busy_until:
            for move in pending:
                placement[move.unit_id] = move.to
            pending = []
        if not pending:
            observed = [NodeState(n.node, n.capacity, utilization[n.node]) for n in nodes]
            states = [
                UnitState(u.unit_id, f"u{u.unit_id}", placement[u.unit_id], 0, 1, u.bytes,
                          loads[u.unit_id])
                for u in units
            ]  # fmt: skip
            if predictive:
                pace = move_s_per_gb / 2**30  # what the controller measures from its moves
                decision = plan_ahead(
                    observed, states, history, t, settings, previous, move_s_per_byte=pace
                )
            else:
                decision = plan(observed, states, settings, previous)
            previous = decision.total_load
            chosen = [a for a in decision.actions if isinstance(a, Move)]
            unbalanced = unbalanced + 1 if chosen else 0
            if chosen and unbalanced >= 2:
                pending, unbalanced = chosen, 0
                busy_until = t + max(m.bytes for m in chosen) / 2**30 * move_s_per_gb
                moved_bytes += sum(m.bytes for m in chosen)
                moves += len(chosen)
        t += step_s
    return overload_s, moved_bytes, moves


def diurnal(args: argparse.Namespace) -> None:
    nodes, units, load, placement = diurnal_trace(
        args.nodes, args.units, args.days, args.seed, args.peak, args.spikes_per_day
    )
    settings = BalancerSettings(max_moves=4, max_unit_bytes=1 << 50, min_unit_bytes=1)
    print(
        f"{len(nodes)} nodes, {len(units)} units, {args.days} day(s) of a daily cycle peaking at "
        f"{args.peak:.0%} of the cluster, {args.spikes_per_day:g} spikes a day; a decision "
        f"every {args.step_s:.0f} s, moves at {args.move_s_per_gb:.0f} s/GB"
    )
    results = {}
    learnt: dict[str, float] = {}
    for name in ("reactive", "predictive"):
        started = time.perf_counter()
        overload, moved, count = play(
            name == "predictive", nodes, units, load, placement, args.days, args.step_s,
            args.move_s_per_gb, settings,
        )  # fmt: skip
        results[name] = (sum(overload), moved)
        learnt[name] = sum(overload[1:])
        print(
            f"{name:>10}: {sum(overload):,.0f} node-seconds above "
            f"{settings.utilization_threshold:.0%} (by day: "
            + ", ".join(f"{s:,.0f}" for s in overload)
            + f"), {count} moves, {moved / 2**30:.1f} GiB moved "
            f"({time.perf_counter() - started:.1f} s to simulate)"
        )
    (p, x), (r, y) = results["predictive"], results["reactive"]
    print(
        f"after the first day (the forecast learns from it): predictive "
        f"{learnt['predictive']:,.0f} node-seconds, reactive {learnt['reactive']:,.0f}"
    )
    print(f"overload_node_s predictive={p:.0f} reactive={r:.0f} bytes predictive={x} reactive={y}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", choices=["shifts", "diurnal"], default="shifts")
    parser.add_argument("--nodes", type=int, default=None, help="1000; 16 for --trace diurnal")
    parser.add_argument("--units", type=int, default=None, help="100000; 320 for diurnal")
    parser.add_argument("--moves-per-round", type=int, default=2000)
    parser.add_argument("--shifts", type=int, default=3, help="load shifts to re-balance after")
    parser.add_argument("--days", type=int, default=8, help="days to play (--trace diurnal)")
    parser.add_argument("--peak", type=float, default=0.7, help="busiest cluster utilisation")
    parser.add_argument(
        "--spikes-per-day", type=float, default=8.0, help="unforeseen spikes, cluster-wide"
    )
    parser.add_argument("--step-s", type=float, default=300.0, help="seconds between decisions")
    parser.add_argument("--move-s-per-gb", type=float, default=120.0, help="a move's pace")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    if args.trace == "diurnal":
        args.nodes = args.nodes or 16
        args.units = args.units or 320
        diurnal(args)
        return
    args.nodes = args.nodes or 1000
    args.units = args.units or 100_000

    nodes, units = make_cluster(args.nodes, args.units, args.seed)
    settings = BalancerSettings(
        max_moves=args.moves_per_round, max_unit_bytes=1 << 40, min_unit_bytes=1 << 20
    )
    rng = random.Random(args.seed + 1)
    decision_times: list[float] = []
    rounds_to_converge: list[int] = []
    ratios: list[float] = []
    next_id = args.units
    for shift in range(args.shifts + 1):
        if shift:
            units = skew(units, rng, hot_fraction=0.05)  # the load moves elsewhere
        start_spread = spread(nodes, units)
        floor = minimum_bytes(nodes, units, settings.tolerance)
        moved_bytes = 0
        rounds = 0
        while spread(nodes, units) > settings.tolerance and rounds < 50:
            started = time.perf_counter()
            decision = plan(nodes, units, settings)
            decision_times.append(time.perf_counter() - started)
            if not decision.actions:
                break
            units, next_id, moved = apply(units, decision.actions, next_id)
            moved_bytes += moved
            rounds += 1
        rounds_to_converge.append(rounds)
        ratio = moved_bytes / floor if floor else 1.0
        ratios.append(ratio)
        print(
            f"load shift {shift}: spread {start_spread:.2f} -> {spread(nodes, units):.3f} in "
            f"{rounds} round(s); moved {moved_bytes / 2**30:.1f} GiB, minimum "
            f"{floor / 2**30:.1f} GiB (x{ratio:.2f})"
        )
    mean_ms = statistics.fmean(decision_times) * 1000
    print(
        f"{args.nodes} nodes, {len(units)} units: decision time mean {mean_ms:.0f} ms, "
        f"max {max(decision_times) * 1000:.0f} ms; rounds to converge {rounds_to_converge}"
    )
    print(f"bytes moved / minimum needed: {max(ratios):.2f}")


if __name__ == "__main__":
    main()
