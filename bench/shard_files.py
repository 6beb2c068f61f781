"""What a shard's durable form costs to ship and to serve again: today's Parquet base, rebuilt
into DuckDB row by row, against a DuckDB database file that the engine opens as it is.

One shard's worth of TPC-H ``lineitem`` (the whole table at the given scale factor) is held
as a worker holds it (a native table in an in-memory DuckDB database), then:

* ``parquet``: written as today's base (Parquet, lz4), and served again by reading it back
  into a new in-memory database (what a restart, a failover and a move's target do now);
* ``duckdb``: written as a DuckDB database file (checkpointed), copied as bytes (what a
  move or a restart would ship), and served again by attaching the copy read-only (nothing
  decoded) or by copying its table into memory.

For each: seconds to write, bytes on disk, seconds to copy the bytes, seconds until a first
query answers, and the seconds of a scan-heavy query (TPC-H Q1) on the result, warm. The last
line is ``attach_vs_reload=X copy_vs_reencode=Y q1_attached_vs_memory=Z``: the time until a
shard serves again by attaching a copied DuckDB file over the time to reload its Parquet
base; the time to copy the file's bytes over the time today's move spends decoding and
re-encoding the same rows; Q1 on the attached file over Q1 in memory.

    python bench/shard_files.py --sf 1
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import duckdb

from shardflow import tpch

Q1 = """
SELECT l_returnflag, l_linestatus, sum(l_quantity), sum(l_extendedprice),
       sum(l_extendedprice * (1 - l_discount)), avg(l_discount), count(*)
FROM {t} WHERE l_shipdate <= DATE '1998-09-02'
GROUP BY l_returnflag, l_linestatus ORDER BY l_returnflag, l_linestatus
"""


def timed(work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def best(work: Callable[[], object], runs: int = 3) -> float:
    return min(timed(work) for _ in range(runs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sf", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    data = tpch.generate(args.sf, Path(tempfile.gettempdir()) / f"shardflow-tpch-sf{args.sf:g}")
    source = tpch.table_paths(data)["lineitem"]
    with tempfile.TemporaryDirectory(prefix="shardflow-bench-files-") as home:
        folder = Path(home)
        con = duckdb.connect(config={"threads": args.threads})
        con.execute("ATTACH ':memory:' AS shard")
        con.execute(f"CREATE TABLE shard.t AS SELECT * FROM read_parquet('{source}')")
        con.execute("CHECKPOINT shard")  # compressed, as the worker's compactor leaves it
        rows = con.execute("SELECT count(*) FROM shard.t").fetchall()[0][0]
        q1_memory = best(lambda: con.execute(Q1.format(t="shard.t")).fetchall())
        print(f"lineitem SF {args.sf:g}: {rows:,} rows held in memory; Q1 {q1_memory:.3f}s")

        # today: the base as Parquet, and a restart reading it back into memory
        base = folder / "base.parquet"
        write_parquet = timed(lambda: con.execute(
            f"COPY shard.t TO '{base}' (FORMAT parquet, COMPRESSION lz4)"))  # fmt: skip

        def reload() -> None:
            con.execute("ATTACH ':memory:' AS again")
            con.execute(f"CREATE TABLE again.t AS SELECT * FROM read_parquet('{base}')")
            con.execute("CHECKPOINT again")  # compressed, as the compactor does after a load

        reload_s = timed(reload)
        con.execute("DETACH again")

        def reencode() -> None:  # a move today: rows out of the source, into the target
            moved = con.sql("SELECT * FROM shard.t").to_arrow_table()
            con.execute("ATTACH ':memory:' AS target")
            con.register("moved", moved)
            con.execute("CREATE TABLE target.t AS SELECT * FROM moved")
            con.execute("CHECKPOINT target")  # compressed again, as the compactor does
            con.unregister("moved")

        reencode_s = timed(reencode)
        con.execute("DETACH target")

        # the engine's own file: written once, shipped as bytes, opened as it is
        checkpoint = folder / "base.duckdb"

        def write_file() -> None:
            con.execute(f"ATTACH '{checkpoint}' AS file")
            con.execute("CREATE TABLE file.t AS SELECT * FROM shard.t")
            con.execute("DETACH file")  # checkpointed and closed

        write_duckdb = timed(write_file)
        shipped = folder / "shipped.duckdb"
        copy_s = timed(lambda: shutil.copyfile(checkpoint, shipped))

        def attach() -> None:
            con.execute(f"ATTACH '{shipped}' AS attached (READ_ONLY)")
            con.execute("SELECT count(*) FROM attached.t").fetchall()

        attach_s = timed(attach)
        q1_cold = timed(lambda: con.execute(Q1.format(t="attached.t")).fetchall())
        q1_attached = best(lambda: con.execute(Q1.format(t="attached.t")).fetchall())

        def into_memory() -> None:
            con.execute("ATTACH ':memory:' AS copied")
            con.execute("CREATE TABLE copied.t AS SELECT * FROM attached.t")

        into_memory_s = timed(into_memory)
        parquet_mb = base.stat().st_size / 1e6
        duckdb_mb = checkpoint.stat().st_size / 1e6
        print(f"parquet base: written {write_parquet:.2f}s, {parquet_mb:.0f} MB; "
              f"a restart reloads it in {reload_s:.2f}s")  # fmt: skip
        print(f"a move today (rows out, in, compressed again): {reencode_s:.2f}s")
        print(f"duckdb file: written {write_duckdb:.2f}s, {duckdb_mb:.0f} MB; bytes copied in "
              f"{copy_s:.2f}s ({duckdb_mb / max(copy_s, 1e-9):.0f} MB/s); attached and "
              f"answering in {attach_s:.3f}s; its table copied into memory in "
              f"{into_memory_s:.2f}s")  # fmt: skip
        print(f"Q1: in memory {q1_memory:.3f}s, on the attached file {q1_attached:.3f}s warm, "
              f"{q1_cold:.3f}s cold")  # fmt: skip
        con.close()
    print(f"attach_vs_reload={(copy_s + attach_s) / reload_s:.3f} "
          f"copy_vs_reencode={copy_s / reencode_s:.3f} "
          f"q1_attached_vs_memory={q1_attached / q1_memory:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
