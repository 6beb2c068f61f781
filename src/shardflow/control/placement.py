"""Capacity-weighted placement of units onto nodes."""

from __future__ import annotations

from collections.abc import Mapping


def place_units(
    count: int,
    capacities: Mapping[str, float],
    current: Mapping[str, float] | None = None,
) -> list[str]:
    """Owners for ``count`` new units of equal weight.

    Greedy: each unit goes to the node whose load per unit of capacity would be lowest after
    taking it, so a node with half the capacity ends up with about half the units. Ties go
    to the node named first, which makes the result deterministic.
    """
    if not capacities:
        raise ValueError("no nodes to place units on")
    load = {node: float((current or {}).get(node, 0.0)) for node in capacities}
    owners = []
    for _ in range(count):
        node = min(
            capacities,
            key=lambda n: ((load[n] + 1.0) / max(capacities[n], 1e-9), n),
        )
        load[node] += 1.0
        owners.append(node)
    return owners
