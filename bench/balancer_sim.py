"""The balancer on a simulated large cluster: 1,000 nodes of mixed capacity, 100,000 units,
skewed load that shifts between rounds. Prints the time per balancing decision, the rounds
it takes to bring every node within the tolerance, and the bytes moved relative to the
minimum any mover would need; the last line is the bytes ratio.

    python bench/balancer_sim.py --nodes 1000 --units 100000
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict
from dataclasses import replace

from shardflow.control.balancer import (
    BalancerSettings,
    Merge,
    Move,
    NodeState,
    Split,
    UnitState,
    plan,
)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--units", type=int, default=100_000)
    parser.add_argument("--moves-per-round", type=int, default=2000)
    parser.add_argument("--shifts", type=int, default=3, help="load shifts to re-balance after")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()

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
