"""Capacity-weighted placement of units onto nodes."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from shardflow.telemetry.calibration import capacity
from shardflow.telemetry.devices import NodeProfile, device_model

CAPACITY_NOISE = 0.10
"""Calibrated capacities within this fraction of the median node count as equal: workers
measured on the same hardware differ by noise, and placement should not chase it."""


def relative_capacities(
    raw: Mapping[str, float], models: Mapping[str, str] | None = None
) -> dict[str, float]:
    """Capacities relative to the median node, snapped to 1.0 within the noise. Nodes of
    one device model share the median of their measurements (a node that joined and
    calibrated while the others were busy is not taken for a slower one)."""
    if not raw:
        return {}
    if models:
        by_model: dict[str, list[float]] = {}
        for node, value in raw.items():
            by_model.setdefault(models.get(node, node), []).append(value)
        shared = {m: sorted(v)[len(v) // 2] for m, v in by_model.items()}
        raw = {node: shared[models.get(node, node)] for node in raw}
    median = sorted(raw.values())[len(raw) // 2] or 1.0
    relative = {node: value / median for node, value in raw.items()}
    return {n: 1.0 if abs(c - 1.0) <= CAPACITY_NOISE else round(c, 3) for n, c in relative.items()}


def node_capacities(
    nodes: Iterable[str],
    profiles: Mapping[str, NodeProfile],
    mix: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """Each node's capacity for work of operator ``mix`` (the cluster's recent load; none:
    all operators alike), relative to the median node: the weighted geometric mean of its
    calibrated throughputs. A node that has not reported a calibration counts as the
    reference machine. The one way capacity is computed: placement, the balancer and
    ``db.cluster.nodes()`` all use it."""
    raw: dict[str, float] = {}
    models: dict[str, str] = {}
    for node in nodes:
        profile = profiles.get(node)
        if profile is None:
            raw[node], models[node] = 1.0, node
            continue
        calibration = profile.calibration
        raw[node] = capacity(calibration, mix or None) if calibration else profile.capacity
        models[node] = device_model(profile)
    return relative_capacities(raw, models)


def initial_unit_count(
    per_worker: int, workers: int, size_bytes: int | None, unit_bytes: int
) -> int:
    """Units a new distributed table is cut into: ``per_worker`` for each worker, but no
    more than one per ``unit_bytes`` of a source whose size is known (and at least one;
    ``unit_bytes`` 0: the full count whatever the size).

    Every unit of a table costs each query over it a fragment's fixed cost (planning it in
    DuckDB, sending it, merging its answer): for a small table that outweighs the scan the
    units share, and the balancer would merge such units when cold anyway (it splits a unit
    that grows big or hot). A source of unknown size (a stream) or an empty one, a table
    made to be filled by inserts, gets the full count."""
    full = per_worker * workers
    if not size_bytes or size_bytes < 0 or unit_bytes <= 0:
        return full
    return int(max(1, min(full, -(-size_bytes // unit_bytes))))


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
