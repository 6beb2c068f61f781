"""DELETE and UPDATE beside DuckDB in process on the same TPC-H rows: a DELETE of 10 % of
lineitem and an UPDATE of 10 % of orders, each timed on both sides (their counts checked
equal); key deletes (``DELETE FROM orders WHERE o_orderkey = ?``) with 4 client threads;
then the bank workload (``shardflow.tools.bank``) with a unit of the accounts moved every
second meanwhile.

The last line is ``delete_key_qps_4=A bulk_delete_ratio=B update_ratio=C bank_reads=N
bank_wrong=W`` (B, C: shardflow's time over DuckDB's; W: reads of the bank whose sum was
not the bank's money, which must be 0).

    python bench/dml.py --sf 1 --workers 4
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import duckdb

import shardflow
from shardflow import tpch
from shardflow.tools.bank import check_total, open_bank, run_bank

BULK_DELETE = "DELETE FROM lineitem WHERE l_orderkey % 10 = 0"
UPDATE = "UPDATE orders SET o_comment = upper(o_comment) WHERE o_orderkey % 10 = 1"


def timed(what: str, db: shardflow.Database, oracle: duckdb.DuckDBPyConnection, sql: str) -> float:
    """shardflow's time over DuckDB's for ``sql``; the counts must be equal."""
    started = time.perf_counter()
    ours = db.sql(sql).column("count")[0].as_py()
    mine = time.perf_counter() - started
    started = time.perf_counter()
    theirs = oracle.execute(sql).fetchall()[0][0]
    duck = time.perf_counter() - started
    assert ours == theirs, f"{what}: shardflow changed {ours} rows, DuckDB {theirs}"
    print(f"{what}: {ours} rows, shardflow {mine:.2f} s, DuckDB {duck:.3f} s", flush=True)
    return mine / duck


def key_deletes(db: shardflow.Database, orders: int, clients: int, seconds: float) -> float:
    """Key deletes per second of ``clients`` threads, each deleting keys of its own."""
    keys = itertools.count(7)  # order keys from the top of a block of 32 (TPC-H keeps 8)
    lock = threading.Lock()
    done = [0] * clients
    stop = threading.Event()

    def client(index: int) -> None:
        while not stop.is_set():
            with lock:
                k = next(keys) * 32 % (orders * 4)
            db.sql("DELETE FROM orders WHERE o_orderkey = ?", [k + 1])
            done[index] += 1

    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(client, i) for i in range(clients)]
        time.sleep(1.0)  # warm
        before = sum(done)
        started = time.perf_counter()
        time.sleep(seconds)
        counted = sum(done) - before
        elapsed = time.perf_counter() - started
        stop.set()
        for future in futures:
            future.result()
    return counted / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sf", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0, help="key deletes, and the bank")
    parser.add_argument("--home", type=Path, default=Path(".shardflow-bench"))
    args = parser.parse_args()
    data = tpch.generate(args.sf, args.home / f"tpch-sf{args.sf:g}")
    oracle = tpch.duckdb_oracle(data)
    orders = oracle.sql("SELECT count(*) FROM orders").fetchall()[0][0]
    with tempfile.TemporaryDirectory(prefix="shardflow-bench-dml-") as data_dir:
        with shardflow.connect(workers=args.workers, data_dir=data_dir) as db:
            tpch.load(db, data, key_index=("orders",))
            bulk = timed("DELETE of 10 % of lineitem", db, oracle, BULK_DELETE)
            update = timed("UPDATE of 10 % of orders", db, oracle, UPDATE)
            qps = key_deletes(db, orders, 4, args.seconds)
            print(f"key deletes, 4 clients: {qps:.1f} statements/s", flush=True)
            bank = open_bank(db, 1000)

            def move_accounts(stop: threading.Event) -> None:
                while not stop.wait(1.0):
                    shards = [
                        s for s in db.cluster.shards().to_pylist() if s["table"] == "accounts"
                    ]
                    nodes = sorted({str(s["node"]) for s in db.cluster.shards().to_pylist()})
                    shard = shards[int(time.time()) % len(shards)]
                    to = next((n for n in nodes if n != shard["node"]), None)
                    if to is not None:
                        try:
                            db.cluster.migrate(str(shard["shard"]), to=to)
                        except shardflow.MoveRefusedError as error:
                            print(f"  bank: move refused: {error}")

            run_bank(db, bank, args.seconds, transferers=2, readers=2, meanwhile=move_accounts)
            assert check_total(db, bank), "the bank's money after the run"
            print(bank.line(), flush=True)
            for error in bank.errors[:5]:
                print(f"  bank: {error}")
    oracle.close()
    print(
        f"delete_key_qps_4={qps:.1f} bulk_delete_ratio={bulk:.2f} update_ratio={update:.2f} "
        f"bank_reads={bank.reads} bank_wrong={bank.wrong}"
    )


if __name__ == "__main__":
    main()
