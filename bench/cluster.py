"""A whole-node loss and live moves under load on a real multi-node cluster on this machine:
a head and N data nodes (each its own raylet, object store and workers, all on 127.0.0.1),
shardflow serving on them, an inserter and two readers (one checked against DuckDB) running
while 20 shards move between nodes and a data node is SIGKILLed, then the node the
coordinator runs on. The last line is

    node_loss_recovery_s=X failed_ops=F lost_rows=L moves=M move_failures=K

(X: the slowest recovery, from the kill until every shard answered again). Goal: X <= 10,
F = L = K = 0.

    python bench/cluster.py --nodes 3

With ``--sf`` (repeatable) it measures instead how long a failover takes as the data grows:
TPC-H lineitem and orders at that scale factor loaded on a fresh cluster, the data node
holding most of lineitem SIGKILLed, the time until ``count(*)`` over lineitem answers whole
again (its shards opened by their new owners from their checkpoint files and logs). The
last line is ``failover_s_sf1=X failover_s_sf10=Y`` (one figure per ``--sf``).

    python bench/cluster.py --sf 1 --sf 10
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import shardflow
from shardflow import tpch
from shardflow.tools.drill import run_drill
from shardflow.tools.localcluster import LocalRayCluster

FAILOVER_TABLES = ("lineitem", "orders")
FAILOVER_TIMEOUT_S = 600.0


def failover_seconds(sf: float, nodes: int, tpch_home: Path, home: Path) -> float:
    """Load TPC-H lineitem and orders at ``sf`` on a fresh cluster, SIGKILL the data node
    holding most of lineitem (never the coordinator's), and time until lineitem's count
    answers whole again."""
    paths = tpch.table_paths(tpch.generate(sf, tpch_home))
    data_dir = home / f"data-{sf:g}"
    local = LocalRayCluster(data_dir)
    local.up(nodes)
    try:
        db = shardflow.connect(address=local.address, data_dir=data_dir)
        try:
            started = time.perf_counter()
            for layout in tpch.LAYOUT:
                if layout.name in FAILOVER_TABLES:
                    db.create_table(
                        layout.name,
                        str(paths[layout.name]),
                        distributed_by=layout.distributed_by,
                        colocate_with=layout.colocate_with,
                    )
            print(f"SF {sf:g}: loaded in {time.perf_counter() - started:.1f}s")
            count = "SELECT count(*) AS n, sum(l_quantity) AS q FROM lineitem"
            expected = db.sql(count).to_pylist()
            host = db.cluster.coordinator_host()
            ray_node = {n.node_id: n.ray_node_id for n in db.cluster.nodes() if n.alive}
            held: dict[str, int] = {}
            for shard in db.cluster.shards().to_pylist():
                if shard["table"] == "lineitem":
                    ray_id = ray_node.get(str(shard["node"]), "")
                    held[ray_id] = held.get(ray_id, 0) + int(shard["rows"])
            candidates = [n for n in local.nodes() if not n.head and n.node_id != host]
            victim = max(candidates, key=lambda n: held.get(n.node_id, 0))
            lost = held.get(victim.node_id, 0)
            killed = time.perf_counter()
            local.remove_node(victim.name, kill=True)
            while True:  # a query returns once every shard is served again
                if db.sql(count).to_pylist() == expected:
                    break
                if time.perf_counter() - killed > FAILOVER_TIMEOUT_S:
                    raise RuntimeError(f"SF {sf:g}: lineitem not whole after the failover")
            seconds = time.perf_counter() - killed
            print(
                f"SF {sf:g}: {victim.name} killed holding {lost} lineitem rows; lineitem "
                f"whole again after {seconds:.2f}s"
            )
            return seconds
        finally:
            db.close()
    finally:
        local.down()


def failover_main(scales: list[float], nodes: int, tpch_home: Path) -> None:
    """One scale here; several, each in a process of its own (a Ray driver stays bound to
    the first cluster it joined), their figures on one last line."""
    if len(scales) == 1:
        with tempfile.TemporaryDirectory(prefix="shardflow-bench-failover-") as home:
            seconds = failover_seconds(scales[0], nodes, tpch_home, Path(home))
        print(f"failover_s_sf{scales[0]:g}={seconds:.2f}")
        return
    figures = []
    for sf in scales:
        command = [sys.executable, __file__, "--sf", str(sf), "--nodes", str(nodes)]
        command += ["--tpch-home", str(tpch_home)]
        run = subprocess.run(command, capture_output=True, text=True, check=False)
        lines = run.stdout.strip().splitlines()
        print("\n".join(lines[:-1]))
        if run.returncode != 0 or not lines:
            raise SystemExit(f"SF {sf:g} failed:\n{run.stdout}{run.stderr[-4000:]}")
        figures.append(lines[-1])
    print(" ".join(figures))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3, help="data nodes")
    parser.add_argument("--rows", type=int, default=100_000, help="rows per table at the start")
    parser.add_argument("--moves", type=int, default=20)
    parser.add_argument("--kill", action="append", help="default: ray-2, then coordinator")
    parser.add_argument(
        "--sf", type=float, action="append", help="measure failover at this TPC-H scale instead"
    )
    parser.add_argument(
        "--tpch-home", type=Path, default=Path(".shardflow-bench"), help="TPC-H data, kept"
    )
    args = parser.parse_args()
    if args.sf:
        failover_main(args.sf, args.nodes, args.tpch_home)
        return
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
