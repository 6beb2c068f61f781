"""The bank workload on a real Ray cluster (``shardflow.tools.bank``): transfers between
accounts on different shards, each one ``UPDATE`` all or nothing, readers summing every
balance, while units move and split and a worker is SIGKILLed. Every sum must be the money
the bank opened with, during the run and after recovery. Broken on purpose
(``SHARDFLOW_TEST_UNFENCED=commits``: the workers serve fragments of an older commit), the
readers see transfers half applied and the test fails."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

import shardflow
from shardflow.tools.bank import check_total, open_bank, run_bank

pytestmark = pytest.mark.cluster

ACCOUNTS = 400


def shards(db: shardflow.Database) -> list[dict[str, object]]:
    return [s for s in db.cluster.shards().to_pylist() if s["table"] == "accounts"]


def test_no_read_sees_money_made_or_lost_while_shards_move_split_and_a_worker_dies(
    tmp_path: Path,
) -> None:
    with shardflow.connect(
        workers=3, data_dir=tmp_path / "data", auto_balance=False, initial_shard_bytes=0
    ) as db:
        report = open_bank(db, ACCOUNTS)
        killed: list[str] = []

        def meanwhile(stop: threading.Event) -> None:
            """Move a unit, split one, kill a worker, move again: each retried while a
            transfer holds the table's shards (a move waits for none: it is refused)."""
            steps = ["move", "split", "kill", "move"]
            while steps and not stop.is_set():
                stop.wait(1.0)
                step = steps[0]
                placed = shards(db)
                try:
                    if step == "kill":
                        victim = str(placed[-1]["node"])
                        pid = db._backend.handle.workers.get(victim).pid().get()
                        os.kill(pid, signal.SIGKILL)
                        killed.append(victim)
                    elif step == "split":
                        db.cluster.split(str(placed[0]["shard"]))
                    else:
                        alive = sorted(n.node_id for n in db.cluster.nodes() if n.alive)
                        to = next(n for n in alive if n != placed[0]["node"])  # after the
                        # kill every shard may sit on one node: any other live one takes it
                        db.cluster.migrate(str(placed[0]["shard"]), to=to)
                except shardflow.MoveRefusedError:
                    continue  # a transfer was running: try again
                steps.pop(0)

        run_bank(db, report, seconds=14, transferers=2, readers=2, meanwhile=meanwhile, at_least=21)
        assert killed, "the worker was killed during the run"
        assert report.transfers > 20, report.errors[-5:]
        assert report.reads > 20, report.errors[-5:]
        assert report.wrong == 0, (report.wrong_sums[:10], report.total)
        assert check_total(db, report)
        moved = [m for m in db.cluster.migrations() if m.phase == "done"]
        assert {m.kind for m in moved} >= {"move", "split"}
