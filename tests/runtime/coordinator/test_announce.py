"""Catalog changes told to the nodes they concern (``runtime/coordinator/announce.py``):
after a move only its source and target hear of it, with the units they gained or lost;
a node left out catches up when a later move touches it; a node whose catalog is at
another version than the changes were made to is sent the catalog whole. In process,
without Ray: real workers, real DuckDB, real files."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from tests.support.local_cluster import ROWS, LocalCluster, assert_serves, events, orders


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    local = LocalCluster(tmp_path / "data")
    local.create_table("events", events(0, ROWS), "id")
    local.create_table("orders_e", orders(0, ROWS), "oid", colocate_with="events")
    local.controller.broadcast()  # every node's version known
    yield local
    local.close()


def told(cluster: LocalCluster) -> dict[str, list[tuple[str, int]]]:
    """What each worker is told from now on: ("follow", bytes) or ("sync", bytes)."""
    seen: dict[str, list[tuple[str, int]]] = {n: [] for n in cluster.catalog.nodes}
    for node in cluster.catalog.nodes:
        worker = cluster.workers.get(node)
        for name in ("follow", "sync"):
            original = getattr(worker, name)

            def spy(
                message: Any, original: Any = original, name: str = name, node: str = node
            ) -> Any:
                seen[node].append((name, len(json.dumps(message))))
                return original(message)

            setattr(worker, name, spy)
    return seen


def version(cluster: LocalCluster, node: str) -> int:
    return cluster.workers.get(node).node.catalog.version


def test_a_move_is_told_to_its_two_nodes_only(cluster: LocalCluster) -> None:
    seen = told(cluster)
    unit = cluster.units("events")[0]
    nodes = list(cluster.catalog.nodes)
    to = next(n for n in nodes if n != unit.node)
    third = next(n for n in nodes if n not in (unit.node, to))
    before = version(cluster, third)
    assert cluster.migrate(unit.unit_id, to)["phase"] == "done"
    assert seen[third] == [] and version(cluster, third) == before
    for node in (unit.node, to):
        [(kind, size)] = seen[node]
        assert kind == "follow" and size < 300  # the unit, the epoch: not the catalog
        assert version(cluster, node) == cluster.catalog.version
    assert_serves(cluster, events(0, ROWS))

    # the third node, left out, is touched next: it is told both moves, folded
    back = cluster.units("events")[0]
    assert cluster.migrate(back.unit_id, third)["phase"] == "done"
    [(kind, _)] = seen[third]
    assert kind == "follow" and version(cluster, third) == cluster.catalog.version
    held = cluster.workers.get(third).node.shards
    assert ("events", back.unit_id) in held and ("orders_e", back.unit_id) in held
    cluster.insert("events", events(ROWS, 100))
    assert_serves(cluster, pa.concat_tables([events(0, ROWS), events(ROWS, 100)]))


def test_a_node_at_another_version_is_sent_the_catalog_whole(cluster: LocalCluster) -> None:
    """A node's catalog changed behind the coordinator's back (a session sent it a
    newer one, say; here its version put back by one): the changes do not apply to it, it
    answers so (-1) and gets the catalog whole."""
    unit = cluster.units("events")[0]
    to = next(n for n in cluster.catalog.nodes if n != unit.node)
    node = cluster.workers.get(to).node
    node.catalog = dataclasses.replace(node.catalog, version=node.catalog.version - 1)
    seen = told(cluster)
    assert cluster.migrate(unit.unit_id, to)["phase"] == "done"
    assert [kind for kind, _ in seen[to]] == ["follow", "sync"]
    assert node.catalog == cluster.catalog
    assert ("events", unit.unit_id) in node.shards
    assert_serves(cluster, events(0, ROWS))


def test_a_table_created_is_told_as_a_change_to_every_node(cluster: LocalCluster) -> None:
    """A load's shards are served where they were loaded; each node is then told the
    table and its units, not the catalog whole (every node's version is known here)."""
    seen = told(cluster)
    cluster.create_table("more", events(0, ROWS), "id")
    whole = len(json.dumps(cluster.state.catalog_json()))
    for node in cluster.catalog.nodes:
        [(kind, size)] = seen[node]
        assert kind == "follow" and size < whole / 2
        assert version(cluster, node) == cluster.catalog.version
        held = {unit for table, unit in cluster.workers.get(node).node.shards if table == "more"}
        assert held == {u.unit_id for u in cluster.units("more") if u.node == node}
    assert cluster.sql("SELECT count(*) AS n FROM more").column("n")[0].as_py() == ROWS


def test_a_table_dropped_is_told_as_a_change_and_its_shards_go(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    cluster.create_table("more", events(0, ROWS), "id")
    uid = cluster.catalog.table("more").uid
    seen = told(cluster)
    cluster.session.drop_table("more")
    for node in cluster.catalog.nodes:
        assert [kind for kind, _ in seen[node]] == ["follow"]
        assert not any(table == "more" for table, _ in cluster.workers.get(node).node.shards)
    assert not (tmp_path / "data" / "tables" / uid).exists()
    assert_serves(cluster, events(0, ROWS))


def test_a_node_gone_is_told_as_a_change_and_its_units_are_served_again(
    cluster: LocalCluster,
) -> None:
    """A failover: the nodes left are told the change (the node gone, the units it held
    with their new owners), which rebuild those units from the data directory."""
    gone = cluster.units("events")[0].node
    orphans = {u.unit_id for u in cluster.units("events") if u.node == gone}
    seen = told(cluster)
    cluster.workers.stop(gone)
    assert cluster.controller.fail_node(gone) is not None
    assert gone not in cluster.catalog.nodes and seen[gone] == []
    for node in cluster.catalog.nodes:
        assert [kind for kind, _ in seen[node]] == ["follow"]
    for unit in cluster.units("events"):
        if unit.unit_id in orphans:
            assert ("events", unit.unit_id) in cluster.workers.get(unit.node).node.shards
    assert_serves(cluster, events(0, ROWS))
