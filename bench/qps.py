"""Short queries: point lookups and key-IN lookups on the distribution key, small aggregates
over one customer's orders, and small inserts, with 1, 4 and 16 client threads, beside
DuckDB in process running the same lookups with the same threads.

The last line is ``point_qps_4=A point_p50_ms=B ratio_vs_duckdb=C insert_rows_s_16=D``
(C: DuckDB's point-lookup QPS / shardflow's, 4 clients). orders is created with
``key_index=True`` and DuckDB's orders gets the same index (``--no-key-index``: neither).

    python bench/qps.py --sf 0.1 --workers 4
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import duckdb
import pyarrow as pa

import shardflow
from shardflow import tpch

KINDS: dict[str, Callable[[int, int], str]] = {
    "point": lambda i, n: f"SELECT * FROM orders WHERE o_orderkey = {key(i, n)}",
    "key-in": lambda i, n: (
        "SELECT o_orderkey, o_totalprice FROM orders WHERE o_orderkey IN "
        f"({key(i, n)}, {key(i + 1, n)}, {key(i + 2, n)}, {key(i + 3, n)})"
    ),
    "customer": lambda i, n: (
        "SELECT count(*), sum(o_totalprice) FROM orders "
        f"WHERE o_custkey = {1 + (i * 7919) % max(1, n // 10)}"
    ),
}


def key(i: int, orders: int) -> int:
    """An existing order key (TPC-H keeps 8 of every 32 numbers)."""
    k = (i * 7919) % orders
    return (k // 8) * 32 + k % 8 + 1


def measure(threads: int, seconds: float, run: Callable[[int], object]) -> tuple[float, float]:
    """(queries per second, median latency ms) of ``threads`` clients for ``seconds``."""
    latencies: list[list[float]] = [[] for _ in range(threads)]
    stop = threading.Event()

    def client(index: int) -> None:
        i = index
        run(i)  # warm: plan cache, connections
        while not stop.is_set():
            started = time.perf_counter()
            run(i)
            latencies[index].append(time.perf_counter() - started)
            i += threads

    with ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(client, i) for i in range(threads)]
        time.sleep(0.5)
        for done in latencies:
            done.clear()
        started = time.perf_counter()
        time.sleep(seconds)
        stop.set()
        elapsed = time.perf_counter() - started
        for future in futures:
            future.result()
    every = [x for done in latencies for x in done]
    return len(every) / elapsed, statistics.median(every) * 1000 if every else float("nan")


Query = Callable[[int, int], str]


def on_shardflow(db: shardflow.Database, make: Query, orders: int) -> Callable[[int], object]:
    return lambda i: db.sql(make(i, orders))


def on_duckdb(
    oracle: duckdb.DuckDBPyConnection, make: Query, orders: int
) -> Callable[[int], object]:
    cursors = threading.local()  # one cursor per client thread, as DuckDB wants

    def run(i: int) -> object:
        if not hasattr(cursors, "con"):
            cursors.con = oracle.cursor()
        return cursors.con.sql(make(i, orders)).fetchall()

    return run


def small_inserts(db: shardflow.Database) -> Callable[[int], object]:
    db.create_table("small", rows(0), distributed_by="id")
    counter = iter(range(1, 1 << 40))
    lock = threading.Lock()

    def insert(_: int) -> object:
        with lock:
            start = next(counter) * 10
        return db.insert("small", rows(start))

    return insert


def rows(start: int, count: int = 10) -> pa.Table:
    ids = pa.array(range(start, start + count), pa.int64())
    return pa.table({"id": ids, "v": pa.array([1.0] * count)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sf", type=float, default=0.1)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=5.0, help="per measurement")
    parser.add_argument("--home", type=Path, default=Path(".shardflow-bench"))
    parser.add_argument(
        "--no-fast-lane", action="store_true", help="every fragment through Ray (fast_lane off)"
    )
    parser.add_argument(
        "--no-key-index",
        action="store_true",
        help="orders without an index on o_orderkey (on both sides); with one by default",
    )
    args = parser.parse_args()
    data = tpch.generate(args.sf, args.home / f"tpch-sf{args.sf:g}")
    oracle = tpch.duckdb_oracle(data)
    indexed = () if args.no_key_index else ("orders",)
    if indexed:  # the same physical design on both sides: DuckDB's table has the index too
        oracle.execute("CREATE INDEX orders_key ON orders (o_orderkey)")
    orders = oracle.sql("SELECT count(*) FROM orders").fetchall()[0][0]
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="shardflow-bench-qps-") as data_dir:
        with shardflow.connect(
            workers=args.workers, data_dir=data_dir, fast_lane=not args.no_fast_lane
        ) as db:
            tpch.load(db, data, key_index=indexed)
            print(db.explain(KINDS["point"](0, orders)).splitlines()[4].strip())
            print(f"orders' key indexed: {bool(indexed)} (both sides)")
            for kind, make in KINDS.items():
                for threads in (1, 4, 16):
                    qps, p50 = measure(threads, args.seconds, on_shardflow(db, make, orders))
                    line = f"{kind:9} {threads:2} clients: shardflow {qps:6.0f} q/s {p50:5.1f} ms"
                    if kind == "point" and threads in (1, 4):
                        duck, duck_p50 = measure(
                            threads, args.seconds, on_duckdb(oracle, make, orders)
                        )
                        line += f" | DuckDB {duck:6.0f} q/s {duck_p50:5.2f} ms"
                        figures[f"duckdb_{threads}"] = duck
                    print(line, flush=True)
                    figures[f"{kind}_{threads}"], figures[f"{kind}_p50_{threads}"] = qps, p50
            inserts, _ = measure(16, args.seconds, small_inserts(db))
            print(f"inserts of 10 rows, 16 clients: {inserts * 10:.0f} rows/s")
    oracle.close()
    print(
        f"point_qps_4={figures['point_4']:.0f} point_p50_ms={figures['point_p50_1']:.2f} "
        f"ratio_vs_duckdb={figures['duckdb_4'] / figures['point_4']:.1f} "
        f"insert_rows_s_16={inserts * 10:.0f}"
    )


if __name__ == "__main__":
    main()
