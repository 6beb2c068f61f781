"""TPC-H on shardflow beside DuckDB (in memory, threads = CPU cores) on the same data, in one
run. Prints per-query times and, last, the geometric-mean ratio shardflow/DuckDB.

    python bench/tpch.py --sf 1 --workers 4
    python bench/tpch.py --sf 10 --workers 4 --memory-limit-gb 3   # bigger than memory

shardflow runs first, then DuckDB, each answer compared with DuckDB's.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import time
from pathlib import Path

import pyarrow as pa

import shardflow
from shardflow import tpch
from shardflow.telemetry.calibration import best_of
from shardflow.tools.demo import same_rows


def profiling_overhead(db: shardflow.Database, numbers: list[int], repeat: int) -> float:
    """Geometric mean over queries of (time with profiling) / (time without) - 1; runs
    alternate so that both see the same machine."""
    session = db._session_or_raise()  # the switch the profile_queries setting sets
    ratios = []
    for number in numbers:
        query = tpch.query(number)
        on, off = [], []
        for _ in range(max(repeat, 5)):
            for enabled, times in ((True, on), (False, off)):
                session.profiling = enabled
                started = time.perf_counter()
                db.sql(query)
                times.append(time.perf_counter() - started)
        ratios.append(statistics.median(on) / statistics.median(off))
    session.profiling = True
    return math.exp(statistics.fmean(math.log(r) for r in ratios)) - 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sf", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per query (best)")
    parser.add_argument("--home", type=Path, default=Path(".shardflow-bench"))
    parser.add_argument("--queries", type=str, default="", help="e.g. 1,3,18 (default all)")
    parser.add_argument(
        "--memory-limit-gb",
        type=float,
        default=0.0,
        help="memory each worker's DuckDB may use (spilling to local disk beyond it); DuckDB "
        "alone gets the workers' total. 0: the defaults",
    )
    parser.add_argument(
        "--no-fast-lane", action="store_true", help="every fragment through Ray (fast_lane off)"
    )
    parser.add_argument(
        "--profiling-overhead",
        action="store_true",
        help="also time every query with per-fragment profiling off and on",
    )
    args = parser.parse_args()

    data = tpch.generate(args.sf, args.home / "tpch")
    db_dir = args.home / f"db-sf{args.sf:g}"
    shutil.rmtree(db_dir, ignore_errors=True)
    numbers = [int(q) for q in args.queries.split(",") if q] or list(tpch.QUERY_NUMBERS)
    limit_mb = int(args.memory_limit_gb * 1024)

    # shardflow first, then DuckDB: with a memory limit the two would not fit side by side.
    # The balancer stays off: this measures queries, not moves (bench/elasticity.py does).
    answers: dict[int, pa.Table] = {}
    timings: dict[int, tuple[float, float, float, float, str]] = {}
    options: dict[str, object] = {"worker_memory_mb": limit_mb} if limit_mb else {}
    if args.no_fast_lane:
        options["fast_lane"] = False
    with shardflow.connect(
        workers=args.workers, data_dir=db_dir, auto_balance=False, **options
    ) as db:
        started = time.perf_counter()
        tpch.load(db, data, progress=True)
        print(
            f"load: {time.perf_counter() - started:.1f}s (SF {args.sf:g}, {args.workers} workers"
            + (f", {args.memory_limit_gb:g} GB each)" if limit_mb else ")")
        )
        for number in numbers:
            query = tpch.query(number)
            answers[number] = db.sql(query)  # warm-up: the plan is cached from here on
            planning = db.last_report.plan_seconds if db.last_report else 0.0
            ours = best_of(args.repeat, lambda q=query: db.sql(q))
            report = db.last_report
            assert report is not None
            on_workers = sum(
                max((f.seconds for f in stage.fragments), default=0.0) for stage in report.stages
            )
            merging = sum(stage.merge_seconds for stage in report.stages)
            stages = " + ".join(f"{s.strategy}@{s.placement}" for s in report.stages)
            timings[number] = (ours, planning, on_workers, merging, stages)
            print(f"Q{number:02d} shardflow {ours * 1000:.1f} ms", flush=True)
        spilled = sum(n.spilled_bytes for n in db.cluster.nodes())
        overhead = profiling_overhead(db, numbers, args.repeat) if args.profiling_overhead else None

    oracle = tpch.duckdb_oracle(data, memory_limit_mb=limit_mb * args.workers)
    oracle.execute(f"SET threads = {os.cpu_count() or 1}")
    print(
        f"{'query':>5} {'shardflow ms':>13} {'duckdb ms':>10} {'ratio':>6} {'same':>5}"
        f" | {'plan*':>6} {'workers':>8} {'merge':>6}  stages"
    )
    ratios = []
    equal = 0
    for number in numbers:
        query = tpch.query(number)
        expected = oracle.sql(query).to_arrow_table()
        theirs = best_of(args.repeat, lambda q=query: oracle.sql(q).to_arrow_table())
        ours, planning, on_workers, merging, stages = timings[number]
        same = same_rows(answers[number], expected)
        equal += same
        ratios.append(ours / theirs)
        print(
            f"Q{number:02d}  {ours * 1000:13.1f} {theirs * 1000:10.1f} {ours / theirs:6.2f}"
            f" {'yes' if same else 'NO':>5} | {planning * 1000:6.1f} {on_workers * 1000:8.1f}"
            f" {merging * 1000:6.1f}  {stages}"
        )
    print(
        "plan*: planning on first run (cached after); workers: slowest fragment per stage;"
        " merge: client merges (last timed run)"
    )
    if limit_mb:
        print(f"spilled by the workers to local disk at the end: {spilled / (1 << 30):.2f} GiB")
    if overhead is not None:
        print(f"profiling overhead (geometric mean of on/off per query): {overhead:+.2%}")
    geomean = math.exp(statistics.fmean(math.log(r) for r in ratios))
    print(f"answers equal: {equal}/{len(numbers)}")
    print(f"geometric-mean ratio shardflow/duckdb at SF {args.sf:g}: {geomean:.2f}")


if __name__ == "__main__":
    main()
