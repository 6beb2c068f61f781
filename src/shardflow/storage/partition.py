"""Cutting rows into the units (bucket ranges) that own them."""

from __future__ import annotations

import itertools

import numpy as np
import pyarrow as pa

from shardflow.catalog import Catalog, TableSpec
from shardflow.catalog.buckets import bucket_of

_round_robin_start = itertools.count()


def buckets_for(table: pa.Table, spec: TableSpec, n_buckets: int) -> np.ndarray:
    """The bucket of every row: the hashed key, or round-robin for tables without a key."""
    if spec.key:
        return bucket_of(table.column(spec.key), n_buckets)
    start = next(_round_robin_start) * 7919  # spread successive small inserts over buckets
    return ((np.arange(table.num_rows, dtype=np.int64) + start) % n_buckets).astype(np.int32)


def split_by_unit(table: pa.Table, spec: TableSpec, catalog: Catalog) -> dict[int, pa.Table]:
    """The rows of ``table`` grouped by the unit that owns them (units with no rows omitted)."""
    group = catalog.group_of(spec.name)
    owners = np.asarray(group.bucket_owners(catalog.n_buckets), dtype=np.int64)
    units = owners[buckets_for(table, spec, catalog.n_buckets)]
    if table.num_rows == 0:
        return {}
    order = np.argsort(units, kind="stable")
    sorted_units = units[order]
    cut = np.flatnonzero(np.diff(sorted_units)) + 1
    starts = np.concatenate(([0], cut))
    ends = np.concatenate((cut, [len(sorted_units)]))
    arranged = table.take(pa.array(order))
    return {
        int(sorted_units[start]): arranged.slice(start, end - start)
        for start, end in zip(starts, ends, strict=True)
    }
