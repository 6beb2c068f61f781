"""Moves yield to the foreground (``migration_share``): while queries run, a move waits
until the one before it fits the share of the time; on a cluster nobody uses, and for a
drain, moves go back to back; a move waiting for its turn can be cancelled. In process: real
workers, DuckDB, files, and the sessions' reports of their queries."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.local_cluster import ROWS, LocalCluster, events

SHARE = 0.25


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    local = LocalCluster(tmp_path / "data", migration_share=SHARE)
    local.create_table("events", events(0, ROWS), "id")
    yield local
    local.close()


class Queries:
    """Queries back to back on a thread (their outcomes reach the coordinator)."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.stop = threading.Event()
        self.answers: list[int] = []
        self.thread = threading.Thread(target=self._run, args=(cluster,))

    def _run(self, cluster: LocalCluster) -> None:
        while not self.stop.is_set():
            self.answers.append(cluster.sql("SELECT count(*) AS n FROM events")["n"][0].as_py())

    def __enter__(self) -> Queries:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.answers and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.4)  # the session's first report has reached the coordinator
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def shuttle(cluster: LocalCluster, count: int) -> list[dict[str, Any]]:
    """Move the first unit of events to another node and back, ``count`` moves."""
    unit = cluster.units("events")[0]
    nodes = sorted(cluster.catalog.nodes)
    records = []
    for _ in range(count):
        at = next(u.node for u in cluster.units("events") if u.unit_id == unit.unit_id)
        records.append(cluster.migrate(unit.unit_id, next(n for n in nodes if n != at)))
    return records


def test_while_queries_run_each_move_waits_until_the_one_before_fits_the_share(
    cluster: LocalCluster,
) -> None:
    with Queries(cluster) as queries:
        first, second, third = shuttle(cluster, 3)
    assert "paced" not in first["phase_seconds"]  # nothing moved before it
    for before, after in ((first, second), (second, third)):
        assert after["outcome"].startswith("done")
        ended = before["started_at"] + before["seconds"]
        # it began no sooner than the move before it, seen as SHARE of the time, allows
        least = before["seconds"] * (1 - SHARE) / SHARE
        assert after["phase_seconds"]["paced"] >= least * 0.9
        assert after["started_at"] - ended >= least * 0.9
    assert set(queries.answers) == {ROWS}  # every query whole throughout


def test_on_a_cluster_nobody_uses_moves_go_back_to_back(cluster: LocalCluster) -> None:
    records = shuttle(cluster, 3)
    assert all(r["outcome"].startswith("done") for r in records)
    assert not any("paced" in r["phase_seconds"] for r in records)


def test_a_drains_moves_never_wait_and_a_waiting_move_can_be_cancelled(
    cluster: LocalCluster,
) -> None:
    migrator = cluster.controller.migrator
    with Queries(cluster):
        shuttle(cluster, 1)  # the next move has to wait its turn
        unit = cluster.units("events")[1]
        to = next(n for n in sorted(cluster.catalog.nodes) if n != unit.node)
        outcome: dict[str, Any] = {}
        mover = threading.Thread(
            target=lambda: outcome.update(record=cluster.migrate(unit.unit_id, to))
        )
        mover.start()
        deadline = time.monotonic() + 10
        while not migrator._waiting and time.monotonic() < deadline:
            time.sleep(0.01)
        (move_id,) = list(migrator._waiting)
        assert cluster.session.cancel(move_id)["phase"] == "precheck"  # as it stands
        mover.join(30)
        assert outcome["record"]["outcome"].startswith("cancelled")
        assert next(u.node for u in cluster.units("events") if u.unit_id == unit.unit_id) == (
            unit.node
        )
        held = [u.node for u in cluster.units("events")]
        drained = max(sorted(set(held)), key=held.count)
        report = cluster.session.drain(drained, 60)
    assert report.drained and report.moved
    assert not any("paced" in m["phase_seconds"] for m in report.moved)
