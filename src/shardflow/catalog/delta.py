"""A catalog change as a small document: what one version changed of the version before.

The catalog is persisted as a log of these (``catalog/store.py``) and announced to the
workers as them: a move writes and sends the units it replaced, not the whole catalog. A
change names the version it applies to (``base``); :func:`apply` of :func:`diff` gives
back exactly the newer catalog, the order of its tables, groups and units included.

>>> from shardflow.catalog.model import Catalog
>>> old = Catalog(nodes=("node-0",))
>>> new = old.with_node_added("node-1")
>>> change = diff(old, new)
>>> change["base"], change["version"], change["set"]
(0, 1, {'nodes': ['node-0', 'node-1'], 'next_node_index': 2})
>>> apply(old, change) == new
True
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, TypeVar

from shardflow.catalog.model import Catalog, Group, TableSpec, Unit, with_fields

SCALARS = ("epoch", "n_buckets", "nodes", "next_unit_id", "next_node_index", "excluded")
"""The catalog's fields other than its tables and groups (and its version)."""

V = TypeVar("V")


class ChangeError(ValueError):
    """A change that does not apply to the catalog given (another base version)."""


def diff(old: Catalog, new: Catalog) -> dict[str, Any]:
    """The change that takes ``old`` to ``new`` (``new`` derived from ``old``). Tables and
    groups are compared by identity first: a change costs what it touched, not what the
    catalog holds (a dictionary walk over names, nothing serialised but what changed)."""
    change: dict[str, Any] = {"base": old.version, "version": new.version}
    scalars = {
        name: _plain(getattr(new, name))
        for name in SCALARS
        if getattr(new, name) != getattr(old, name)
    }
    if scalars:
        change["set"] = scalars
    if new.tables is not old.tables:
        tables = _mapping_change(old.tables, new.tables, lambda spec: spec.to_json())
        if tables:
            change["tables"] = tables
    if new.groups is not old.groups:
        groups = _groups_change(old.groups, new.groups)
        if groups:
            change["groups"] = groups
    return change


def apply(catalog: Catalog, change: Mapping[str, Any]) -> Catalog:
    """``catalog`` with ``change`` made; :class:`ChangeError` unless the change was made
    to this very version."""
    if change["base"] != catalog.version:
        raise ChangeError(
            f"a change of version {change['base']} does not apply to version {catalog.version}"
        )
    fields: dict[str, Any] = {"version": change["version"]}
    for name, value in change.get("set", {}).items():
        fields[name] = tuple(value) if isinstance(value, list) else value
    if "tables" in change:
        fields["tables"] = _apply_mapping(
            catalog.tables, change["tables"], lambda data: TableSpec.from_json(data)
        )
    if "groups" in change:
        fields["groups"] = _apply_groups(catalog.groups, change["groups"])
    return with_fields(catalog, **fields)


UNIT_SCALARS = frozenset({"epoch", "next_unit_id"})
"""What a change of units alone sets besides them (a move, split or merge; its plan)."""


def follow(
    view: Catalog, changes: Sequence[Mapping[str, Any]]
) -> tuple[Catalog, list[Mapping[str, Any]]]:
    """A node's ``view`` of the catalog with the changes it is told (:func:`for_node`)
    applied in turn, and those applied: the ones it has already (it was sent the catalog
    whole since) are passed over. :class:`ChangeError` where one was made to another
    version than the view's."""
    applied = []
    for change in changes:
        if change["version"] > view.version:
            view = apply(view, change)
            applied.append(change)
    return view, applied


def shards_touched(view: Catalog, changes: Sequence[Mapping[str, Any]]) -> set[tuple[str, int]]:
    """The shards (table, unit id) ``changes`` give, take or make, as ``view`` (the
    catalog after them) has them: units moved, and every unit of a table put (a new
    table). A dropped table's shards are not in ``view``: its holder looks for them."""
    keys: set[tuple[str, int]] = set()
    for change in changes:
        for group_id, units in change.get("groups", {}).get("units", {}).items():
            ids = [unit[0] for unit in units.get("put", ())]
            ids += [unit_id for unit_id, _ in units.get("drop", ())]
            keys.update(
                (table, unit_id) for table in view.group_tables(group_id) for unit_id in ids
            )
        for data in change.get("tables", {}).get("put", ()):
            spec = view.tables.get(data["name"])
            if spec is not None and spec.group is not None and spec.group in view.groups:
                keys.update((spec.name, unit.unit_id) for unit in view.groups[spec.group].units)
    return keys


