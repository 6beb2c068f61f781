"""Sorted parts interleaved as they arrive (``runtime/query/merging.py``), against DuckDB:
parts that DuckDB sorted, cut into batches of random sizes, merged batch by batch, give
DuckDB's own ``ORDER BY ... LIMIT ... OFFSET`` over all the rows (NULLs first or last,
NaN, descending keys, ties, strings, empty parts); the merge never holds a part whole."""

from __future__ import annotations

import random
from collections.abc import Iterator

import duckdb
import pyarrow as pa
import pytest

from shardflow.runtime.query.merging import SortedParts, UnsortableKey
from shardflow.sql.merges import sorted_merge

ORDERS = [
    "ORDER BY _c1, _c0",
    "ORDER BY _c1 DESC, _c0",
    "ORDER BY _c1 NULLS FIRST, _c0 DESC",
    "ORDER BY _c2 DESC NULLS FIRST, _c0",
    "ORDER BY _c2, _c0 LIMIT 37",
    "ORDER BY _c3, _c1 DESC, _c0 LIMIT 50 OFFSET 13",
    "ORDER BY _c3 DESC, _c0 OFFSET 200",
]


def rows(seed: int, count: int) -> pa.Table:
    rng = random.Random(seed)
    ints = [rng.choice([None, *range(20)]) for _ in range(count)]
    values = [None, float("nan"), -1.5, 0.0, 2.25, float("inf"), 7.0]
    floats = [rng.choice(values) for _ in range(count)]
    texts = [rng.choice([None, "", "a", "b", "ab", "é", "Z"]) for _ in range(count)]
    return pa.table({
        "_c0": pa.array(range(seed * 10_000, seed * 10_000 + count), pa.int64()),
        "_c1": pa.array(ints, pa.int64()),
        "_c2": pa.array(floats, pa.float64()),
        "_c3": pa.array(texts, pa.string()),
    })  # fmt: skip


def duckdb_rows(sql: str, table: pa.Table) -> list[tuple[object, ...]]:
    con = duckdb.connect()
    con.register("__sf_partials", table)
    try:
        return [tuple(r) for r in con.sql(sql).fetchall()]
    finally:
        con.close()


def in_batches(table: pa.Table, rng: random.Random) -> Iterator[pa.Table]:
    start = 0
    while start < table.num_rows:
        size = rng.randint(0, 40)  # empty batches too
        yield table.slice(start, size)
        start += size


def same(a: list[tuple[object, ...]], b: list[tuple[object, ...]]) -> bool:
    def norm(row: tuple[object, ...]) -> tuple[object, ...]:
        return tuple("nan" if isinstance(v, float) and v != v else v for v in row)

    return [norm(r) for r in a] == [norm(r) for r in b]


@pytest.mark.parametrize("order", ORDERS)
def test_sorted_parts_merged_as_they_arrive_are_duckdbs_order(order: str) -> None:
    merge_sql = f"SELECT _c0 AS id, _c1 AS i, _c2 AS f, _c3 AS s FROM __sf_partials {order}"
    merge = sorted_merge(merge_sql)
    assert merge is not None
    rng = random.Random(order)
    parts = [rows(seed, count) for seed, count in enumerate([300, 0, 170, 255, 1])]
    sorted_parts = [  # as each worker answers its part: sorted, in batches
        pa.Table.from_pylist(
            [
                dict(zip(p.column_names, r, strict=True))
                for r in duckdb_rows(
                    merge.part_sql("SELECT _c0, _c1, _c2, _c3 FROM __sf_partials"), p
                )
            ],
            p.schema,
        )
        for p in parts
    ]
    merged = pa.concat_tables(
        [t for t in SortedParts([in_batches(p, rng) for p in sorted_parts], merge)]
        or [parts[0].slice(0, 0)]
    )
    got = [tuple(r.values()) for r in merged.select(list(merge.columns)).to_pylist()]
    expected = duckdb_rows(merge_sql, pa.concat_tables(parts))
    assert same(got, expected)  # every ordering ends in the unique _c0: no ties


def test_a_part_is_read_only_as_far_as_the_answer_needs_it() -> None:
    merge = sorted_merge("SELECT _c0 FROM __sf_partials ORDER BY _c0 LIMIT 5")
    assert merge is not None
    pulled = [0, 0]

    def part(index: int) -> Iterator[pa.Table]:
        for start in range(index, 10_000, 100):
            pulled[index] += 1
            yield pa.table({"_c0": pa.array(range(start, start + 100, 2), pa.int64())})

    merged = pa.concat_tables(list(SortedParts([part(0), part(1)], merge)))
    assert merged.column("_c0").to_pylist() == [0, 1, 2, 3, 4]
    assert pulled == [1, 1]  # one batch of each, of a hundred


def test_a_key_of_a_type_arrow_orders_otherwise_is_refused_before_a_row_goes_out() -> None:
    merge = sorted_merge("SELECT _c0 FROM __sf_partials ORDER BY _c0")
    assert merge is not None
    intervals = pa.table({"_c0": pa.array([None], pa.month_day_nano_interval())})
    with pytest.raises(UnsortableKey):
        list(SortedParts([[intervals], [intervals]], merge))
