"""TRUNCATE is all or nothing for readers and writers: the coordinator gives the table new,
empty files and the next commit number, and the nodes switch one after another. Here the
switch is held half done (one node told, the other not yet), the window a query or insert
of a session with the old routing can fall into: the query must answer the table whole or
empty, never one node's half, and a batch inserted across both must stay whole. In
process: real workers, DuckDB, files; ``SHARDFLOW_TEST_UNFENCED=commits`` switches the
workers' commit check off, and these tests must then fail."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardflow.catalog import Catalog
from shardflow.storage.shard_store import UNFENCED_VARIABLE
from tests.support.local_cluster import ROWS, LocalCluster, events

COUNT = "SELECT count(*) AS n FROM events"


@pytest.fixture
def half_told(tmp_path: Path) -> Iterator[tuple[LocalCluster, str, str]]:
    """Two nodes each holding part of ``events``; the truncate committed and told to the
    first node only. Yields the cluster and the two nodes (told, not told yet)."""
    cluster = LocalCluster(tmp_path / "data", nodes=2)
    cluster.create_table("events", events(0, ROWS), "id")
    holders = sorted({u.node for u in cluster.units("events")})
    assert len(holders) == 2, "the test needs the table on both nodes"
    assert cluster.sql(COUNT).column("n")[0].as_py() == ROWS  # the session routes commit 0
    _, old_uid = cluster.state.begin_truncate("events")
    told, behind = holders
    cluster.workers.get(told).sync(cluster.state.catalog_json()).get()
    yield cluster, told, behind
    cluster.state.end_change("events")
    cluster.state.delete_files(old_uid)
    cluster.close()


def tell_later(cluster: LocalCluster, node: str, after_s: float = 0.5) -> threading.Thread:
    """Tell ``node`` of the truncate after a while, as the coordinator's announce would."""

    def tell() -> None:
        threading.Event().wait(after_s)
        cluster.workers.get(node).sync(cluster.state.catalog_json()).get()

    thread = threading.Thread(target=tell, daemon=True)
    thread.start()
    return thread


def test_a_query_half_way_through_a_truncate_sees_the_table_empty_not_half(
    half_told: tuple[LocalCluster, str, str],
) -> None:
    cluster, _, behind = half_told
    stale = cluster.session.catalog.table("events").commit  # the routing the session has
    assert cluster.state.catalog.table("events").commit == stale + 1
    teller = tell_later(cluster, behind)
    answer = cluster.sql(COUNT).column("n")[0].as_py()
    teller.join()
    assert answer == 0  # the first node said Changed: run again whole at the new commit
    assert cluster.session.catalog.table("events").commit == stale + 1


def test_a_batch_inserted_half_way_through_a_truncate_stays_whole(
    half_told: tuple[LocalCluster, str, str],
) -> None:
    cluster, _, behind = half_told
    teller = tell_later(cluster, behind)
    cluster.insert("events", events(ROWS, 1000))  # its rows go to both nodes
    teller.join()
    answer = cluster.sql("SELECT count(*) AS n, min(id) AS low FROM events").to_pylist()
    assert answer == [{"n": 1000, "low": ROWS}]  # none lost with the old files, none twice


def test_the_workers_commit_check_is_what_keeps_them_whole(
    half_told: tuple[LocalCluster, str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fault hook: without the check the stale query reads the told node's new, empty
    files and the other node's old ones, and answers half the table."""
    cluster, _, behind = half_told
    monkeypatch.setenv(UNFENCED_VARIABLE, "commits")
    on_behind = sum(
        cluster.workers.get(behind).node.shards[("events", u.unit_id)].rows
        for u in cluster.units("events")
        if u.node == behind
    )
    assert 0 < on_behind < ROWS
    assert cluster.sql(COUNT).column("n")[0].as_py() == on_behind


def test_a_truncate_waits_for_the_moves_of_its_shards_and_new_ones_wait_for_it(
    tmp_path: Path,
) -> None:
    """A move copies the old files: the truncate waits for it to end, and a move of the
    table's shards asked meanwhile starts once every node serves the new, empty files."""
    cluster = LocalCluster(tmp_path / "data", nodes=2, test_hold_copy_s=1.0)
    try:
        cluster.create_table("events", events(0, ROWS), "id")
        first, second = cluster.units("events")[:2]
        moving = threading.Thread(target=cluster.migrate, args=(first.unit_id, second.node))
        moving.start()
        while not cluster.state.moving:  # the move has begun (its copy is held 1 s)
            threading.Event().wait(0.01)
        emptied: list[int] = []
        truncating = threading.Thread(
            target=lambda: emptied.append(cluster.session.truncate_table("events"))
        )
        truncating.start()
        while ("events", "truncated") not in cluster.state.changing.values():
            threading.Event().wait(0.01)
        order: list[str] = []

        def move_back() -> None:  # asked while the truncate runs: waits for it to end
            cluster.migrate(second.unit_id, first.node)
            order.append("moved after the truncate" if emptied else "moved during it")

        waiting = threading.Thread(target=move_back)
        waiting.start()
        group = cluster.catalog.table("events").group
        while truncating.is_alive() and not cluster.state.waiting_moves[group]:
            threading.Event().wait(0.01)
        moving.join()
        truncating.join()
        waiting.join()
        assert emptied == [ROWS]
        assert order == ["moved after the truncate"]
        assert cluster.units("events")[0].node == second.node  # the first move went through
        assert cluster.catalog.group_of("events").unit(second.unit_id).node == first.node
        cluster.insert("events", events(ROWS, 500))
        assert cluster.sql(COUNT).column("n")[0].as_py() == 500
    finally:
        cluster.close()


def test_a_node_whose_shards_lag_its_catalog_serves_none_of_the_old_files(
    half_told: tuple[LocalCluster, str, str],
) -> None:
    """The node that was not told yet gets the new catalog but keeps its old shards (what
    a move's copy of the old files leaves for a moment): a query or insert at the new
    commit is told ``Moved`` there until the node serves the new files, never reads or
    writes the old ones. Without the check (the fault hook) the old rows are read."""
    cluster, _, behind = half_told
    node = cluster.workers.get(behind).node
    node.catalog = Catalog.from_json(cluster.state.catalog_json())  # its shards not switched
    cluster.session.refresh()
    teller = tell_later(cluster, behind)
    assert cluster.sql(COUNT).column("n")[0].as_py() == 0
    cluster.insert("events", events(ROWS, 1000))
    teller.join()
    assert cluster.sql(COUNT).column("n")[0].as_py() == 1000
