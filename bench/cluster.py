"""A whole-node loss and live moves under load on a real multi-node cluster on this machine:
a head and N data nodes (each its own raylet, object store and workers, all on 127.0.0.1),
shardflow serving on them, an inserter and two readers (one checked against DuckDB) running
while 20 shards move between nodes and a data node is SIGKILLed, then the node the
coordinator runs on. The last line is

    node_loss_recovery_s=X failed_ops=F lost_rows=L moves=M move_failures=K

(X: the slowest recovery, from the kill until every shard answered again). Goal: X <= 10,
F = L = K = 0.

    python bench/cluster.py --nodes 3
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import shardflow
from shardflow.tools.drill import run_drill
from shardflow.tools.localcluster import LocalRayCluster


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3, help="data nodes")
    parser.add_argument("--rows", type=int, default=100_000, help="rows per table at the start")
    parser.add_argument("--moves", type=int, default=20)
    parser.add_argument("--kill", action="append", help="default: ray-2, then coordinator")
    args = parser.parse_args()
    kills = args.kill or ["ray-2", "coordinator"]
    with tempfile.TemporaryDirectory(prefix="shardflow-bench-cluster-") as home:
        data_dir = Path(home) / "data"
        local = LocalRayCluster(data_dir)
        started = time.perf_counter()
        local.up(args.nodes)
        try:
            # the drill's tables are small: spread them anyway, so every node has shards to lose
            db = shardflow.connect(address=local.address, data_dir=data_dir, initial_shard_bytes=0)
            up_s = time.perf_counter() - started
            print(f"cluster: head + {args.nodes} data nodes up in {up_s:.1f}s")
            try:
                report = run_drill(db, local, rows=args.rows, moves=args.moves, kills=kills)
            finally:
                db.close()
        finally:
            local.down()
    for target, seconds in zip(kills, report.recovery_s, strict=False):
        print(f"lost {target}: every shard served again after {seconds:.2f}s")
    print(f"queries answered: {report.queries}, insert batches acknowledged: {report.inserts}")
    print(f"wrong answers: {report.wrong_answers}, duplicated rows: {report.duplicated_rows}")
    for failure in report.failures:
        print(f"failure: {failure}")
    print(report.line())


if __name__ == "__main__":
    main()