def tables_dropped(changes: Sequence[Mapping[str, Any]]) -> set[str]:
    """The tables ``changes`` drop."""
    return {name for change in changes for name in change.get("tables", {}).get("drop", ())}


def touched_nodes(change: Mapping[str, Any]) -> set[str]:
    """The nodes whose units ``change`` gives or takes."""
    nodes: set[str] = set()
    for units in change.get("groups", {}).get("units", {}).values():
        nodes.update(unit[3] for unit in units.get("put", ()))
        nodes.update(node for _, node in units.get("drop", ()))
    return nodes


def concerns_every_node(change: Mapping[str, Any]) -> bool:
    """Whether ``change`` does more than move units between nodes: tables, groups, the
    nodes themselves (every node is told those, whole)."""
    groups = change.get("groups", {})
    return (
        "tables" in change
        or any(key != "units" for key in groups)
        or not set(change.get("set", {})) <= UNIT_SCALARS
    )


def for_node(changes: Sequence[Mapping[str, Any]], node: str) -> list[dict[str, Any]]:
    """``changes`` (one after another, each made to the version before) as ``node`` is
    to be told them: of the units, only those it gains or loses; a run of changes that
    only move units, folded into one (the values they set, and its units). A node's view
    of the catalog is the catalog whole but for units of other nodes, which it never
    reads; applied in turn, these keep it so."""
    told: list[dict[str, Any]] = []
    run: list[Mapping[str, Any]] = []
    for change in changes:
        if concerns_every_node(change):
            if run:
                told.append(_fold(run, node))
                run = []
            told.append(_fold([change], node))
        else:
            run.append(change)
    if run:
        told.append(_fold(run, node))
    return told


def _fold(changes: Sequence[Mapping[str, Any]], node: str) -> dict[str, Any]:
    """One change for ``node`` of ``changes`` (the last may also change tables, groups or
    nodes: those are kept whole)."""
    scalars: dict[str, Any] = {}
    groups: dict[str, dict[str, dict[int, list[Any]]]] = {}
    for change in changes:
        scalars.update(change.get("set", {}))
        for group_id, units in change.get("groups", {}).get("units", {}).items():
            mine = groups.setdefault(group_id, {"put": {}, "drop": {}})
            for unit_id, owner in units.get("drop", ()):
                if owner == node:
                    mine["put"].pop(unit_id, None)
                    mine["drop"][unit_id] = [unit_id, owner]
            for unit in units.get("put", ()):
                if unit[3] == node:
                    mine["put"][unit[0]] = unit
    last = changes[-1]
    folded: dict[str, Any] = {"base": changes[0]["base"], "version": last["version"]}
    if scalars:
        folded["set"] = scalars
    if "tables" in last:
        folded["tables"] = last["tables"]
    kept = {key: value for key, value in last.get("groups", {}).items() if key != "units"}
    units = {
        group_id: {kind: list(entries.values()) for kind, entries in mine.items() if entries}
        for group_id, mine in groups.items()
        if mine["put"] or mine["drop"]
    }
    if units:
        kept["units"] = units
    if kept:
        folded["groups"] = kept
    return folded


# -- tables and groups ---------------------------------------------------------------------
def _mapping_change(old: Mapping[str, V], new: Mapping[str, V], encode: Any) -> dict[str, Any]:
    """Entries put (new or changed, in ``new``'s order) and dropped; the whole order where
    putting them at the end would not give ``new``'s."""
    put = [name for name, value in new.items() if _changed(old.get(name), value)]
    drop = [name for name in old if name not in new]
    change: dict[str, Any] = {}
    if put:
        change["put"] = [encode(new[name]) for name in put]
    if drop:
        change["drop"] = drop
    if _reordered(old, new, put, drop):  # also an entry put again as it was
        change["order"] = list(new)
    return change


def _apply_mapping(old: Mapping[str, V], change: Mapping[str, Any], decode: Any) -> Mapping[str, V]:
    put: dict[str, V] = {}
    for data in change.get("put", ()):
        value = decode(data)
        put[_name_of(value)] = value
    gone = set(change.get("drop", ())) | set(put)
    merged = {name: value for name, value in old.items() if name not in gone}
    merged.update(put)
    if "order" in change:
        merged = {name: merged[name] for name in change["order"]}
    return MappingProxyType(merged)


