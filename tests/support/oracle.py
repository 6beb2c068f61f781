"""Compare a query result of the system under test with the DuckDB oracle's result.

Public API:

* :func:`assert_same_result` -- cell-by-cell comparison of two Arrow tables, tolerant of
  numeric type differences (DOUBLE vs DECIMAL, HUGEINT/DECIMAL(38,0) vs BIGINT), with three
  ordering modes: unordered (multiset), strictly ordered, ordered except within ties of the
  ORDER BY keys (``sort_keys``).
* :func:`order_insensitive_within_ties` -- shorthand for the ``sort_keys`` mode.
* :func:`query_is_ordered` -- does the outermost query have an ORDER BY?
* :func:`sort_key_indexes` -- best-effort mapping of the outer ORDER BY items to output
  column indexes, suitable for ``sort_keys``.
* :func:`assert_same_values` -- sqllogictest's ``valuesort``: equal multisets of cells.
* :func:`assert_limited_result` -- a LIMIT/OFFSET answer, where rows tying at the cut (or
  every row, without ORDER BY) may be any rows of the answer without the LIMIT.
"""

from __future__ import annotations

import datetime as _dt
import decimal
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import sqlglot
from sqlglot import exp

__all__ = [
    "assert_limited_result",
    "assert_same_result",
    "assert_same_values",
    "cells_equal",
    "order_insensitive_within_ties",
    "query_is_ordered",
    "sort_key_indexes",
]

Row = tuple[Any, ...]

_PREVIEW_ROWS = 5
# Most rows left unpaired by the sorted merge that are still matched pairwise (quadratic).
_FALLBACK_MATCH_LIMIT = 2000


# --------------------------------------------------------------------------------------
# cell comparison


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float | decimal.Decimal) and not isinstance(v, bool)


def _is_nan(v: Any) -> bool:
    if isinstance(v, float):
        return math.isnan(v)
    if isinstance(v, decimal.Decimal):
        return v.is_nan()
    return False


