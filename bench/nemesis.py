"""A seeded nemesis against a real multi-node cluster on this machine that survives its head
(``cluster up --ha``: a head, N data nodes, Redis, all on 127.0.0.1): under an inserter and
two readers (one checked against DuckDB, one checking that a count never misses a row
acknowledged before it started), it plays F faults one after another — a data node
SIGKILLed (a new one joins after), a data node SIGSTOPped for 2 s, the head SIGKILLed, a
node whose worker fails 20 % of its fragments joining (recovery: from its first shard until
it is suspect and holds none) — and prints each with its recovery time. The last line is

    faults=N failed_ops=F lost=L dup=D stale_reads=S max_recovery_s=R

Goals: F = L = D = S = 0; the head back to full service within 30 s, any other fault within
10 s.

    python bench/nemesis.py --faults 30 --seed 1
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import shardflow
from shardflow.runtime.ray.local import leave_ray
from shardflow.tools.drill import FLAKY_NODE, NEMESIS_KINDS, run_drill
from shardflow.tools.localcluster import LocalRayCluster


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3, help="data nodes")
    parser.add_argument("--rows", type=int, default=20_000, help="rows per table at the start")
    parser.add_argument("--faults", type=int, default=30)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--nemesis", default=",".join(NEMESIS_KINDS))
    parser.add_argument("--flaky-share", type=float, default=0.2,
                        help="fragments a flaky node's worker fails")  # fmt: skip
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="shardflow-bench-nemesis-") as home:
        data_dir = Path(home) / "data"
        local = LocalRayCluster(data_dir)
        started = time.perf_counter()
        local.up(args.nodes, ha=True)
        try:
            db = shardflow.connect(
                address=local.address, data_dir=data_dir, initial_shard_bytes=0,
                test_flaky_node=f"{FLAKY_NODE}={args.flaky_share}",
            )  # fmt: skip
            print(f"cluster: head (--ha) + {args.nodes} data nodes up in "
                  f"{time.perf_counter() - started:.1f}s")  # fmt: skip
            try:
                report = run_drill(
                    db, local, rows=args.rows, moves=0, faults=args.faults, seed=args.seed,
                    nemesis=[k for k in args.nemesis.split(",") if k],
                )  # fmt: skip
            finally:
                db.close()
                leave_ray()  # before its node stops: a driver dies with its node
        finally:
            local.down()
    by_kind: dict[str, list[float]] = {}
    for fault, seconds in zip(report.faults, report.fault_recovery_s, strict=True):
        by_kind.setdefault(fault.split()[0], []).append(seconds)
    for kind, times in sorted(by_kind.items()):
        print(f"{kind}: {len(times)} fault(s), recovery max {max(times):.2f}s, "
              f"mean {sum(times) / len(times):.2f}s")  # fmt: skip
    print(f"queries answered: {report.queries}, insert batches acknowledged: {report.inserts}")
    for failure in report.failures:
        print(f"failure: {failure}")
    print(report.nemesis_line())


if __name__ == "__main__":
    main()
