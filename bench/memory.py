"""Memory of a loaded cluster beside DuckDB holding the same rows: TPC-H ``lineitem`` and
``orders`` loaded on N workers, the resident memory of every shardflow process (workers and
coordinator; Ray's own processes listed apart), against one DuckDB process holding the two
tables in memory. The last line is ``rss_ratio=X`` (shardflow's processes over DuckDB's).

    python bench/memory.py --sf 1 --workers 4
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import shardflow
from shardflow import tpch
from shardflow.tools.localcluster import descendants

TABLES = ("lineitem", "orders")
DUCKDB_HOLDS = """
import sys, duckdb
con = duckdb.connect(":memory:")
for name, path in zip(sys.argv[1::2], sys.argv[2::2]):
    con.execute(f"CREATE TABLE {name} AS SELECT * FROM read_parquet('{path}')")
print(open("/proc/self/status").read().split("VmRSS:")[1].split()[0])
"""


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (Linux), 0 when it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return int(status.split("VmRSS:")[1].split()[0]) * 1024


def breakdown(pid: int) -> str:
    """Resident memory by kind: private, file-backed (libraries), shared (Ray's object
    store is shared memory mapped into the processes that read it)."""
    status = Path(f"/proc/{pid}/status").read_text()
    kinds = ("RssAnon", "RssFile", "RssShmem")
    found = {k: int(status.split(f"{k}:")[1].split()[0]) * 1024 for k in kinds if k in status}
    return ", ".join(f"{k} {gib(v)}" for k, v in found.items())


def duckdb_rss(paths: dict[str, Path]) -> int:
    args = [arg for name in TABLES for arg in (name, str(paths[name]))]
    out = subprocess.run(
        [sys.executable, "-c", DUCKDB_HOLDS, *args], capture_output=True, text=True, check=True
    )
    return int(out.stdout.split()[-1]) * 1024


def gib(value: int) -> str:
    return f"{value / (1 << 30):.2f} GiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sf", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--home", type=Path, default=Path(".shardflow-bench"))
    args = parser.parse_args()
    data = tpch.generate(args.sf, args.home / f"tpch-sf{args.sf:g}")
    with tempfile.TemporaryDirectory(prefix="shardflow-bench-memory-") as data_dir:
        with shardflow.connect(workers=args.workers, data_dir=data_dir) as db:
            tpch.load(db, data, tables=TABLES, progress=True)
            gc.collect()
            time.sleep(2)  # let the workers release what the load held
            handle = db._backend.handle
            workers = {node: handle.workers.get(node).pid().get() for node in handle.workers.known}
            coordinator = handle.coordinator.pid().get()
            ours = {f"{node} (pid {pid})": rss_bytes(pid) for node, pid in workers.items()}
            for node, pid in workers.items():
                print(node, breakdown(pid))
            ours["coordinator"] = rss_bytes(coordinator)
            ray_rest = sum(
                rss_bytes(pid)
                for pid in descendants(os.getpid())
                if pid not in workers.values() and pid != coordinator
            )
            nodes = db.cluster.nodes()
    for what, value in ours.items():
        print(f"{what}: {gib(value)}")
    for n in sorted(nodes, key=lambda n: n.node_id):
        print(
            f"{n.node_id}: resident {gib(n.memory_used_bytes)}, DuckDB {gib(n.engine_memory_bytes)}"
            f" (limit {gib(n.memory_limit_bytes)}, spilled {gib(n.spilled_bytes)}), "
            f"shards {gib(n.bytes)}"
        )
    shardflow_rss = sum(ours.values())
    print(f"shardflow processes: {gib(shardflow_rss)}; Ray's other processes: {gib(ray_rest)}")
    theirs = duckdb_rss(tpch.table_paths(data))
    print(f"one DuckDB process holding {' + '.join(TABLES)}: {gib(theirs)}")
    print(f"rss_ratio={shardflow_rss / theirs:.2f}")


if __name__ == "__main__":
    main()
