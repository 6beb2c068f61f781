"""Sorted parts interleaved as they arrive (a :class:`~shardflow.sql.merges.SortedMerge`):
each part comes sorted by the merge's keys, a batch at a time, and the answer goes out in
order without waiting for any part's end.

The rows held (at most a batch or so per part) are sorted together; every row that sorts
before or with the *frontier* goes out: the first, in that order, of the last rows held of
the parts still arriving (a part's later rows sort after its last one, so no row still to
come can sort before the frontier). The part whose last row was the frontier is then empty
and sends its next batch. Ties go out in either order (SQL leaves them unordered). The
order is DuckDB's: for each key, its NULLs first or last as the key says, and a float's
NaN above every number (so last ascending, first descending), made explicit as keys of
their own, since Arrow's sort places NULLs and NaNs the same way for every key."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from shardflow.sql.merges import SortedMerge

_SORTABLE = (
    pa.types.is_integer, pa.types.is_floating, pa.types.is_decimal, pa.types.is_boolean,
    pa.types.is_string, pa.types.is_large_string, pa.types.is_binary,
    pa.types.is_large_binary, pa.types.is_date, pa.types.is_timestamp, pa.types.is_time,
    pa.types.is_duration,
)  # fmt: skip
"""Types Arrow sorts as DuckDB does (numbers, text and bytes by their bytes, times)."""


class UnsortableKey(Exception):
    """A key of another type (an interval, a list, a UUID, a view type): the answer is
    merged whole instead."""


class SortedParts:
    """The rows of ``parts`` (iterables of tables, each sorted by ``merge``'s keys) in the
    merge's order, its ``OFFSET`` skipped and its ``LIMIT`` kept, in tables of the
    partials' columns. A part is read only as far as the answer needs it."""

    def __init__(self, parts: Sequence[Iterable[pa.Table]], merge: SortedMerge) -> None:
        self.merge = merge
        self._parts = [iter(part) for part in parts]
        self._held: list[pa.Table | None] = [None] * len(parts)
        self._done = [False] * len(parts)

    def __iter__(self) -> Iterator[pa.Table]:
        skip = self.merge.offset
        left = self.merge.limit
        while left is None or left > 0:
            self._refill()
            live = [i for i, held in enumerate(self._held) if held is not None]
            if not live:
                return
            ready = self._next_ready(live)
            if skip:
                cut = min(skip, ready.num_rows)
                ready, skip = ready.slice(cut), skip - cut
            if left is not None:
                ready = ready.slice(0, left)
                left -= ready.num_rows
            if ready.num_rows:
                yield ready

    def _refill(self) -> None:
        """A batch for every part that holds no rows and may send more."""
        for i, part in enumerate(self._parts):
            while self._held[i] is None and not self._done[i]:
                table = next(part, None)
                if table is None:
                    self._done[i] = True
                elif table.num_rows:
                    self._held[i] = table

    def _next_ready(self, live: list[int]) -> pa.Table:
        """The held rows that sort up to the frontier, in order; the others stay held."""
        tables = [t for t in self._held if t is not None]  # the live parts', in order
        held = pa.concat_tables(tables, promote_options="permissive")
        sorting, keys = _sort_columns(held, self.merge)
        order = pc.sort_indices(sorting, sort_keys=keys).to_numpy()
        position = np.empty_like(order)
        position[order] = np.arange(len(order))
        ends = np.cumsum([t.num_rows for t in tables])
        lasts = [end - 1 for i, end in zip(live, ends, strict=True) if not self._done[i]]
        cut = int(position[lasts].min()) + 1 if lasts else len(order)
        for i, table, end in zip(live, tables, ends, strict=True):
            left = position[end - table.num_rows : end] >= cut
            self._held[i] = table.filter(pa.array(left)) if left.any() else None
        return held.take(pa.array(order[:cut]))


def _sort_columns(table: pa.Table, merge: SortedMerge) -> tuple[pa.Table, list[tuple[str, str]]]:
    """The keys as Arrow sorts them in DuckDB's order, and how: per key, whether it is
    NULL, then (floats) whether it is NaN, then its value."""
    columns: dict[str, pa.ChunkedArray] = {}
    keys: list[tuple[str, str]] = []
    for n, key in enumerate(merge.keys):
        values = table.column(key.column)
        kind = values.type
        if not any(check(kind) for check in _SORTABLE):
            raise UnsortableKey(f"{key.column} is {kind}")
        direction = "descending" if key.descending else "ascending"
        columns[f"null{n}"] = pc.is_null(values)
        keys.append((f"null{n}", "descending" if key.nulls_first else "ascending"))
        if pa.types.is_floating(kind):  # NaN is above every number
            columns[f"nan{n}"] = pc.fill_null(pc.is_nan(values), False)
            keys.append((f"nan{n}", direction))
        columns[f"value{n}"] = values
        keys.append((f"value{n}", direction))
    return pa.table(columns), keys
