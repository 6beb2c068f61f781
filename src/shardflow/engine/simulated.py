"""A simulated slower device, for tests and demos: it really takes longer."""

from __future__ import annotations

import time
from collections.abc import Mapping

import pyarrow as pa

from shardflow.engine.base import Engine


class SlowedEngine:
    """Runs every query on ``engine``, then waits ``slowdown - 1`` times as long again, so a
    node with ``slowdown=2`` does half the work per second, in calibration as in queries.
    Profiles label such a node as simulated wherever it shows."""

    def __init__(self, engine: Engine, slowdown: float) -> None:
        self.engine = engine
        self.slowdown = slowdown
        self.name = f"{engine.name} (simulated x{slowdown:g} slower)"

    def run(
        self,
        sql: str,
        tables: Mapping[str, pa.Table] | None = None,
        views: Mapping[str, str] | None = None,
    ) -> pa.Table:
        started = time.perf_counter()
        result = self.engine.run(sql, tables, views)
        time.sleep((time.perf_counter() - started) * (self.slowdown - 1))
        return result
