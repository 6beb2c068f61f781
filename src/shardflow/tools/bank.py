"""The bank workload: accounts spread over every shard of a table, clients moving money
between two accounts at a time with one ``UPDATE`` each (the two accounts mostly on
different shards, often on different nodes), and readers summing every balance. A
transfer is all or nothing across shards and a read sees it on every shard or on none, so
every sum equals the money the bank opened with, whatever the cluster does meanwhile
(units moved and split, a worker killed): a sum that differs is a torn read or a half
applied transfer, counted as ``wrong``.

``tests/cluster/test_bank.py`` runs it short under moves, splits and a worker's SIGKILL;
``bench/dml.py`` runs it longer and prints its figures.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa

from shardflow.api import Database
from shardflow.errors import Error

TABLE = "accounts"
OPENING_BALANCE = 1_000
TRANSFER = (
    f"UPDATE {TABLE} SET balance = balance + CASE WHEN id = ? THEN ? ELSE ? END WHERE id IN (?, ?)"
)
TOTAL = f"SELECT sum(balance) AS total, count(*) AS n FROM {TABLE}"


@dataclass
class BankReport:
    """What the clients saw."""

    accounts: int
    total: int
    """The money the bank opened with: every read must sum to it."""
    transfers: int = 0
    failed_transfers: int = 0
    """Transfers that raised (each all or nothing: the reads say whether any was half)."""
    reads: int = 0
    failed_reads: int = 0
    wrong: int = 0
    """Reads whose sum (or count of accounts) was not the bank's."""
    wrong_sums: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (
            f"bank_transfers={self.transfers} bank_failed={self.failed_transfers} "
            f"bank_reads={self.reads} bank_failed_reads={self.failed_reads} "
            f"bank_wrong={self.wrong}"
        )


def open_bank(db: Database, accounts: int) -> BankReport:
    """Make the accounts table (distributed by ``id``, so over every shard), each account
    holding :data:`OPENING_BALANCE`."""
    ids = pa.array(range(accounts), pa.int64())
    balances = pa.array([OPENING_BALANCE] * accounts, pa.int64())
    db.create_table(TABLE, pa.table({"id": ids, "balance": balances}), distributed_by="id")
    return BankReport(accounts, accounts * OPENING_BALANCE)


def run_bank(
    db: Database,
    report: BankReport,
    seconds: float,
    *,
    transferers: int = 2,
    readers: int = 1,
    seed: int = 0,
    meanwhile: Callable[[threading.Event], object] | None = None,
    at_least: int = 0,
) -> BankReport:
    """Move money and sum it for ``seconds`` with ``transferers`` and ``readers`` client
    threads; ``meanwhile`` runs beside them (it is given the event that ends the run: it
    moves units, kills a worker, ...). With ``at_least``, the run goes on past ``seconds``
    (up to four times as long) until that many transfers and reads each were made: on a
    busy machine a fixed time may hold too few to say anything. Answers ``report`` filled
    in."""
    stop = threading.Event()
    lock = threading.Lock()

    def transfer(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        while not stop.is_set():
            a, b = rng.sample(range(report.accounts), 2)
            amount = rng.randint(1, 50)
            try:
                db.sql(TRANSFER, [a, -amount, amount, a, b])
                with lock:
                    report.transfers += 1
            except Error as error:
                with lock:
                    report.failed_transfers += 1
                    report.errors.append(f"transfer: {type(error).__name__}: {error}")

    def read() -> None:
        while not stop.is_set():
            try:
                found = db.sql(TOTAL).to_pylist()[0]
            except Error as error:
                with lock:
                    report.failed_reads += 1
                    report.errors.append(f"read: {type(error).__name__}: {error}")
                continue
            with lock:
                report.reads += 1
                if found["total"] != report.total or found["n"] != report.accounts:
                    report.wrong += 1
                    report.wrong_sums.append(int(found["total"] or 0))

    threads = [threading.Thread(target=transfer, args=(i,)) for i in range(transferers)]
    threads += [threading.Thread(target=read) for _ in range(readers)]
    if meanwhile is not None:
        threads.append(threading.Thread(target=meanwhile, args=(stop,)))
    for thread in threads:
        thread.start()
    try:
        stop.wait(seconds)
        deadline = time.monotonic() + 3 * seconds
        while min(report.transfers, report.reads) < at_least and time.monotonic() < deadline:
            stop.wait(0.2)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    return report


def check_total(db: Database, report: BankReport) -> bool:
    """Whether the accounts sum to the bank's money now (after recovery, say)."""
    found = db.sql(TOTAL).to_pylist()[0]
    return bool(found["total"] == report.total and found["n"] == report.accounts)
