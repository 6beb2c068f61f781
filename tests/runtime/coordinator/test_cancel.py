"""An operator stops a move: ``cancel`` rolls a running move back in the middle of its copy
(the copy stops at its next chunk), the source serves every row throughout, the target keeps
nothing, the move ends ``cancelled`` and is counted so; a move that ended is refused. The
balancer can be paused and resumed at run time. In process: real workers, DuckDB, files.
(A split is cancelled here: it copies rows, cut by bucket, chunk by chunk; a plain move
opens the unit's files and has no copy to stop.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from shardflow.config import Settings
from shardflow.errors import ConfigError, MoveRefusedError
from shardflow.runtime.worker import moves
from tests.support.local_cluster import ROWS, LocalCluster, assert_serves, events


@pytest.fixture
def slow_moves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalCluster]:
    """A cluster whose moves copy small chunks at 50 KB/s: a copy lasts seconds."""
    monkeypatch.setattr(moves, "CHUNK_ROWS", 500)
    local = LocalCluster(tmp_path / "data", migration_bandwidth_mb_s=0.05)
    local.create_table("events", events(0, ROWS), "id")
    yield local
    local.close()


def running_move(cluster: LocalCluster, phase: str, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for state in list(cluster.controller.migrator.history):
            if not state.done and state.phase.value == phase:
                return state.plan.move_id
        time.sleep(0.02)
    raise AssertionError(f"no move reached {phase}")


def test_a_split_cancelled_during_its_copy_rolls_back_and_loses_nothing(
    slow_moves: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = slow_moves
    staged: list[int] = []
    stage = moves.TargetSide._stage

    def counted(side: moves.TargetSide, move: moves.Import, *args: Any) -> int:
        staged.append(1)
        return stage(side, move, *args)

    monkeypatch.setattr(moves.TargetSide, "_stage", counted)
    unit = cluster.units("events")[0]
    chunks = -(-cluster.workers.get(unit.node).node.shards[("events", unit.unit_id)].rows // 500)
    to = next(n for n in cluster.catalog.nodes if n != unit.node)
    units_before = len(cluster.units("events"))
    outcome: dict[str, Any] = {}

    def move() -> None:
        outcome["record"] = cluster.split(unit.unit_id)

    acked: list[pa.Table] = []
    stop = threading.Event()

    def insert() -> None:  # the source takes writes throughout
        start = ROWS
        while not stop.is_set():
            cluster.insert("events", events(start, 20))
            acked.append(events(start, 20))
            start += 20

    mover, inserter = threading.Thread(target=move), threading.Thread(target=insert)
    mover.start()
    inserter.start()
    move_id = running_move(cluster, "copy")
    cancelled = cluster.session.cancel(move_id)
    mover.join(timeout=60)
    stop.set()
    inserter.join(timeout=60)
    assert cancelled["move_id"] == move_id and cancelled["phase"] == "copy"
    record = outcome["record"]
    assert record["phase"] == "rolled_back" and record["outcome"].startswith("cancelled"), record
    assert chunks > 4 and len(staged) < chunks / 2, f"the copy went on: {len(staged)}/{chunks}"
    assert cluster.catalog.group_of("events").unit(unit.unit_id).node == unit.node
    assert len(cluster.units("events")) == units_before
    for node in cluster.catalog.nodes:
        assert not cluster.workers.get(node).node.target.imports
    assert acked, "no insert landed while the move ran"
    assert_serves(cluster, pa.concat_tables([events(0, ROWS), *acked]))
    assert cluster.moves_counted("split", "cancelled") == 1
    assert cluster.moves_counted("split", "rolled_back") == 0
    with pytest.raises(MoveRefusedError, match="ended already"):
        cluster.session.cancel(move_id)
    with pytest.raises(MoveRefusedError, match="no move"):
        cluster.session.cancel("m-nonesuch")
    # and a move not cancelled still goes through
    assert cluster.migrate(unit.unit_id, to)["phase"] == "done"


def test_the_balancer_is_paused_resumed_and_held_to_its_hours(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path / "data", balance_hours="22-2")
    try:
        controller = cluster.controller
        assert not any(controller.may_balance(h) for h in range(24))  # auto_balance is off
        controller.settings = controller.settings.replace(auto_balance=True)
        assert [h for h in range(24) if controller.may_balance(h)] == [0, 1, 2, 22, 23]
        assert cluster.session.pause_balancer(True) is False
        assert controller.balancer_paused.is_set() and not controller.may_balance(23)
        assert cluster.session.pause_balancer(True) is True
        assert cluster.session.pause_balancer(False) is True
        assert not controller.balancer_paused.is_set() and controller.may_balance(23)
    finally:
        cluster.close()


@pytest.mark.parametrize("window", ["25", "a-b", "1-", "-3", "3--4"])
def test_a_bad_balancing_window_is_refused(window: str) -> None:
    with pytest.raises(ConfigError, match="balance_hours"):
        Settings(balance_hours=window)


def test_a_drain_is_cancelled_between_its_moves_and_its_node_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator stops a drain: it starts no more moves, the node stays and serves what
    it still holds (and every row is served), a second cancel finds nothing to stop, and
    the drain run again empties the node."""
    cluster = LocalCluster(tmp_path / "data")
    try:
        cluster.create_table("events", events(0, ROWS), "id")
        node = cluster.units("events")[0].node
        while len([u for u in cluster.units("events") if u.node == node]) < 3:
            mine = max(
                (u for u in cluster.units("events") if u.node == node), key=lambda u: u.hi - u.lo
            )
            assert cluster.split(mine.unit_id)["phase"] == "done"
        moved: list[dict[str, Any]] = []
        first, go_on = threading.Event(), threading.Event()
        run_move = cluster.controller.run_move

        def held_after_each(plan: Any) -> dict[str, Any]:
            result = run_move(plan)
            moved.append(result)
            first.set()
            go_on.wait(30)  # the cancel lands between this move and the next
            return result

        monkeypatch.setattr(cluster.controller, "run_move", held_after_each)
        drained: dict[str, Any] = {}
        drainer = threading.Thread(target=lambda: drained.update(r=cluster.session.drain(node, 60)))
        drainer.start()
        assert first.wait(30), "the drain made no move"
        assert cluster.session.cancel_drain(node) is True
        go_on.set()
        drainer.join(60)
        report = drained["r"]
        assert report.cancelled and not report.drained and "cancelled" in report.reason
        assert len(moved) == 1 and report.remaining >= 2, (len(moved), report)
        assert node in cluster.catalog.nodes
        assert_serves(cluster, events(0, ROWS))
        assert cluster.session.cancel_drain(node) is False  # none runs now
        monkeypatch.setattr(cluster.controller, "run_move", run_move)
        again = cluster.session.drain(node, 60)
        assert again.drained and node not in cluster.catalog.nodes
        assert_serves(cluster, events(0, ROWS))
    finally:
        cluster.close()
