"""Start-up time of an embedded cluster: ``connect(workers=N)`` on a new data directory
(every kind of node calibrated once) and again on the same one (calibration reused), and the
first query after it. The last line is ``connect_s=X first_query_ms=Y`` for the warm start.

    python bench/startup.py --workers 4
"""

from __future__ import annotations

import argparse
import tempfile
import time

import pyarrow as pa

import shardflow


def timed_connect(workers: int, data_dir: str) -> tuple[float, float]:
    started = time.perf_counter()
    db = shardflow.connect(workers=workers, data_dir=data_dir)
    connected = time.perf_counter() - started
    try:
        started = time.perf_counter()
        db.sql("SELECT count(*) FROM t")
        first_query = time.perf_counter() - started
    finally:
        db.close()
    return connected, first_query


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3, help="warm starts (best counts)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="shardflow-bench-startup-") as data_dir:
        started = time.perf_counter()
        with shardflow.connect(workers=args.workers, data_dir=data_dir) as db:
            cold = time.perf_counter() - started
            db.create_table("t", pa.table({"id": list(range(10_000))}), distributed_by="id")
        print(f"cold connect (new data directory, calibration measured): {cold:.2f}s")
        warm = [timed_connect(args.workers, data_dir) for _ in range(args.repeat)]
    for i, (connected, first) in enumerate(warm, 1):
        print(f"warm connect {i}: {connected:.2f}s, first query {first * 1000:.0f} ms")
    connected, first = min(warm)
    print(f"connect_s={connected:.2f} first_query_ms={first * 1000:.0f}")


if __name__ == "__main__":
    main()