def _groups_change(old: Mapping[str, Group], new: Mapping[str, Group]) -> dict[str, Any]:
    """New groups whole; a changed group as the units it puts and drops (whole where its
    key family changed or its units' order would not come out the same)."""
    whole: list[str] = []
    units: dict[str, dict[str, Any]] = {}
    for group_id, group in new.items():
        before = old.get(group_id)
        if before is group:
            continue
        if before is None or before.key_family != group.key_family:
            whole.append(group_id)
            continue
        unit_change = _units_change(before, group)
        if unit_change is None:
            whole.append(group_id)
        elif unit_change:
            units[group_id] = unit_change
    drop = [group_id for group_id in old if group_id not in new]
    change: dict[str, Any] = {}
    if whole:
        change["put"] = [_group_json(new[group_id]) for group_id in whole]
    if drop:
        change["drop"] = drop
    if units:
        change["units"] = units
    if _reordered(old, new, whole, drop):
        change["order"] = list(new)
    return change


def _units_change(old: Group, new: Group) -> dict[str, Any] | None:
    """The units ``new`` puts and drops against ``old``; None where applying them would
    not give ``new``'s order of units."""
    before = {unit.unit_id: unit for unit in old.units}
    after = {unit.unit_id for unit in new.units}
    put = [unit for unit in new.units if before.get(unit.unit_id) != unit]
    moved = {unit.unit_id: unit.node for unit in put if unit.unit_id in before}
    left = [  # units leaving their node: gone, or given to another
        unit
        for unit_id, unit in before.items()
        if unit_id not in after or moved.get(unit_id, unit.node) != unit.node
    ]
    if not put and not left:
        return {}
    if _merge_units(old.units, put, [unit.unit_id for unit in left]) != new.units:
        return None
    change: dict[str, Any] = {}
    if put:
        change["put"] = [[u.unit_id, u.lo, u.hi, u.node] for u in put]
    if left:
        change["drop"] = [[u.unit_id, u.node] for u in left]
    return change


def _apply_groups(old: Mapping[str, Group], change: Mapping[str, Any]) -> Mapping[str, Group]:
    whole = {key: value for key, value in change.items() if key != "units"}
    groups = dict(_apply_mapping(old, whole, _group_from_json) if whole else old)
    for group_id, units in change.get("units", {}).items():
        group = groups.get(group_id)
        if group is None:
            raise ChangeError(f"a change of units of group {group_id}, which is not here")
        put = [Unit(*u) for u in units.get("put", ())]
        merged = _merge_units(group.units, put, [unit_id for unit_id, _ in units.get("drop", ())])
        groups[group_id] = Group(group.group_id, group.key_family, merged)
    return MappingProxyType(groups)


def _merge_units(units: Iterable[Unit], put: list[Unit], drop: Iterable[int]) -> tuple[Unit, ...]:
    """Units kept, then put, in bucket order (every catalog keeps a group's so)."""
    gone = set(drop) | {unit.unit_id for unit in put}
    kept = [unit for unit in units if unit.unit_id not in gone]
    return tuple(sorted(kept + put, key=lambda unit: unit.lo))


def _group_json(group: Group) -> dict[str, Any]:
    return {
        "group_id": group.group_id,
        "key_family": group.key_family,
        "units": [[u.unit_id, u.lo, u.hi, u.node] for u in group.units],
    }


def _group_from_json(data: Mapping[str, Any]) -> Group:
    return Group(data["group_id"], data["key_family"], tuple(Unit(*u) for u in data["units"]))


# -- helpers -------------------------------------------------------------------------------
def _changed(before: object, after: object) -> bool:
    return before is not after and before != after


def _reordered(
    old: Mapping[str, Any], new: Mapping[str, Any], put: list[str], drop: list[str]
) -> bool:
    """Whether dropping ``drop`` and ``put`` from ``old`` and adding ``put`` at the end
    gives another order than ``new``'s."""
    gone = set(drop) | set(put)
    expected = [name for name in old if name not in gone] + put
    return expected != list(new)


def _name_of(value: object) -> str:
    if isinstance(value, TableSpec):
        return value.name
    if isinstance(value, Group):
        return value.group_id
    raise TypeError(type(value).__name__)  # pragma: no cover


def _plain(value: object) -> object:
    return list(value) if isinstance(value, tuple) else value
