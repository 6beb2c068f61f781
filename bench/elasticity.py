"""Zero-downtime scaling, measured in one run on TPC-H: query latency at rest and while
shards migrate continuously; migration throughput beside a plain Arrow IPC copy of the same
data over loopback; the write-fence pause; insert latency; drain time; failover time. The
last line is ``p99_ratio=A fence_p99_ms=B copy_ratio=C insert_p99_ratio=D
loaded_move_s_per_gb=E``: query p99 while migrating over steady, the fence pause's p99, the
copy rate of moves on the idle cluster over plain Arrow IPC, insert p99 while migrating over
steady (an inserter runs in both phases), and seconds per GB a move takes under this load.

While migrating, one lineitem unit moves back and forth between its node and another, one
move after the other (``--gap S``: S seconds between them; each move also waits its turn
under ``migration_share``, ``--share 1`` for none); steady is measured in both of those
placements, half the time each.
So the ratios weigh what moving costs, not what the placement a move leaves costs (a unit
moved to a node that holds more already slows every query that follows, moving or not).

Where a move's time goes is printed before the last line: the CPU the workers spent per GB
moved on the idle cluster (and so the share of the machine the moves took while
migrating), and a move's parts timed alone on the same rows through the workers' own
engine code (the INSERT, the read-out, the hash and the compression), with the copy rate
those parts would allow if nothing else took any time.

    python bench/elasticity.py --sf 1 --workers 4
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import random
import shutil
import signal
import socket
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import shardflow
from shardflow import tpch
from shardflow.catalog.buckets import bucket_of
from shardflow.catalog.types import storage_schema
from shardflow.engine import DuckDBEngine
from shardflow.runtime.worker.moves import CHUNK_ROWS

MIX = (1, 3, 6, 12, 14, 19)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


class Readers:
    """Threads that run the TPC-H mix back to back and record each latency."""

    def __init__(self, db: shardflow.Database, count: int) -> None:
        self.db = db
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(count)]

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set():
            query = tpch.query(rng.choice(MIX))
            started = time.perf_counter()
            try:
                self.db.sql(query)
                self.latencies.append(time.perf_counter() - started)
            except shardflow.Error as error:
                self.failures.append(repr(error))

    def run_for(self, seconds: float) -> list[float]:
        for thread in self.threads:
            thread.start()
        time.sleep(seconds)
        self.stop.set()
        for thread in self.threads:
            thread.join()
        return self.latencies


def _receive(port_queue: multiprocessing.Queue, done: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port_queue.put(server.getsockname()[1])
        connection, _ = server.accept()
        with connection, connection.makefile("rb") as stream:
            table = pa.ipc.open_stream(stream).read_all()
        done.put(table.nbytes)


def ipc_copy_rate(table: pa.Table) -> float:
    """Bytes per second of a plain Arrow IPC stream of ``table`` to another process."""
    context = multiprocessing.get_context("spawn")
    ports, done = context.Queue(), context.Queue()
    child = context.Process(target=_receive, args=(ports, done))
    child.start()
    port = ports.get(timeout=60)
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as connection:
        with connection.makefile("wb") as stream, pa.ipc.new_stream(stream, table.schema) as w:
            w.write_table(table)
    received = done.get(timeout=120)
    elapsed = time.perf_counter() - started
    child.join()
    return float(received) / elapsed


@dataclass(frozen=True)
class CopyParts:
    """What a move's parts take alone, on one DuckDB thread as a worker here runs them,
    with the rows of one unit: each part's seconds, and the CPU seconds of compressing."""

    nbytes: int
    insert_s: float
    """The target's INSERTs of the rows, a chunk at a time."""
    compress_s: float
    """CPU seconds of the checkpoint that compresses them (the copy's first catch-up)."""
    hash_s: float
    """Hashing the stored rows once (the source's pinned snapshot; the target's read-back
    takes as long)."""
    read_s: float
    """Reading them out of the compressed table into Arrow chunks (the source's part)."""

    def ceiling(self) -> float:
        """Bytes per second of a copy phase made of these parts with nothing else: both
        hashes one after the other, reads and INSERTs overlapped perfectly on two cores."""
        return self.nbytes / (2 * self.hash_s + max(self.read_s, self.insert_s))


