"""Planning time beside DuckDB's time to answer, for queries that grow: long OR / AND
chains, long IN lists, long UNION ALL chains. Planning should grow about linearly with the
query; the last line is the ratio of planning times 5,000 vs 1,000 ORs (5 for linear).

    python bench/planning.py
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import duckdb
import pyarrow as pa

from shardflow.catalog import Catalog, TableSpec
from shardflow.sql import plan
from shardflow.telemetry.calibration import best_of

SHAPES: dict[str, Callable[[int], str]] = {
    "OR": lambda n: "SELECT * FROM t WHERE " + " OR ".join(f"col1 = {i}" for i in range(n)),
    "AND": lambda n: "SELECT * FROM t WHERE " + " AND ".join(f"col1 <> {i}" for i in range(n)),
    "IN": lambda n: f"SELECT * FROM t WHERE col1 IN ({', '.join(str(i) for i in range(n))})",
    "UNION ALL": lambda n: " UNION ALL ".join(
        f"SELECT col1 FROM t WHERE col2 = {i}" for i in range(n)
    ),
}


def catalog() -> Catalog:
    schema = pa.schema([("col0", pa.int64()), ("col1", pa.int64()), ("col2", pa.int64())])
    base, group = Catalog(nodes=("node-0", "node-1")).with_new_group(
        pa.int64(), ["node-0", "node-1", "node-0", "node-1"]
    )
    return base.with_table(TableSpec("t", "t", schema, "distributed", "col0", group, 1000))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,5000", help="terms per query")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs (best)")
    args = parser.parse_args()
    sizes = [int(n) for n in args.sizes.split(",")]
    cat = catalog()
    con = duckdb.connect()
    con.execute(
        "CREATE TABLE t AS SELECT range AS col0, range % 97 AS col1, range % 13 AS col2 "
        "FROM range(1000)"
    )
    planned: dict[tuple[str, int], float] = {}
    print(f"{'shape':<10} {'terms':>6} {'plan s':>8} {'duckdb s':>9}")
    for shape, make in SHAPES.items():
        for n in sizes:
            sql = make(n)
            seconds = best_of(args.repeat, lambda sql=sql: plan(sql, cat))
            answer = best_of(1, lambda sql=sql: con.sql(sql).to_arrow_table())
            planned[(shape, n)] = seconds
            print(f"{shape:<10} {n:>6} {seconds:>8.3f} {answer:>9.3f}")
    if len(sizes) >= 2:
        low, high = sizes[0], sizes[-1]
        ratio = planned[("OR", high)] / planned[("OR", low)]
        print(f"planning {high} / {low} ORs: {ratio:.2f} (linear: {high / low:.2f})")


if __name__ == "__main__":
    main()
