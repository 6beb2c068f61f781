"""Calibration: a short micro-benchmark a worker runs when it joins, and what it makes of it.

Four operators run over generated Arrow data with the worker's own engine: scan + filter,
hash aggregate, hash join, sort. Each yields rows per second. A node's capacity for a mix of
operators is the weighted geometric mean of its throughput relative to the reference
throughput below (a single DuckDB thread on the development machine), so a node twice as
fast at everything has capacity 2.0, and one 15 % slower at joins has less capacity for
join-heavy work than for scans.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping

import numpy as np
import pyarrow as pa

OPERATORS = ("scan_filter", "hash_aggregate", "hash_join", "sort")
REFERENCE_ROWS_PER_S: Mapping[str, float] = {
    "scan_filter": 400e6,
    "hash_aggregate": 100e6,
    "hash_join": 35e6,
    "sort": 12e6,
}
"""Rows per second of one DuckDB thread on the reference machine: capacity 1.0."""

QUERIES: Mapping[str, str] = {
    "scan_filter": "SELECT count(*), sum(v) FROM t WHERE v > 0.5",
    "hash_aggregate": "SELECT k % 4096 AS g, sum(v), count(*) FROM t GROUP BY g",
    "hash_join": "SELECT count(*), sum(u.w) FROM t JOIN u ON t.k = u.k",
    "sort": "SELECT sum(r) FROM (SELECT row_number() OVER (ORDER BY v) AS r FROM t)",
}

Run = Callable[[str, Mapping[str, pa.Table]], pa.Table]


def sample_tables(rows: int, seed: int = 7) -> dict[str, pa.Table]:
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, rows, rows)
    fact = pa.table({"k": keys, "v": rng.random(rows)})
    dimension = pa.table({"k": np.arange(rows // 4), "w": rng.random(rows // 4)})
    return {"t": fact, "u": dimension}


def calibrate(
    run: Run, rows: int = 1_000_000, seconds_per_operator: float = 0.1, repeat: int = 3
) -> dict[str, float]:
    """Rows per second per operator with ``run``: each operator runs again and again for
    ``seconds_per_operator`` (at least ``repeat`` times) and its fastest run counts, so a
    moment of contention from other processes on the machine does not make a node look
    slower than it is."""
    tables = sample_tables(rows)
    throughput = {}
    for operator, sql in QUERIES.items():
        best = math.inf
        spent = 0.0
        runs = 0
        while runs < repeat or spent < seconds_per_operator:
            started = time.perf_counter()
            run(sql, tables)
            elapsed = time.perf_counter() - started
            best = min(best, elapsed)
            spent += elapsed
            runs += 1
        throughput[operator] = rows / max(best, 1e-9)
    return throughput


def best_of(repeat: int, run: Callable[[], object]) -> float:
    """The fastest of ``repeat`` runs of ``run``, in seconds."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def capacity(throughput: Mapping[str, float], mix: Mapping[str, float] | None = None) -> float:
    """Weighted geometric mean of throughput relative to the reference; ``mix`` weighs the
    operators (by default equally)."""
    weights = {op: (mix or {}).get(op, 0.0 if mix else 1.0) for op in OPERATORS}
    total = sum(weights.values())
    if total <= 0 or not throughput:
        return 1.0
    log_sum = sum(
        weight * math.log(max(throughput.get(op, 0.0), 1e-9) / REFERENCE_ROWS_PER_S[op])
        for op, weight in weights.items()
        if weight > 0
    )
    return math.exp(log_sum / total)


def operator_mix(sql: str) -> tuple[str, ...]:
    """The calibrated operators a SQL text uses (a cheap look at its keywords: enough to
    weigh a fragment's load, not a plan)."""
    text = sql.upper()
    found = ["scan_filter"]
    if " JOIN " in text or ("FROM" in text and "," in text.split("FROM", 1)[1].split("WHERE")[0]):
        found.append("hash_join")
    if "GROUP BY" in text or any(f"{a}(" in text for a in ("SUM", "COUNT", "AVG", "MIN", "MAX")):
        found.append("hash_aggregate")
    if "ORDER BY" in text:
        found.append("sort")
    return tuple(found)
