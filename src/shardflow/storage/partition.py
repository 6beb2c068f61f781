"""Cutting rows into the units (bucket ranges) that own them."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pyarrow as pa

from shardflow.catalog import Catalog, TableSpec
from shardflow.catalog.buckets import bucket_of

_round_robin_start = itertools.count()

ROUND_ROBIN_LANES = 4096
"""Rows of a table without a key are dealt to this many evenly spaced buckets in turn."""


def buckets_for(
    table: pa.Table, spec: TableSpec, n_buckets: int, salt: int | None = None
) -> np.ndarray:
    """The bucket of every row: the hashed key, or round-robin for tables without a key
    (starting where ``salt`` says, so that a retried insert lands in the same buckets)."""
    if spec.key:
        return bucket_of(table.column(spec.key), n_buckets)
    start = (salt if salt is not None else next(_round_robin_start)) * 7919
    turn = np.arange(table.num_rows, dtype=np.int64) + start
    # consecutive rows go to buckets spread over the whole range (so over every unit),
    # however many buckets there are: a turn of ``lanes`` rows visits each lane once
    lanes = min(n_buckets, ROUND_ROBIN_LANES)
    lane_width = n_buckets // lanes
    return ((turn % lanes) * lane_width + (turn // lanes) % lane_width).astype(np.int32)


def route(
    table: pa.Table, buckets: np.ndarray, catalog: Catalog, group_id: str
) -> dict[int, tuple[pa.Table, np.ndarray]]:
    """Rows (and their buckets) grouped by the unit of ``group_id`` that owns them."""
    if table.num_rows == 0:
        return {}
    units = catalog.groups[group_id].owners_of(buckets)
    order = np.argsort(units, kind="stable")
    sorted_units = units[order]
    cut = np.flatnonzero(np.diff(sorted_units)) + 1
    starts = np.concatenate(([0], cut))
    ends = np.concatenate((cut, [len(sorted_units)]))
    arranged = table.take(pa.array(order))
    arranged_buckets = buckets[order]
    return {
        int(sorted_units[start]): (
            arranged.slice(start, end - start),
            arranged_buckets[start:end],
        )
        for start, end in zip(starts, ends, strict=True)
    }


BATCH_UNITS = b"shardflow.batch_units"
"""Schema metadata of an insert's part: the units the whole batch was routed to in the
attempt that placed it (JSON list). Kept in the part's log entry, so that a backup can tell
a batch it holds in part (``storage/backup.py``)."""


def tagged_with_units(
    parts: dict[int, tuple[pa.Table, np.ndarray]],
) -> dict[int, tuple[pa.Table, np.ndarray]]:
    """``parts`` (from :func:`route`), each naming every unit of the batch."""
    units = json.dumps(sorted(parts)).encode()
    return {
        unit: (rows.replace_schema_metadata({**(rows.schema.metadata or {}), BATCH_UNITS: units}),
               buckets)
        for unit, (rows, buckets) in parts.items()
    }  # fmt: skip


def batch_units(schema: pa.Schema) -> list[int] | None:
    """The units an entry's batch was routed to (None: not said, e.g. a move's catch-up)."""
    found = (schema.metadata or {}).get(BATCH_UNITS)
    return None if found is None else [int(u) for u in json.loads(found)]


def split_by_unit(table: pa.Table, spec: TableSpec, catalog: Catalog) -> dict[int, pa.Table]:
    """The rows of ``table`` grouped by the unit that owns them (units with no rows omitted)."""
    assert spec.group is not None
    buckets = buckets_for(table, spec, catalog.n_buckets)
    return {unit: rows for unit, (rows, _) in route(table, buckets, catalog, spec.group).items()}
