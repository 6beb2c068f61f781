"""What every engine offers: SQL over named Arrow tables (and per-call views)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import pyarrow as pa


class Engine(Protocol):
    name: str

    def run(
        self,
        sql: str,
        tables: Mapping[str, pa.Table] | None = None,
        views: Mapping[str, str] | None = None,
    ) -> pa.Table:
        """Execute ``sql``; each of ``tables`` is visible under its name, and each of
        ``views`` (name -> SELECT over the node's shards) for this call only."""
        ...
