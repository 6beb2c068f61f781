"""The cost model: how much work a unit's load is, and what it costs on each node.

Workers measure execution seconds per unit and per calibrated operator on their own device.
The balancer keeps a unit's load in *reference seconds*, those of the cluster's median node:
seconds measured on node n count ``capacity_for(speeds[n], mix)`` times, where ``mix`` is
the unit's own operator mix. So a unit keeps its weight when it moves, and a slow node's
long seconds are not counted against its small capacity a second time. Placed on node n,
the unit costs its load divided by n's capacity for that mix: a node 15 % slower at joins
pays 1/0.85 for a join-only unit and nothing extra for a scan-only one, so it is given
proportionally less join-heavy load.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from shardflow.control.placement import relative_capacities

Speeds = Mapping[str, float]
"""A node's throughput per calibrated operator relative to the median node (1.0: as fast)."""


def relative_speeds(
    calibrations: Mapping[str, Mapping[str, float]], models: Mapping[str, str] | None = None
) -> dict[str, dict[str, float]]:
    """Per node, each operator's throughput relative to the median node's, with the noise
    handling of :func:`relative_capacities` (nodes of one model share their median; within
    the noise counts as equal). Nodes without a calibration get no speeds."""
    calibrated = {node: c for node, c in calibrations.items() if c}
    speeds: dict[str, dict[str, float]] = {node: {} for node in calibrations}
    operators = sorted({op for c in calibrated.values() for op in c})
    for operator in operators:
        measured = {n: c[operator] for n, c in calibrated.items() if c.get(operator, 0) > 0}
        for node, speed in relative_capacities(measured, models).items():
            speeds[node][operator] = speed
    return speeds


def capacity_for(speeds: Speeds, mix: Mapping[str, float] | None = None) -> float:
    """A node's capacity for work of operator ``mix`` (any non-negative weights; none: all
    operators alike): the weighted geometric mean of its speeds. 1.0 without speeds."""
    weights = {op: (mix or {}).get(op, 0.0) if mix else 1.0 for op in speeds}
    total = sum(weights.values())
    if total <= 0:
        return 1.0
    log_sum = sum(w * math.log(max(speeds[op], 1e-9)) for op, w in weights.items() if w > 0)
    return math.exp(log_sum / total)


def reference_load(op_seconds: Mapping[str, float], speeds: Speeds) -> float:
    """Seconds of execution measured on a node with ``speeds``, split by operator, as the
    median node's seconds."""
    return sum(op_seconds.values()) * capacity_for(speeds, op_seconds)