def copy_parts(rows: pa.Table) -> CopyParts:
    """Time a move's parts one by one through the workers' own engine code: the rows held
    compressed as a source holds them, hashed where stored and read out in a move's chunks,
    INSERTed chunk by chunk into a new table as a target stages them, then compressed."""
    engine = DuckDBEngine(threads=1)
    try:
        source = engine.native_rows("source", rows.schema)
        source.reset([rows])
        source.compact()
        stream = source.stream(CHUNK_ROWS)
        started = time.perf_counter()
        stream.checksum()
        hash_s = time.perf_counter() - started
        chunks: list[pa.Table] = []
        started = time.perf_counter()
        while (chunk := stream.next()) is not None:
            chunks.append(chunk)
        read_s = time.perf_counter() - started
        target = engine.native_rows("target", rows.schema)
        engine.compactor.hold([target.physical])  # as a move's target does while it copies
        started = time.perf_counter()
        for chunk in chunks:
            target.append(chunk)
        insert_s = time.perf_counter() - started
        cpu = time.process_time()
        target.compact()
        compress_s = time.process_time() - cpu
    finally:
        engine.close()
    return CopyParts(rows.nbytes, insert_s, compress_s, hash_s, read_s)


def cpu_seconds(pids: list[int]) -> float:
    """User and system CPU seconds these processes have spent (Linux; NaN elsewhere)."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            return math.nan
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def worker_pids(db: shardflow.Database) -> list[int]:
    return [db._backend.handle.workers.get(n.node_id).pid().get() for n in db.cluster.nodes()]


def lineitem_shards(db: shardflow.Database) -> list[dict[str, object]]:
    return [s for s in db.cluster.shards().to_pylist() if s["table"] == "lineitem"]


def move_one(db: shardflow.Database, rng: random.Random) -> shardflow.MigrationRecord:
    """Migrate a random lineitem unit to another node."""
    shards = lineitem_shards(db)
    shard = rng.choice(shards)
    nodes = [n.node_id for n in db.cluster.nodes() if n.node_id != shard["node"]]
    return db.cluster.migrate(str(shard["shard"]), to=rng.choice(nodes))


def placed(db: shardflow.Database, shard: str) -> str:
    return next(str(s["node"]) for s in db.cluster.shards().to_pylist() if s["shard"] == shard)


def pick_shuttle(db: shardflow.Database) -> tuple[str, str, str]:
    """The largest lineitem unit, its node and the node that holds the fewest units: the
    migrating phase moves it back and forth between the two."""
    shards = lineitem_shards(db)
    largest = max(shards, key=lambda s: (s["rows"], str(s["shard"])))
    held = {n.node_id: 0 for n in db.cluster.nodes()}
    for s in shards:
        held[str(s["node"])] += 1
    home = str(largest["node"])
    away = min((n for n in held if n != home), key=lambda n: (held[n], n))
    return str(largest["shard"]), home, away


def move_some(db: shardflow.Database, count: int) -> list[shardflow.MigrationRecord]:
    """``count`` moves on an idle cluster, one after another (the copy rate's measure)."""
    rng = random.Random(3)
    return [move_one(db, rng) for _ in range(count)]


def rates(moves: list[shardflow.MigrationRecord]) -> list[float]:
    """Copy phase bytes per second of each move."""
    return [m.bytes / m.phase_seconds["copy"] for m in moves if m.phase_seconds.get("copy")]


def unit_rows(data: Path, lo: int, hi: int, n_buckets: int) -> pa.Table:
    """The lineitem rows of one bucket range: the data a migration of that unit copies."""
    lineitem = pq.read_table(data / "lineitem.parquet")
    lineitem = lineitem.cast(storage_schema(lineitem.schema))
    buckets = bucket_of(lineitem.column("l_orderkey"), n_buckets)
    unit = lineitem.filter(pa.array((buckets >= lo) & (buckets < hi)))
    if unit.num_rows == 0:
        raise SystemExit(f"no lineitem rows in buckets [{lo}, {hi}) of {n_buckets}")
    return unit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sf", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--readers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=20.0, help="per measured phase")
    parser.add_argument(
        "--gap", type=float, default=0.0, help="seconds between two moves while migrating"
    )
    parser.add_argument(
        "--bandwidth", type=float, default=0.0, help="migration bandwidth cap in MB/s (0: none)"
    )
    parser.add_argument(
        "--share",
        type=float,
        default=None,
        help="migration_share: the time moves may take while queries run (default: the "
        "setting's default; 1.0: moves back to back, unpaced)",
    )
    parser.add_argument(
        "--idle-moves", type=int, default=5, help="moves on the idle cluster (the copy rate)"
    )
    parser.add_argument("--home", type=Path, default=Path(".shardflow-bench"))
    args = parser.parse_args()

    data = tpch.generate(args.sf, args.home / "tpch")
    db_dir = args.home / f"elastic-sf{args.sf:g}"
    shutil.rmtree(db_dir, ignore_errors=True)
    with shardflow.connect(
        workers=args.workers,
        data_dir=db_dir,
        auto_balance=False,
        migration_bandwidth_mb_s=args.bandwidth,
        **({} if args.share is None else {"migration_share": args.share}),
    ) as db:
        tpch.load(db, data)
        db.create_table("events", pa.table({"id": pa.array([], pa.int64())}), distributed_by="id")
        for number in MIX:
            db.sql(tpch.query(number))  # plans cached, everything warm
        pids = worker_pids(db)
        cpu_before = cpu_seconds(pids)
        idle_moves = move_some(db, args.idle_moves)
        idle_cpu_per_gb = (cpu_seconds(pids) - cpu_before) / (
            sum(m.bytes for m in idle_moves) / 1e9
        )
        # the plain copy is timed right after the idle moves, on the same idle cluster
        # (timed at the end, it once measured a fifth of its rate here in two runs)
        lo_hi = next(s for s in db.cluster.shards().to_pylist() if s["table"] == "lineitem")
        n_buckets = db._session_or_raise().whole().n_buckets  # the data directory's own count
        same_data = unit_rows(data, int(lo_hi["bucket_lo"]), int(lo_hi["bucket_hi"]), n_buckets)
        ipc_rate = ipc_copy_rate(same_data)
        parts = copy_parts(same_data)
        del same_data

        moves: list[shardflow.MigrationRecord] = []
        steady_inserts: list[float] = []
        insert_waits: list[float] = []
        next_ids = iter(range(0, 1 << 62, 100))
        stop = threading.Event()

        def inserter(waits: list[float]) -> None:
            while not stop.is_set():
                first = next(next_ids)
                batch = pa.table({"id": pa.array(range(first, first + 100), pa.int64())})
                started = time.perf_counter()
                db.insert("events", batch)
                waits.append(time.perf_counter() - started)
                time.sleep(0.005)

        shard, home, away = pick_shuttle(db)
        steady: list[float] = []
        for placement in ("home", "away"):  # the two placements the moves go between
            if placement == "away":
                db.cluster.migrate(shard, to=away)
            steady_inserter = threading.Thread(target=inserter, args=(steady_inserts,))
            steady_inserter.start()
            steady += Readers(db, args.readers).run_for(args.seconds / 2)
            stop.set()
            steady_inserter.join()
            stop.clear()

        def mover() -> None:
            while not stop.is_set():
                moves.append(
                    db.cluster.migrate(shard, to=away if placed(db, shard) == home else home)
                )
                stop.wait(args.gap)

        helpers = [
            threading.Thread(target=mover),
            threading.Thread(target=inserter, args=(insert_waits,)),
        ]
        for helper in helpers:
            helper.start()
        migrating_readers = Readers(db, args.readers)
        migrating = migrating_readers.run_for(args.seconds)
        stop.set()
        for helper in helpers:
            helper.join()

        copy_rates = rates(moves)
        idle_rates = rates(idle_moves)
        fences = [m.fence_seconds for m in moves]
        sample = max(moves, key=lambda m: m.bytes)

        started = time.perf_counter()
        drained = db.cluster.drain("node-1", deadline=600)
        drain_seconds = time.perf_counter() - started

        # the node holding most of lineitem dies; the count must come back whole
        rows_on: Counter[str] = Counter()
        for held in lineitem_shards(db):
            rows_on[str(held["node"])] += int(str(held["rows"]))
        victim = rows_on.most_common(1)[0][0]
        count = "SELECT count(*) AS n FROM lineitem"
        before = db.sql(count).to_pylist()
        pid = db._backend.handle.workers.get(victim).pid().get()
        killed = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        after = db.sql(count).to_pylist()  # returns once every shard is served again
        failover_seconds = time.perf_counter() - killed
        detected = db.cluster.failovers()

    p50s, p99s = percentile(steady, 50), percentile(steady, 99)
    p50m, p99m = percentile(migrating, 50), percentile(migrating, 99)
    print(f"TPC-H SF {args.sf:g}, {args.workers} workers, {args.readers} readers, mix {MIX}")
    print(f"steady:    {len(steady)} queries, p50 {p50s * 1000:.0f} ms, p99 {p99s * 1000:.0f} ms")
    print(
        f"migrating: {len(migrating)} queries, p50 {p50m * 1000:.0f} ms, p99 "
        f"{p99m * 1000:.0f} ms, {len(moves)} migrations "
        f"({sum(m.phase == 'done' for m in moves)} done), failed queries "
        f"{len(migrating_readers.failures)}"
    )
    print(f"p50 ratio {p50m / p50s:.2f}, p99 ratio {p99m / p99s:.2f}")
    if idle_rates:
        print(
            f"migration copy throughput idle (median of {len(idle_rates)}) "
            f"{statistics.median(idle_rates) / 1e6:.0f} MB/s, under the readers' load "
            f"{statistics.median(copy_rates or [math.nan]) / 1e6:.0f} MB/s; largest move "
            f"{sample.bytes / 1e6:.0f} MB in {sample.seconds:.2f} s; plain Arrow IPC over "
            f"loopback of one unit's lineitem rows {ipc_rate / 1e6:.0f} MB/s"
        )
    print(
        f"write fence pause p50 {percentile(fences, 50) * 1000:.0f} ms, p99 "
        f"{percentile(fences, 99) * 1000:.0f} ms, max {max(fences, default=0) * 1000:.0f} ms;"
        f" insert latency p99 {percentile(insert_waits, 99) * 1000:.0f} ms, max "
        f"{max(insert_waits, default=0) * 1000:.0f} ms over {len(insert_waits)} inserts"
    )
    idle_fences = [m.fence_seconds for m in idle_moves]
    print(
        f"  idle ({len(idle_fences)} moves): fence pause p50 "
        f"{percentile(idle_fences, 50) * 1000:.0f} ms, max "
        f"{max(idle_fences, default=0) * 1000:.0f} ms"
    )
    print(
        "  within the fence, p50/p99 ms: "
        + ", ".join(
            f"{phase} {percentile(spent, 50) * 1000:.0f}/{percentile(spent, 99) * 1000:.0f}"
            for phase in ("fence", "verify", "switch")
            for spent in [[m.phase_seconds.get(phase, 0.0) for m in moves]]
        )
    )
    spans = [sum(m.phase_seconds.get(p, 0.0) for p in ("fence", "verify", "switch")) for m in moves]
    print(
        f"  the coordinator's span of it (FENCE to CLEANUP: its call to the target and the "
        f"target's to the source come before any writer waits): p50 "
        f"{percentile(spans, 50) * 1000:.0f} ms, "
        f"p99 {percentile(spans, 99) * 1000:.0f} ms"
    )
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    moved_gb = sum(m.bytes for m in moves) / 1e9
    print(
        f"where a move's time goes: idle moves took {idle_cpu_per_gb:.1f} CPU-seconds of the "
        f"workers per GB moved; while migrating, {moved_gb:.2f} GB moved in {args.seconds:g} s "
        f"took about {idle_cpu_per_gb * moved_gb / args.seconds / (cores or 1):.0%} of this "
        f"machine's {cores} cores from the readers"
    )
    mb = parts.nbytes / 1e6
    print(
        f"  its parts alone on one DuckDB thread, {mb:.0f} MB: INSERT "
        f"{mb / parts.insert_s:.0f} MB/s, read out {mb / parts.read_s:.0f} MB/s, hash "
        f"{mb / parts.hash_s:.0f} MB/s (twice a move), compress {parts.compress_s:.2f} CPU-s;"
        f" a copy of nothing but them could reach {parts.ceiling() / 1e6:.0f} MB/s "
        f"({parts.ceiling() / ipc_rate:.2f} of plain IPC)"
    )
    print(f"drain of a node holding {len(drained)} unit(s): {drain_seconds:.2f} s")
    print(
        f"failover: {victim} killed, to every shard served again {failover_seconds:.2f} s"
        + (
            f" (coordinator: detected and reassigned in {detected[0]['seconds']:.2f} s)"
            if detected
            else ""
        )
        + f"; lineitem's count {'the same' if after == before else f'{after} against {before}'}"
    )
    done = [m for m in moves if m.phase == "done" and m.bytes > 0]
    per_gb = statistics.median(m.seconds / (m.bytes / 1e9) for m in done) if done else math.nan
    copy_ratio = statistics.median(idle_rates) / ipc_rate if idle_rates else math.nan
    steady_p99 = percentile(steady_inserts, 99)
    print(
        f"insert latency p99 steady {steady_p99 * 1000:.0f} ms, while migrating "
        f"{percentile(insert_waits, 99) * 1000:.0f} ms; a move under load "
        f"{per_gb:.1f} s per GB (median of {len(done)})"
    )
    print(
        f"p99_ratio={p99m / p99s:.2f} fence_p99_ms={percentile(fences, 99) * 1000:.0f} "
        f"copy_ratio={copy_ratio:.2f} "
        f"insert_p99_ratio={percentile(insert_waits, 99) / steady_p99:.2f} "
        f"loaded_move_s_per_gb={per_gb:.1f}"
    )


if __name__ == "__main__":
    main()
