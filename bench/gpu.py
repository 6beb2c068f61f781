"""TPC-H per query on the GPU engine (Polars collected by cudf-polars) beside DuckDB on the
CPU, over the same Arrow tables in memory, in one run. Prints per-query times, where the GPU
engine fell back, and, last, the geometric-mean ratio GPU engine/DuckDB.

    python bench/gpu.py --sf 1          # on a machine with an NVIDIA GPU and shardflow[gpu]
    python bench/gpu.py --sf 1 --cpu    # the same path, Polars (1.44, as cudf-polars) on the CPU
    python bench/gpu.py --sf 10 --resident   # also over frames kept in the engine's memory

Both sides run each query whole through the engine a shardflow worker uses (``PolarsEngine``
and ``DuckDBEngine``), so the GPU side includes what a worker pays: SQL rewriting, Arrow to
Polars and the transfer to and from the device. Answers are checked against DuckDB. Each
query runs once to warm up, then ``--repeat`` times; the fastest run counts.

With ``--resident`` every table is also kept as the engine's own frame, as a worker keeps
the shards it serves (``PolarsEngine.frames``; the time to build them is printed apart), and
each query runs twice on the Polars side: *cold* over the Arrow tables (what every query
paid before frames were kept) and *warm* over the kept frames. The last line is then

    gpu_ratio_warm=X gpu_ratio_cold=Y answers_equal=N/22 fallbacks=F cache_build_s=B

(geometric-mean ratios over DuckDB; F: queries that left the engine, to Polars' CPU engine
or DuckDB). The frames are Polars frames in host memory: device-resident frames are to come.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from decimal import Decimal
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from shardflow import tpch
from shardflow.catalog.types import storage_schema
from shardflow.engine import DuckDBEngine
from shardflow.telemetry.calibration import best_of, calibrate, capacity
from shardflow.telemetry.devices import discover, installed


def same_answer(ours: pa.Table, theirs: pa.Table) -> bool:
    """Same rows in any order; numbers equal to 1e-6 relative, whatever their types."""
    if ours.shape != theirs.shape:
        return False

    def number(v: object) -> bool:
        return isinstance(v, (int, float, Decimal)) and not isinstance(v, bool)

    def rows(table: pa.Table) -> list[tuple[object, ...]]:
        out = [tuple(r.values()) for r in table.to_pylist()]
        return sorted(out, key=lambda r: [f"{float(v):.6e}" if number(v) else repr(v) for v in r])

    for a, b in zip(rows(ours), rows(theirs), strict=True):
        for x, y in zip(a, b, strict=True):
            if number(x) and number(y):
                if not math.isclose(float(x), float(y), rel_tol=1e-6, abs_tol=1e-6):  # type: ignore[arg-type]
                    return False
            elif x != y:
                return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sf", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per query (best)")
    parser.add_argument("--home", type=Path, default=Path(".shardflow-bench"))
    parser.add_argument("--queries", type=str, default="", help="e.g. 1,3,18 (default all)")
    parser.add_argument("--cpu", action="store_true", help="Polars on the CPU, not the GPU")
    parser.add_argument(
        "--resident", action="store_true", help="also over frames kept in the engine's memory"
    )
    parser.add_argument(
        "--executor",
        choices=("in-memory", "streaming"),
        default="in-memory",
        help="cudf-polars' executor (a worker's is in-memory)",
    )
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="also the calibration a worker runs when it joins, with each engine (capacity)",
    )
    args = parser.parse_args()

    if not installed("polars"):
        sys.exit("bench/gpu.py needs Polars: pip install 'shardflow[gpu]' (or polars for --cpu)")
    from shardflow.engine.polars_engine import PolarsEngine, Resident

    device = discover(0)
    gpu = not args.cpu
    if gpu and (device.vendor != "nvidia" or not installed("cudf_polars")):
        print(
            f"note: no NVIDIA GPU with cudf-polars here ({device.vendor}: {device.model});"
            " running Polars on the CPU instead"
        )
        gpu = False

    data = tpch.generate(args.sf, args.home / "tpch")
    tables = {}
    for name, path in tpch.table_paths(data).items():
        table = pq.read_table(path)
        tables[name] = table.cast(storage_schema(table.schema))
    numbers = [int(q) for q in args.queries.split(",") if q] or list(tpch.QUERY_NUMBERS)

    duck = DuckDBEngine(threads=os.cpu_count() or 1)
    polars_engine = PolarsEngine(
        DuckDBEngine(threads=os.cpu_count() or 1), gpu=gpu, executor=args.executor
    )
    label = polars_engine.name + (f" on {device.model} ({args.executor} executor)" if gpu else "")
    print(f"TPC-H SF {args.sf:g}: {label} vs duckdb on {os.cpu_count()} CPU threads")
    kept: dict[str, pa.Table | Resident] = {}
    cache_build_s = 0.0
    if args.resident:
        started = time.perf_counter()
        for name, table in tables.items():
            kept[name] = polars_engine.frames.build(table.to_batches(), table.schema)
        cache_build_s = time.perf_counter() - started
        size = sum(polars_engine.frames.nbytes(f) for f in kept.values() if isinstance(f, Resident))
        print(f"frames kept: {len(kept)} tables, {size / 2**20:.0f} MiB in {cache_build_s:.2f}s")
    inputs: dict[str, pa.Table | Resident] = kept or dict(tables)
    warm_head = f" {'warm ms':>9} {'ratio':>6}" if args.resident else ""
    head = f"{'query':>5} {'polars ms':>10} {'duckdb ms':>10} {'ratio':>6}"
    print(f"{head}{warm_head}  check  fell back")
    ratios, warm_ratios = [], []
    wrong, left = [], 0
    for number in numbers:
        sql = tpch.query(number)
        expected = duck.run(sql, tables)
        result = polars_engine.run(sql, inputs)  # warm-up: JIT, device memory pool
        where = polars_engine.fell_back
        reason = polars_engine.last_fallback if where else ""
        left += bool(where)
        ok = same_answer(result, expected)
        if not ok:
            wrong.append(number)
        if args.resident:
            polars_engine.run(sql, tables)  # the cold path's warm-up
        ours = best_of(args.repeat, lambda q=sql: polars_engine.run(q, tables))
        theirs = best_of(args.repeat, lambda q=sql: duck.run(q, tables))
        ratios.append(ours / theirs)
        warm = ""
        if args.resident:
            kept_s = best_of(args.repeat, lambda q=sql: polars_engine.run(q, inputs))
            warm_ratios.append(kept_s / theirs)
            warm = f" {kept_s * 1000:9.1f} {kept_s / theirs:6.2f}"
        print(
            f"Q{number:02d}  {ours * 1000:10.1f} {theirs * 1000:10.1f} {ours / theirs:6.2f}{warm}"
            f"  {'ok' if ok else 'DIFF':5}  {reason[:150]}"
        )
    if args.calibrate:
        for name, engine in (("duckdb", duck), (polars_engine.name, polars_engine)):
            throughput = calibrate(engine.run)
            rates = " ".join(f"{op}={rate / 1e6:.0f}M/s" for op, rate in throughput.items())
            print(f"calibration {name}: {rates} capacity={capacity(throughput):.2f}")
    total = sum(polars_engine.fallbacks.values())
    print(f"fallbacks: {dict(polars_engine.fallbacks) or 'none'} ({total} calls)")
    if wrong:
        print(f"answers differ from DuckDB on {', '.join(f'Q{n}' for n in wrong)}")
    geomean = geometric_mean(ratios)
    if not args.resident:
        print(f"geometric-mean ratio {polars_engine.name}/duckdb at SF {args.sf:g}: {geomean:.2f}")
        return
    print(
        f"gpu_ratio_warm={geometric_mean(warm_ratios):.2f} gpu_ratio_cold={geomean:.2f}"
        f" answers_equal={len(numbers) - len(wrong)}/{len(numbers)} fallbacks={left}"
        f" cache_build_s={cache_build_s:.2f}"
    )


def geometric_mean(ratios: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(r) for r in ratios))


if __name__ == "__main__":
    main()
