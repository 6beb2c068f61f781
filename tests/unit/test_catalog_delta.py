"""A catalog change (``catalog/delta.py``) applied to the version it was made to gives back
exactly the newer catalog, through JSON, whatever sequence of changes made it: tables
created, replaced and dropped, nodes joining and leaving, units moved, split and merged.
Plain data, random sequences (Hypothesis)."""

from __future__ import annotations

import json
import uuid

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardflow.catalog import Catalog, TableSpec, Unit
from shardflow.catalog.buckets import split_range
from shardflow.catalog.delta import (
    ChangeError,
    apply,
    concerns_every_node,
    diff,
    for_node,
    touched_nodes,
)

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.string())])


def step(catalog: Catalog, op: int, pick: int) -> Catalog:
    """One of the catalog's own transitions, chosen by ``op`` and ``pick``."""
    nodes = list(catalog.nodes)
    tables = [t for t in catalog.tables.values() if t.group is not None]
    if op == 0 or not tables:  # a table in a new group
        catalog, group = catalog.with_new_group(pa.int64(), [nodes[pick % len(nodes)]] * 3)
        name = f"t{catalog.version}"
        return catalog.with_table(
            TableSpec(name, uuid.uuid4().hex, SCHEMA, "distributed", "k", group)
        )
    table = tables[pick % len(tables)]
    group = catalog.groups[str(table.group)]
    unit = group.units[pick % len(group.units)]
    if op == 1:  # a move
        to = nodes[(nodes.index(unit.node) + 1) % len(nodes)] if unit.node in nodes else nodes[0]
        catalog, [new_id] = catalog.with_unit_ids_reserved(1)
        return catalog.with_units_replaced(
            group.group_id, [unit.unit_id], [Unit(new_id, unit.lo, unit.hi, to)]
        )
    if op == 2 and unit.buckets > 1:  # a split
        catalog, ids = catalog.with_unit_ids_reserved(2)
        halves = [
            Unit(i, lo, hi, unit.node)
            for i, (lo, hi) in zip(ids, split_range(unit.lo, unit.hi, 2), strict=True)
        ]
        return catalog.with_units_replaced(group.group_id, [unit.unit_id], halves)
    if op == 3 and len(group.units) > 1:  # a merge of two neighbours
        index = min(pick % len(group.units), len(group.units) - 2)
        low, high = group.units[index], group.units[index + 1]
        catalog, [new_id] = catalog.with_unit_ids_reserved(1)
        return catalog.with_units_replaced(
            group.group_id, [low.unit_id, high.unit_id], [Unit(new_id, low.lo, high.hi, low.node)]
        )
    if op == 4:  # a node joins
        return catalog.with_node_added(f"node-{catalog.next_node_index}")
    if op == 5 and len(nodes) > 1:  # a node leaves: its units get new owners
        gone = nodes[pick % len(nodes)]
        live = [n for n in nodes if n != gone]
        orphans = catalog.orphaned_units(live)
        return catalog.with_nodes(live, {u.unit_id: live[u.unit_id % len(live)] for u in orphans})
    if op == 6:  # rows counted: the spec replaced
        return catalog.with_table(
            TableSpec(table.name, table.uid, SCHEMA, "distributed", "k", table.group, pick)
        )
    if op == 7:
        return catalog.without_table(table.name)
    if op == 8:
        return catalog.with_table(
            TableSpec(f"r{catalog.version}", uuid.uuid4().hex, SCHEMA, "replicated")
        )
    return catalog.with_excluded(nodes[: pick % 2])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 50)), min_size=1, max_size=25))
def test_a_change_applied_gives_the_newer_catalog_exactly(ops: list[tuple[int, int]]) -> None:
    catalog = Catalog(n_buckets=64, nodes=("node-0", "node-1", "node-2"), next_node_index=3)
    for op, pick in ops:
        newer = step(catalog, op, pick)
        change = json.loads(json.dumps(diff(catalog, newer)))
        applied = apply(catalog, change)
        assert applied == newer
        assert json.dumps(applied.to_json()) == json.dumps(newer.to_json())  # orders too
        catalog = newer


def test_a_move_is_a_few_units_whatever_the_catalog_holds() -> None:
    """The change of a move names the units it replaced and the new epoch: its size does
    not grow with the tables and groups the catalog holds; its nodes are the two owners."""
    catalog = Catalog(n_buckets=256, nodes=("node-0", "node-1"), next_node_index=2)
    for _ in range(2000):
        catalog = step(catalog, 0, catalog.version)
    group = next(iter(catalog.groups.values()))
    unit = group.units[0]
    moved = catalog.with_units_replaced(
        group.group_id, [unit.unit_id], [Unit(10**6, unit.lo, unit.hi, "node-1")]
    )
    change = diff(catalog, moved)
    assert len(json.dumps(change)) < 200
    assert touched_nodes(change) == {unit.node, "node-1"}
    assert set(change) == {"base", "version", "set", "groups"}


def test_a_change_applies_to_its_own_base_only() -> None:
    catalog = Catalog(nodes=("node-0",))
    change = diff(catalog, catalog.with_node_added("node-1"))
    with pytest.raises(ChangeError, match="version 0 does not apply to version 1"):
        apply(catalog.with_node_added("node-2"), change)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 9), st.integers(0, 50)), min_size=1, max_size=25),
    st.lists(st.booleans(), min_size=1, max_size=25),
)
def test_a_node_told_only_what_concerns_it_serves_what_the_catalog_gives_it(
    ops: list[tuple[int, int]], told: list[bool]
) -> None:
    """A node is told the changes since it was last told (``for_node``: of the units
    only its own, runs of moves folded), now and then: its view then gives it the same
    shards, tables, nodes and epoch as the catalog, and what it is told of a run of
    moves does not grow with the units of other nodes."""
    catalog = Catalog(n_buckets=64, nodes=("node-0", "node-1", "node-2"), next_node_index=3)
    views = {node: catalog for node in catalog.nodes}
    pending: dict[str, list[dict[str, object]]] = {node: [] for node in catalog.nodes}
    for index, (op, pick) in enumerate(ops):
        newer = step(catalog, op, pick)
        change = json.loads(json.dumps(diff(catalog, newer)))
        catalog = newer
        for node in catalog.nodes:
            if node not in views:  # joined: starts with the catalog whole
                views[node], pending[node] = catalog, []
                continue
            pending[node].append(change)
            if node in touched_nodes(change) or told[(index + len(node)) % len(told)]:
                messages = json.loads(json.dumps(for_node(pending[node], node)))
                for message in messages:
                    if not concerns_every_node(message):
                        for units in message.get("groups", {}).get("units", {}).values():
                            owners = [u[3] for u in units.get("put", ())]
                            owners += [owner for _, owner in units.get("drop", ())]
                            assert set(owners) == {node}
                    views[node] = apply(views[node], message)
                pending[node] = []
        for node in catalog.nodes:
            if not pending[node]:
                view = views[node]
                assert view.version == catalog.version and view.epoch == catalog.epoch
                assert set(view.shards_on(node)) == set(catalog.shards_on(node))
                assert view.tables == catalog.tables and view.nodes == catalog.nodes
