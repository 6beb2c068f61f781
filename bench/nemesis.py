"""A seeded nemesis against real multi-node clusters on this machine, in two parts, under an
inserter and two readers (one checked against DuckDB, one checking that a count never misses
a row acknowledged before it started):

1. a cluster that survives its head (``cluster up --ha``: a head, N data nodes, Redis, all on
   127.0.0.1): a data node SIGKILLed (a new one joins after), a data node SIGSTOPped for 2 s,
   the head SIGKILLed, a node whose worker fails 20 % of its fragments joining (recovery:
   from its first shard until it is suspect and holds none);
2. (root, Linux: skipped elsewhere) a cluster whose Ray nodes each run in a network namespace
   of their own, its data directory a tmpfs of 512 MiB, the drill in the clients' namespace:
   the network cut (a data node from the head and the coordinator, the client from a data
   node, one way), the data directory full for 3 s, and kills and pauses again.

Each fault is printed with its recovery time. The last line sums both parts:

    faults=N failed_ops=F lost=L dup=D stale_reads=S max_recovery_s=R

Goals: F = L = D = S = 0; the head back to full service within 30 s, any other fault within
10 s.

    python bench/nemesis.py --faults 20 --network-faults 12 --seed 1
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import shardflow
from shardflow.runtime.ray.local import leave_ray
from shardflow.tools import netns
from shardflow.tools.drill import DISK, FLAKY, FLAKY_NODE, HEAD, PARTITION, DrillReport, run_drill
from shardflow.tools.localcluster import LocalRayCluster

HEAD_KINDS = ("kill", "pause", HEAD, FLAKY)
NETWORK_KINDS = ("kill", "pause", PARTITION, DISK)
SMALL_DISK = "512m"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3, help="data nodes")
    parser.add_argument("--rows", type=int, default=20_000, help="rows per table at the start")
    parser.add_argument("--faults", type=int, default=20, help="faults of the first part")
    parser.add_argument("--network-faults", type=int, default=12,
                        help="faults of the second part (0: skip it)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--nemesis", default=",".join(HEAD_KINDS), help="the first part's")
    parser.add_argument("--network-nemesis", default=",".join(NETWORK_KINDS),
                        help="the second part's")  # fmt: skip
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
    parts = [report]
    if args.network_faults:
        why = netns.available()
        if why is None:
            parts.append(network_part(args))
        else:
            print(f"the second part is skipped: {why}")
    by_kind: dict[str, list[float]] = {}
    for part in parts:
        for fault, seconds in zip(part.faults, part.fault_recovery_s, strict=True):
            by_kind.setdefault(fault.split()[0], []).append(seconds)
    for kind, times in sorted(by_kind.items()):
        print(f"{kind}: {len(times)} fault(s), recovery max {max(times):.2f}s, "
              f"mean {sum(times) / len(times):.2f}s")  # fmt: skip
    print(f"queries answered: {sum(p.queries for p in parts)}, insert batches acknowledged: "
          f"{sum(p.inserts for p in parts)}, refused meanwhile (disk full): "
          f"{sum(p.refused_inserts for p in parts)}")  # fmt: skip
    for failure in [f for p in parts for f in p.failures]:
        print(f"failure: {failure}")
    total = DrillReport(
        failed_ops=sum(p.failed_ops for p in parts),
        lost_rows=sum(p.lost_rows for p in parts),
        duplicated_rows=sum(p.duplicated_rows for p in parts),
        stale_reads=sum(p.stale_reads for p in parts),
        faults=[f for p in parts for f in p.faults],
        fault_recovery_s=[r for p in parts for r in p.fault_recovery_s],
    )
    print(total.nemesis_line())


def network_part(args: argparse.Namespace) -> DrillReport:
    """The second part: a cluster in network namespaces on a small tmpfs, the drill in its
    clients' namespace (a process of its own there)."""
    with tempfile.TemporaryDirectory(prefix="shardflow-bench-nemesis-net-") as home:
        disk = Path(home) / "disk"
        disk.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SMALL_DISK}", "sf-bench",
                        str(disk)], check=True)  # fmt: skip
        try:
            local = LocalRayCluster(disk / "data")
            started = time.perf_counter()
            local.up(args.nodes, network=True)
            print(f"cluster: head + {args.nodes} data nodes in network namespaces, the data "
                  f"directory on a tmpfs of {SMALL_DISK}, up in "
                  f"{time.perf_counter() - started:.1f}s")  # fmt: skip
            try:
                drill = subprocess.run(
                    local.client_command([
                        sys.executable, "-m", "shardflow.drill", "--address", local.address,
                        "--data-dir", local.data_dir, "--rows", str(args.rows), "--moves", "0",
                        "--nemesis", args.network_nemesis, "--faults", str(args.network_faults),
                        "--seed", str(args.seed)]),
                    capture_output=True, text=True, check=False,
                )  # fmt: skip
            finally:
                local.down()
        finally:
            subprocess.run(["umount", "-l", str(disk)], check=True)
    for line in drill.stdout.splitlines():
        if line.startswith("fault "):
            print(line)
    found = [line for line in drill.stdout.splitlines() if line.startswith("RESULT ")]
    if drill.returncode != 0 or not found:
        raise SystemExit(f"the drill failed:\n{drill.stderr[-4000:]}")
    return DrillReport(**json.loads(found[0][len("RESULT ") :]))


if __name__ == "__main__":
    main()
