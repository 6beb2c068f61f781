"""The first query after a live move against a warm one, on workers that keep the shards
they serve as the engine's frames (Polars; on a GPU worker the device's memory). A move's
target builds the moved shard's frame before the switch, so the first query after the move
should find it built: within 1.5x of a warm query is the goal (issue 32). For scale, the
first query after the tables are loaded, which builds every frame as it reads, is printed
too. The last line is

    first_after_move_ratio=X cold_ratio=Y moves=M

(X: the median over moves of the first query after a move over the warm query before it;
Y: the first query after the load over a warm one).

    python bench/warm_moves.py --sf 1 --workers 3 --moves 10
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

import shardflow
from shardflow import tpch

QUERY = 6
"""TPC-H Q6: a scan of every lineitem shard, so every move's shard is read."""


def timed(db: shardflow.Database, sql: str) -> float:
    started = time.perf_counter()
    db.sql(sql)
    return time.perf_counter() - started


def warm(db: shardflow.Database, sql: str, runs: int) -> float:
    """The median of ``runs`` queries."""
    return statistics.median(timed(db, sql) for _ in range(runs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sf", type=float, default=0.1)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--moves", type=int, default=6)
    parser.add_argument("--runs", type=int, default=5, help="warm queries per measure")
    parser.add_argument("--query", type=int, default=QUERY, help="the TPC-H query timed")
    parser.add_argument("--home", type=Path, default=Path(".shardflow-bench"))
    args = parser.parse_args()

    data = tpch.generate(args.sf, args.home / "tpch")
    db_dir = args.home / f"warm-moves-sf{args.sf:g}"
    shutil.rmtree(db_dir, ignore_errors=True)
    sql = tpch.query(args.query)
    with shardflow.connect(
        workers=args.workers,
        data_dir=db_dir,
        engine="polars",
        auto_balance=False,
        initial_shard_bytes=0,  # a unit per worker: each has run the query before a move
    ) as db:
        assert isinstance(db, shardflow.Database)
        tpch.load(db, data)
        cold = timed(db, sql)  # every shard's frame is built by this one
        steady = warm(db, sql, args.runs)
        print(
            f"TPC-H SF {args.sf:g} Q{args.query} on {args.workers} Polars workers:"
            f" first after load {cold * 1000:.1f} ms, warm {steady * 1000:.1f} ms"
        )
        print(f"{'move':>4} {'MiB':>7} {'warm ms':>8} {'first ms':>9} {'ratio':>6}  to")
        ratios = []
        for number in range(1, args.moves + 1):
            shards = [s for s in db.cluster.shards().to_pylist() if s["table"] == "lineitem"]
            shard = max(shards, key=lambda s: (s["rows"], str(s["shard"])))
            nodes = sorted(n.node_id for n in db.cluster.nodes() if n.node_id != shard["node"])
            to = nodes[number % len(nodes)]
            before = warm(db, sql, args.runs)
            record = db.cluster.migrate(str(shard["shard"]), to=to)
            first = timed(db, sql)
            ratios.append(first / before)
            print(
                f"{number:4d} {record.bytes / 2**20:7.1f} {before * 1000:8.1f}"
                f" {first * 1000:9.1f} {first / before:6.2f}  {to}"
            )
        kept = [n.device_cache_bytes for n in db.cluster.nodes()]
        hit_rates = [f"{n.device_cache_hit_rate:.2f}" for n in db.cluster.nodes()]
        print(f"frames kept per node: {[b // 2**20 for b in kept]} MiB, hit rates {hit_rates}")
    print(
        f"first_after_move_ratio={statistics.median(ratios):.2f}"
        f" cold_ratio={cold / steady:.2f} moves={len(ratios)}"
    )


if __name__ == "__main__":
    main()