def cells_equal(a: Any, b: Any, *, rel_tol: float = 1e-9, abs_tol: float = 1e-6) -> bool:
    """Compare two Python cell values (as produced by ``to_pylist``).

    None only equals None; NaN equals NaN; numbers compare numerically (with tolerance when
    either side is a float, exactly otherwise); everything else must be equal and of a
    compatible type (bool is never a number, a date never equals a datetime).
    """
    if a is None or b is None:
        return a is None and b is None
    if _is_number(a) and _is_number(b):
        a_nan, b_nan = _is_nan(a), _is_nan(b)
        if a_nan or b_nan:
            return a_nan and b_nan
        if isinstance(a, float) or isinstance(b, float):
            fa, fb = float(a), float(b)
            if math.isinf(fa) or math.isinf(fb):
                return fa == fb
            return math.isclose(fa, fb, rel_tol=rel_tol, abs_tol=abs_tol)
        return bool(a == b)  # int / Decimal: exact
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, _dt.datetime) or isinstance(b, _dt.datetime):
        return isinstance(a, _dt.datetime) and isinstance(b, _dt.datetime) and a == b
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(
            cells_equal(x, y, rel_tol=rel_tol, abs_tol=abs_tol) for x, y in zip(a, b, strict=True)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(
            cells_equal(a[k], b[k], rel_tol=rel_tol, abs_tol=abs_tol) for k in a
        )
    if type(a) is not type(b) and not (isinstance(a, str) and isinstance(b, str)):
        return False
    return bool(a == b)


def _rows_equal(a: Row, b: Row, rel_tol: float, abs_tol: float) -> bool:
    return len(a) == len(b) and all(
        cells_equal(x, y, rel_tol=rel_tol, abs_tol=abs_tol) for x, y in zip(a, b, strict=True)
    )


# --------------------------------------------------------------------------------------
# sort keys for multiset comparison

_RANK_BOOL, _RANK_NUM, _RANK_STR, _RANK_BYTES = 0, 1, 2, 3
_RANK_DATE, _RANK_DATETIME, _RANK_TIME, _RANK_DELTA = 4, 5, 6, 7
_RANK_LIST, _RANK_DICT, _RANK_OTHER = 8, 9, 10


def _num_key(v: Any, abs_tol: float) -> tuple[int, float]:
    if _is_nan(v):
        return (1, 0.0)
    try:
        f = float(v)
    except OverflowError:
        f = math.inf if v > 0 else -math.inf
    if math.isinf(f):
        return (0, f)
    if abs(f) <= abs_tol:
        return (0, 0.0)
    return (0, float(f"{f:.9g}"))


def _cell_key(v: Any, abs_tol: float) -> tuple[Any, ...]:
    """A total, type-safe sort key; numbers of all types share one rank."""
    if v is None:
        return (True, 0, 0)
    if isinstance(v, bool):
        return (False, _RANK_BOOL, v)
    if _is_number(v):
        return (False, _RANK_NUM, _num_key(v, abs_tol))
    if isinstance(v, str):
        return (False, _RANK_STR, v)
    if isinstance(v, bytes | bytearray):
        return (False, _RANK_BYTES, bytes(v))
    if isinstance(v, _dt.datetime):
        # naive and aware datetimes are not mutually comparable
        return (False, _RANK_DATETIME, (v.tzinfo is not None, v.isoformat()))
    if isinstance(v, _dt.date):
        return (False, _RANK_DATE, v)
    if isinstance(v, _dt.time):
        return (False, _RANK_TIME, v.isoformat())
    if isinstance(v, _dt.timedelta):
        return (False, _RANK_DELTA, v)
    if isinstance(v, list | tuple):
        return (False, _RANK_LIST, tuple(_cell_key(x, abs_tol) for x in v))
    if isinstance(v, dict):
        items = tuple((str(k), _cell_key(x, abs_tol)) for k, x in v.items())
        return (False, _RANK_DICT, items)
    return (False, _RANK_OTHER, (type(v).__name__, repr(v)))


KeyFn = Callable[[Any], Any]


def _is_exact_numeric(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_decimal(t)


def _value_type(t: pa.DataType) -> pa.DataType:
    return t.value_type if pa.types.is_dictionary(t) else t


def _decode(col: pa.ChunkedArray) -> pa.ChunkedArray:
    """Dictionary-encoded columns compare as their values."""
    return col.cast(col.type.value_type) if pa.types.is_dictionary(col.type) else col


def _column_key_fn(ta: pa.DataType, tb: pa.DataType, abs_tol: float) -> KeyFn:
    """Sort-key function for one column, chosen from the column types of *both* sides so
    that equal cells get equal keys on either side. None sorts last."""
    ta, tb = _value_type(ta), _value_type(tb)
    if _is_exact_numeric(ta) and _is_exact_numeric(tb):
        return lambda v: (1, 0) if v is None else (0, v)  # int and Decimal compare exactly
    if _is_plain_numeric(ta) and _is_plain_numeric(tb):
        return lambda v: (2, 0.0) if v is None else _num_key(v, abs_tol)
    if _is_string(ta) and _is_string(tb):
        return lambda v: (1, "") if v is None else (0, v)
    return lambda v: _cell_key(v, abs_tol)


@dataclass
class _Side:
    """One result as Python rows, with a sort key per row."""

    rows: list[Row]
    keys: list[tuple[Any, ...]]

    @classmethod
    def build(cls, columns: list[list[Any]], n_rows: int, fns: Sequence[KeyFn]) -> _Side:
        rows = list(zip(*columns, strict=True)) if columns else [() for _ in range(n_rows)]
        key_cols = [list(map(fn, col)) for fn, col in zip(fns, columns, strict=True)]
        keys = list(zip(*key_cols, strict=True)) if key_cols else [() for _ in range(n_rows)]
        return cls(rows, keys)

    def slice(self, start: int, end: int) -> _Side:
        return _Side(self.rows[start:end], self.keys[start:end])

    def sorted(self) -> _Side:
        order = sorted(range(len(self.rows)), key=self.keys.__getitem__)
        return _Side([self.rows[i] for i in order], [self.keys[i] for i in order])


def _multiset_equal(a: _Side, e: _Side, rel_tol: float, abs_tol: float) -> bool:
    """Multiset equality with tolerance for two sides sorted by their keys.

    A linear merge pairs rows with equal sort keys; rows it cannot pair (the rounded sort
    key may separate values that are equal within tolerance, or order equal-key rows
    differently) are then matched pairwise.
    """
    left_a: list[Row] = []
    left_e: list[Row] = []
    i = j = 0
    while i < len(a.rows) and j < len(e.rows):
        ka, ke = a.keys[i], e.keys[j]
        if ka == ke:
            if not _rows_equal(a.rows[i], e.rows[j], rel_tol, abs_tol):
                left_a.append(a.rows[i])
                left_e.append(e.rows[j])
            i += 1
            j += 1
        elif ka < ke:
            left_a.append(a.rows[i])
            i += 1
        else:
            left_e.append(e.rows[j])
            j += 1
    left_a.extend(a.rows[i:])
    left_e.extend(e.rows[j:])
    if len(left_a) != len(left_e) or len(left_a) > _FALLBACK_MATCH_LIMIT:
        return False
    for row in left_a:
        for k, cand in enumerate(left_e):
            if _rows_equal(row, cand, rel_tol, abs_tol):
                left_e[k] = left_e[-1]
                left_e.pop()
                break
        else:
            return False
    return True


# --------------------------------------------------------------------------------------
# formatting


def _fmt_row(row: Row) -> str:
    return "(" + ", ".join(repr(v) for v in row) + ")"


def _preview(rows: Sequence[Row], n: int = _PREVIEW_ROWS) -> str:
    if not rows:
        return "    <no rows>"
    lines = [f"    [{i}] {_fmt_row(r)}" for i, r in enumerate(rows[:n])]
    if len(rows) > n:
        lines.append(f"    ... {len(rows) - n} more")
    return "\n".join(lines)


def _fail(
    reason: str,
    *,
    context: str,
    actual: pa.Table,
    expected: pa.Table,
    actual_rows: Sequence[Row] | None = None,
    expected_rows: Sequence[Row] | None = None,
    index: int | None = None,
    note: str = "",
) -> None:
    parts = []
    if context:
        parts.append(f"context: {context}")
    parts.append(f"result mismatch: {reason}")
    parts.append(
        f"shapes: actual {actual.num_rows} rows x {actual.num_columns} cols "
        f"{actual.column_names}, expected {expected.num_rows} rows x "
        f"{expected.num_columns} cols {expected.column_names}"
    )
    if index is not None and actual_rows is not None and expected_rows is not None:
        a = _fmt_row(actual_rows[index]) if index < len(actual_rows) else "<missing>"
        e = _fmt_row(expected_rows[index]) if index < len(expected_rows) else "<missing>"
        parts.append(f"first differing row {index}{note}:\n    actual:   {a}\n    expected: {e}")
    if actual_rows is not None:
        parts.append(f"actual (first rows{note}):\n{_preview(actual_rows)}")
    if expected_rows is not None:
        parts.append(f"expected (first rows{note}):\n{_preview(expected_rows)}")
    raise AssertionError("\n".join(parts))


def _columns(table: pa.Table) -> list[list[Any]]:
    return [col.to_pylist() for col in table.columns]


def _as_table(t: Any) -> pa.Table:
    if isinstance(t, pa.Table):
        return t
    if isinstance(t, pa.RecordBatchReader):
        return t.read_all()
    if isinstance(t, pa.RecordBatch):
        return pa.Table.from_batches([t])
    raise TypeError(f"expected a pyarrow.Table, got {type(t).__name__}")


def _first_diff(a: Sequence[Row], b: Sequence[Row], rel_tol: float, abs_tol: float) -> int | None:
    for i, (ra, rb) in enumerate(zip(a, b, strict=False)):
        if not _rows_equal(ra, rb, rel_tol, abs_tol):
            return i
    if len(a) != len(b):
        return min(len(a), len(b))
    return None


def _tie_runs(
    rows: Sequence[Row], keys: Sequence[int], rel_tol: float, abs_tol: float
) -> list[tuple[int, int]]:
    """Split ``rows`` into maximal runs [start, end) of equal values in columns ``keys``."""
    runs: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or not all(
            cells_equal(rows[i][k], rows[start][k], rel_tol=rel_tol, abs_tol=abs_tol) for k in keys
        ):
            runs.append((start, i))
            start = i
    return runs if rows else []


# --------------------------------------------------------------------------------------
# vectorised fast path (Arrow/numpy); it may only *accept*: when it cannot prove equality
# the row-wise Python comparison decides and writes the error message.

_FAST_ERRORS = (pa.ArrowException, TypeError, ValueError, NotImplementedError, OverflowError)


def _is_plain_numeric(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t)


def _unify(a: pa.ChunkedArray, b: pa.ChunkedArray) -> tuple[pa.ChunkedArray, pa.ChunkedArray]:
    """Cast two columns to one type without changing what equality means for them.

    Raises one of _FAST_ERRORS when that is not possible."""
    a, b = _decode(a), _decode(b)
    ta, tb = a.type, b.type
    if ta == tb:
        return a, b
    if _is_plain_numeric(ta) and _is_plain_numeric(tb):
        if pa.types.is_floating(ta) or pa.types.is_floating(tb):
            # the row-wise rule compares float(a) with float(b) under tolerance
            return a.cast(pa.float64()), b.cast(pa.float64())
        if pa.types.is_integer(ta) and pa.types.is_integer(tb):
            target: pa.DataType = pa.int64()
            if pa.types.is_uint64(ta) or pa.types.is_uint64(tb):
                target = pa.decimal128(38, 0)
            return a.cast(target), b.cast(target)
        scale = max(getattr(ta, "scale", 0), getattr(tb, "scale", 0))
        target = pa.decimal256(76, scale)  # exact (or raises on overflow)
        return a.cast(target), b.cast(target)
    if _is_string(ta) and _is_string(tb):
        return a.cast(pa.large_string()), b.cast(pa.large_string())
    if _is_binary(ta) and _is_binary(tb):
        return a.cast(pa.large_binary()), b.cast(pa.large_binary())
    raise TypeError(f"no exact common type for {ta} and {tb}")


def _is_string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_binary(t: pa.DataType) -> bool:
    return pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t)


def _float_close(a: pa.ChunkedArray, b: pa.ChunkedArray, rel_tol: float, abs_tol: float) -> bool:
    a_null = np.asarray(a.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    b_null = np.asarray(b.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    if not np.array_equal(a_null, b_null):
        return False
    av = np.asarray(a.to_numpy(zero_copy_only=False), dtype=np.float64)
    bv = np.asarray(b.to_numpy(zero_copy_only=False), dtype=np.float64)
    with np.errstate(all="ignore"):
        both_nan = np.isnan(av) & np.isnan(bv)
        bound = np.maximum(rel_tol * np.maximum(np.abs(av), np.abs(bv)), abs_tol)
        close = (av == bv) | (np.abs(av - bv) <= bound)
    return bool(np.all(close | both_nan | a_null))


def _fast_equal(
    actual: pa.Table, expected: pa.Table, *, ordered: bool, rel_tol: float, abs_tol: float
) -> bool:
    """True only if the tables are certainly equal under the comparison rules."""
    try:
        pairs = [_unify(a, e) for a, e in zip(actual.columns, expected.columns, strict=True)]
        if not pairs:
            return True
        names = [f"c{i}" for i in range(len(pairs))]
        a_tab = pa.table([p[0] for p in pairs], names=names)
        e_tab = pa.table([p[1] for p in pairs], names=names)
        if not ordered:
            keys = [(n, "ascending") for n in names]
            a_tab = a_tab.take(pc.sort_indices(a_tab, sort_keys=keys))
            e_tab = e_tab.take(pc.sort_indices(e_tab, sort_keys=keys))
        for a, e in zip(a_tab.columns, e_tab.columns, strict=True):
            if pa.types.is_floating(a.type):
                if not _float_close(a, e, rel_tol, abs_tol):
                    return False
            elif not a.equals(e):
                return False
        return True
    except _FAST_ERRORS:
        return False


# --------------------------------------------------------------------------------------
# public API


def assert_same_result(
    actual: pa.Table,
    expected: pa.Table,
    *,
    ordered: bool,
    rel_tol: float = 1e-9,
    abs_tol: float = 1e-6,
    context: str = "",
    check_names: bool = True,
    sort_keys: Sequence[int] | None = None,
) -> None:
    """Assert that ``actual`` (system under test) equals ``expected`` (oracle).

    * Column counts and row counts must match; with ``check_names`` the column names must
      match exactly (case-sensitive). Column *types* are not compared, values are.
    * ``ordered=False``: rows are compared as multisets.
    * ``ordered=True`` and ``sort_keys=None``: rows must match in order.
    * ``ordered=True`` and ``sort_keys=[i, ...]`` (output column indexes of the ORDER BY
      keys): the expected rows are split into runs of equal sort-key values and each run is
      compared as a multiset with the same index range of ``actual``; rows that tie on the
      ORDER BY keys may therefore come in any order. ``sort_keys=[]`` means one big run.

    Raises AssertionError with a readable description on mismatch.
    """
    actual = _as_table(actual)
    expected = _as_table(expected)
    common = {"context": context, "actual": actual, "expected": expected}

    if actual.num_columns != expected.num_columns:
        _fail(f"column count differs: {actual.num_columns} != {expected.num_columns}", **common)
    if check_names and actual.column_names != expected.column_names:
        _fail(f"column names differ: {actual.column_names} != {expected.column_names}", **common)
    if sort_keys is not None:
        bad = [k for k in sort_keys if not 0 <= k < expected.num_columns]
        if bad:
            raise ValueError(f"sort_keys {bad} out of range for {expected.num_columns} columns")

    if actual.num_rows == expected.num_rows and _fast_equal(
        actual, expected, ordered=ordered, rel_tol=rel_tol, abs_tol=abs_tol
    ):
        return  # (an exact ordered match also satisfies any sort_keys)

    fns = [
        _column_key_fn(a.type, e.type, abs_tol)
        for a, e in zip(actual.columns, expected.columns, strict=True)
    ]
    a_side = _Side.build(_columns(actual), actual.num_rows, fns)
    e_side = _Side.build(_columns(expected), expected.num_rows, fns)
    a_rows, e_rows = a_side.rows, e_side.rows
    if len(a_rows) != len(e_rows):
        reason = f"row count differs: {len(a_rows)} != {len(e_rows)}"
        if ordered:
            idx = _first_diff(a_rows, e_rows, rel_tol, abs_tol)
            _fail(reason, **common, actual_rows=a_rows, expected_rows=e_rows, index=idx)
        a_s, e_s = a_side.sorted(), e_side.sorted()
        idx = _first_diff(a_s.rows, e_s.rows, rel_tol, abs_tol)
        _fail(
            reason,
            **common,
            actual_rows=a_s.rows,
            expected_rows=e_s.rows,
            index=idx,
            note=" (after sorting)",
        )

    if not ordered:
        _assert_multiset(a_side, e_side, rel_tol, abs_tol, common, note=" (after sorting)")
        return

    if sort_keys is None:
        idx = _first_diff(a_rows, e_rows, rel_tol, abs_tol)
        if idx is not None:
            _fail(
                "rows differ (ordered comparison)",
                **common,
                actual_rows=a_rows,
                expected_rows=e_rows,
                index=idx,
            )
        return

    for start, end in _tie_runs(e_rows, list(sort_keys), rel_tol, abs_tol):
        if end - start == 1:
            if not _rows_equal(a_rows[start], e_rows[start], rel_tol, abs_tol):
                _fail(
                    "rows differ (ordered comparison, ties on sort keys unordered)",
                    **common,
                    actual_rows=a_rows,
                    expected_rows=e_rows,
                    index=start,
                )
            continue
        try:
            _assert_multiset(
                a_side.slice(start, end),
                e_side.slice(start, end),
                rel_tol,
                abs_tol,
                common,
                note=f" (tie run rows {start}..{end - 1}, after sorting)",
            )
        except AssertionError as err:
            raise AssertionError(
                f"{err}\nrun of rows tied on sort keys {list(sort_keys)}: "
                f"rows {start}..{end - 1} of the results differ as multisets"
            ) from None


def _assert_multiset(
    a: _Side,
    e: _Side,
    rel_tol: float,
    abs_tol: float,
    common: dict[str, Any],
    note: str,
) -> None:
    a_s, e_s = a.sorted(), e.sorted()
    idx = _first_diff(a_s.rows, e_s.rows, rel_tol, abs_tol)
    if idx is None:
        return
    # The rounded sort key can separate rows that are equal within tolerance: confirm the
    # mismatch with a tolerant matching before failing.
    if _multiset_equal(a_s, e_s, rel_tol, abs_tol):
        return
    _fail(
        "rows differ (unordered comparison)",
        **common,
        actual_rows=a_s.rows,
        expected_rows=e_s.rows,
        index=idx,
        note=note,
    )


def order_insensitive_within_ties(
    actual: pa.Table,
    expected: pa.Table,
    sort_keys: Sequence[int],
    **kwargs: Any,
) -> None:
    """Ordered comparison in which rows tying on the ORDER BY key columns ``sort_keys``
    (output column indexes) may appear in any order. Other keyword arguments are passed
    to :func:`assert_same_result`."""
    assert_same_result(actual, expected, ordered=True, sort_keys=sort_keys, **kwargs)


def _outer_query(sql: str) -> exp.Expression:
    node = sqlglot.parse_one(sql, dialect="duckdb")
    # "(SELECT ... ORDER BY x)" at top level: the parentheses carry no ORDER BY themselves
    while isinstance(node, exp.Subquery | exp.Paren) and not node.args.get("order"):
        node = node.this
    return node


def query_is_ordered(sql: str) -> bool:
    """True iff the outermost query (not a subquery or CTE) has an ORDER BY. For a set
    operation (UNION/INTERSECT/EXCEPT) only the ORDER BY applying to the whole operation
    counts."""
    node = _outer_query(sql)
    if not isinstance(node, exp.Query):
        return False
    order = node.args.get("order")
    return bool(order and order.expressions)


def sort_key_indexes(sql: str, column_names: Sequence[str]) -> list[int]:
    """Best-effort: output column indexes of the outer ORDER BY items, in order.

    Items are resolved by ordinal (``ORDER BY 2``), by output name/alias, or by matching
    a projection's expression text. Resolution stops at the first item that cannot be
    resolved: rows tying on the resolved prefix are then compared as multisets, which is
    a sound (if weaker) check. Returns [] when the query has no ORDER BY.
    """
    node = _outer_query(sql)
    order = node.args.get("order") if isinstance(node, exp.Query) else None
    if not order:
        return []
    projections: list[exp.Expression] = []
    if isinstance(node, exp.Select):
        projections = list(node.expressions)
    elif isinstance(node, exp.SetOperation):
        left: exp.Expression = node
        while isinstance(left, exp.SetOperation):
            left = left.left
        while isinstance(left, exp.Subquery):
            left = left.this
        if isinstance(left, exp.Select):
            projections = list(left.expressions)
    names = list(column_names)
    proj_sql = [
        (p.this if isinstance(p, exp.Alias) else p).sql(dialect="duckdb").lower()
        for p in projections
    ]
    keys: list[int] = []
    for item in order.expressions:
        target = item.this if isinstance(item, exp.Ordered) else item
        idx: int | None = None
        if isinstance(target, exp.Literal) and target.is_int:
            pos = int(target.this) - 1
            idx = pos if 0 <= pos < len(names) else None
        elif isinstance(target, exp.Column) and not target.table and target.name in names:
            idx = names.index(target.name)
        if idx is None:
            text = target.sql(dialect="duckdb").lower()
            if text in proj_sql and len(proj_sql) == len(names):
                idx = proj_sql.index(text)
        if idx is None and isinstance(target, exp.Column) and target.name in names:
            idx = names.index(target.name)
        if idx is None:
            break
        keys.append(idx)
    return keys


# --------------------------------------------------------------------------------------
# answers that are not unique: sort-mode "valuesort", and LIMIT over ties or no ORDER BY


def _bucket_key(row: Row, abs_tol: float) -> tuple[Any, ...]:
    return tuple(_cell_key(v, abs_tol) for v in row)


def _unmatched(
    rows: Sequence[Row], pool: Sequence[Row], rel_tol: float, abs_tol: float
) -> list[Row]:
    """The rows of ``rows`` left over after pairing each with a distinct equal row of
    ``pool`` (equal within tolerance): empty iff ``rows`` is a sub-multiset of ``pool``."""
    buckets: dict[tuple[Any, ...], list[Row]] = {}
    for row in pool:
        buckets.setdefault(_bucket_key(row, abs_tol), []).append(row)
    left: list[Row] = []
    for row in rows:
        bucket = buckets.get(_bucket_key(row, abs_tol), [])
        for k, cand in enumerate(bucket):
            if _rows_equal(row, cand, rel_tol, abs_tol):
                bucket.pop(k)
                break
        else:
            left.append(row)
    if not left:
        return []
    rest = [r for bucket in buckets.values() for r in bucket]
    if len(left) > _FALLBACK_MATCH_LIMIT:
        return left
    still: list[Row] = []
    for row in left:  # the rounded key may separate values equal within tolerance
        for k, cand in enumerate(rest):
            if _rows_equal(row, cand, rel_tol, abs_tol):
                rest[k] = rest[-1]
                rest.pop()
                break
        else:
            still.append(row)
    return still


def _rows_of(table: pa.Table) -> list[Row]:
    cols = _columns(table)
    return list(zip(*cols, strict=True)) if cols else [() for _ in range(table.num_rows)]


def assert_same_values(
    actual: pa.Table,
    expected: pa.Table,
    *,
    rel_tol: float = 1e-9,
    abs_tol: float = 1e-6,
    context: str = "",
) -> None:
    """sqllogictest's ``valuesort``: the same shape, and the same multiset of cell values
    (every value sorted independently of its row)."""
    actual, expected = _as_table(actual), _as_table(expected)
    common = {"context": context, "actual": actual, "expected": expected}
    if actual.num_columns != expected.num_columns:
        _fail(f"column count differs: {actual.num_columns} != {expected.num_columns}", **common)
    if actual.num_rows != expected.num_rows:
        _fail(f"row count differs: {actual.num_rows} != {expected.num_rows}", **common)
    a_vals = [(v,) for row in _rows_of(actual) for v in row]
    e_vals = [(v,) for row in _rows_of(expected) for v in row]
    left = _unmatched(a_vals, e_vals, rel_tol, abs_tol)
    if left:
        _fail(
            f"values differ (valuesort): {len(left)} actual values unmatched, first {left[0][0]!r}",
            **common,
        )


def assert_limited_result(
    actual: pa.Table,
    expected: pa.Table,
    full: pa.Table,
    *,
    sort_keys: Sequence[int],
    ordered: bool,
    rel_tol: float = 1e-9,
    abs_tol: float = 1e-6,
    context: str = "",
) -> None:
    """A LIMIT/OFFSET answer, which is not unique when rows tie on the ORDER BY keys at a
    cut (or when there is no ORDER BY at all). ``expected`` is the oracle's limited
    answer, ``full`` its answer without LIMIT and OFFSET, ``sort_keys`` the output columns
    of the ORDER BY keys (a resolved prefix; ``[]`` without ORDER BY).

    * the row counts must be equal;
    * with ``ordered``, the key values must be equal row by row (they are unique);
    * rows are grouped by their key values: a group that ``expected`` holds completely
      (as many rows as ``full`` has with those keys) must be equal as a multiset; a group
      cut by the LIMIT or OFFSET must be a sub-multiset of ``full``'s rows with those keys,
      of the same size.

    Without ORDER BY this is: as many rows as expected, all drawn from the full answer.
    """
    actual, expected, full = _as_table(actual), _as_table(expected), _as_table(full)
    common = {"context": context, "actual": actual, "expected": expected}
    if actual.num_columns != expected.num_columns:
        _fail(f"column count differs: {actual.num_columns} != {expected.num_columns}", **common)
    a_rows, e_rows, f_rows = _rows_of(actual), _rows_of(expected), _rows_of(full)
    if len(a_rows) != len(e_rows):
        _fail(
            f"row count differs: {len(a_rows)} != {len(e_rows)} (LIMIT)",
            **common,
            actual_rows=a_rows,
            expected_rows=e_rows,
        )
    keys = list(sort_keys)
    if ordered:
        for i, (ra, re_) in enumerate(zip(a_rows, e_rows, strict=True)):
            if not all(cells_equal(ra[k], re_[k], rel_tol=rel_tol, abs_tol=abs_tol) for k in keys):
                _fail(
                    f"ORDER BY key values differ at row {i} (LIMIT)",
                    **common,
                    actual_rows=a_rows,
                    expected_rows=e_rows,
                    index=i,
                )

    def group(rows: Sequence[Row]) -> dict[tuple[Any, ...], list[Row]]:
        out: dict[tuple[Any, ...], list[Row]] = {}
        for row in rows:
            out.setdefault(tuple(_cell_key(row[k], abs_tol) for k in keys), []).append(row)
        return out

    a_groups, e_groups, f_groups = group(a_rows), group(e_rows), group(f_rows)
    if sorted(map(len, a_groups.values())) != sorted(map(len, e_groups.values())) or len(
        a_groups
    ) != len(e_groups):
        _fail("rows per ORDER BY key value differ (LIMIT)", **common, actual_rows=a_rows)
    for key, e_group in e_groups.items():
        a_group = a_groups.get(key, [])
        pool = e_group if len(e_group) == len(f_groups.get(key, [])) else f_groups.get(key, [])
        left = (
            _unmatched(a_group, pool, rel_tol, abs_tol) if len(a_group) == len(e_group) else a_group
        )
        if left or len(a_group) != len(e_group):
            complete = pool is e_group
            _fail(
                "rows differ (LIMIT): "
                + (
                    "a group of rows tied on the ORDER BY keys differs"
                    if complete
                    else "rows are not drawn from the answer without LIMIT"
                )
                + (f"; first unmatched {_fmt_row(left[0])}" if left else ""),
                **common,
                actual_rows=a_rows,
                expected_rows=e_rows,
            )
