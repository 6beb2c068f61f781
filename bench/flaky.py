"""A worker that fails 5 % of its fragments (``test_flaky_node``, as a dying GPU would) under
TPC-H readers and an inserter, with shardflow's default failure settings (1 % over a 60 s
window, 100 operations at least): how long until it is suspect, how long until its shards
have all moved off, and how many client operations failed meanwhile (answers are checked
against DuckDB on the same data). The last line is
``flaky_detect_s=X evacuate_s=Y failed_ops=F``.

    python bench/flaky.py --sf 0.1 --workers 4
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pyarrow as pa

import shardflow
from shardflow import tpch
from shardflow.tools.demo import same_rows

MIX = (1, 6, 14, 19)
FLAKY = "node-1"


class Clients:
    """Readers running the TPC-H mix (answers checked) and an inserter of unique ids."""

    def __init__(self, db: shardflow.Database, readers: int, answers: dict[int, pa.Table]) -> None:
        self.db, self.answers = db, answers
        self.stop = threading.Event()
        self.failed: list[str] = []
        self.acked: list[int] = []
        self.queries = 0
        targets = [self._read] * readers + [self._insert]
        self.threads = [threading.Thread(target=t, args=(i,)) for i, t in enumerate(targets)]

    def __enter__(self) -> Clients:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()

    def _read(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set():
            number = rng.choice(MIX)
            try:
                got = self.db.sql(tpch.query(number))
                if not same_rows(got, self.answers[number]):
                    self.failed.append(f"Q{number}: wrong answer")
                self.queries += 1
            except shardflow.Error as error:
                self.failed.append(f"Q{number}: {error!r}")

    def _insert(self, _: int) -> None:
        step = 0
        while not self.stop.is_set():
            ids = list(range(step * 100, step * 100 + 100))
            try:
                self.db.insert("events", pa.table({"id": ids}))
                self.acked += ids
            except shardflow.Error as error:
                self.failed.append(f"insert: {error!r}")
            step += 1
            time.sleep(0.02)


def health(db: shardflow.Database) -> shardflow.NodeInfo:
    return next(n for n in db.cluster.nodes() if n.node_id == FLAKY)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sf", type=float, default=0.1)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--readers", type=int, default=4)
    parser.add_argument("--share", type=float, default=0.05, help="fragments node-1 fails")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="shardflow-flaky-"))
    try:
        data = tpch.generate(args.sf, work / "tpch")
        oracle = tpch.duckdb_oracle(data)
        answers = {n: oracle.sql(tpch.query(n)).to_arrow_table() for n in MIX}
        # every table spread over every worker (small ones would be one shard each, and
        # the flaky node might hold none of what the mix reads: it would never be suspect)
        with shardflow.connect(
            workers=args.workers, data_dir=work / "data",
            test_flaky_node=f"{FLAKY}={args.share}", initial_shard_bytes=0,
        ) as db:  # fmt: skip
            tpch.load(db, data)
            db.create_table("events", pa.table({"id": pa.array([], pa.int64())}),
                            distributed_by="id")  # fmt: skip
            held = health(db).shards
            if not held:
                raise SystemExit(f"{FLAKY} holds no shard: nothing would run on it")
            print(f"{FLAKY} holds {held} shards; load starts")
            started = time.monotonic()
            with Clients(db, args.readers, answers) as clients:
                while health(db).health == "healthy":
                    assert time.monotonic() - started < args.timeout, "never suspect"
                    time.sleep(0.2)
                detect = time.monotonic() - started
                print(f"suspect after {detect:.1f}s: failure rate {health(db).failure_rate:.1%}")
                while health(db).shards > 0:
                    assert time.monotonic() - started < args.timeout, "never evacuated"
                    time.sleep(0.2)
                evacuate = time.monotonic() - started - detect
                time.sleep(2.0)
            moves = [m for m in db.cluster.migrations() if "evacuate" in m.reason]
            got = db.sql("SELECT id FROM events").column("id").to_pylist()
            lost = len(set(clients.acked) - set(got))
            print(f"{len(moves)} evacuating move(s), {clients.queries} queries checked, "
                  f"{len(clients.acked)} rows acknowledged, {lost} lost, "
                  f"{len(got) - len(set(got))} doubled")  # fmt: skip
            for failure in clients.failed[:5]:
                print("failed:", failure)
        print(f"flaky_detect_s={detect:.1f} evacuate_s={evacuate:.1f} "
              f"failed_ops={len(clients.failed) + lost}")  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
