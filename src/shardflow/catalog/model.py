"""The catalog: tables, co-location groups, placement units and the routing epoch.

A distributed table hashes its key into ``n_buckets`` virtual buckets. Tables in one
co-location *group* share the group's *units*: a unit is a contiguous bucket range owned by
one node, and every table of the group has one shard per unit. A shard is therefore named
by ``(table, unit_id)``; moving a unit moves the shards of every table in the group together,
which keeps joins on the key local. A replicated table has a full copy on every node.

All of it is immutable plain data: every change returns a new :class:`Catalog` with a
higher ``version``; every ownership change also bumps the routing ``epoch``.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import gc
import itertools
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, NamedTuple

import numpy as np
import pyarrow as pa

from shardflow.catalog.buckets import key_family, split_range
from shardflow.catalog.grants import SHARED, Grant
from shardflow.catalog.names import duplicate_names, find_name, name_key
from shardflow.errors import TableError, TableExistsError

TableKind = Literal["distributed", "replicated"]
ROUND_ROBIN = ""
"""The ``key`` of a distributed table without a distribution column (rows spread evenly)."""


def _node_order(node: str) -> tuple[int, str]:
    """node-2 before node-10."""
    tail = node.rsplit("-", 1)[-1]
    return (int(tail), node) if tail.isdigit() else (1 << 30, node)


@dataclass(frozen=True)
class Unit:
    """A bucket range ``[lo, hi)`` of a co-location group, owned by one node."""

    unit_id: int
    lo: int
    hi: int
    node: str

    @property
    def buckets(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class Group:
    """Tables whose shards with equal bucket ranges always live on the same node."""

    group_id: str
    key_family: str
    units: tuple[Unit, ...]

    def unit(self, unit_id: int) -> Unit:
        for unit in self.units:
            if unit.unit_id == unit_id:
                return unit
        raise KeyError(f"group {self.group_id} has no unit {unit_id}")

    def owners_of(self, buckets: np.ndarray) -> np.ndarray:
        """The unit_id owning each bucket (units are kept in bucket order and cover every
        bucket once, so a search over their upper bounds finds it whatever the count)."""
        highs, ids = self._bounds
        return ids[np.searchsorted(highs, buckets, side="right")]

    @functools.cached_property
    def _bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """The units' upper bounds and ids, made once per group (every insert routes by
        them; a group of 100,000 units took milliseconds to make them again)."""
        highs = np.fromiter((unit.hi for unit in self.units), np.int64, len(self.units))
        ids = np.fromiter((unit.unit_id for unit in self.units), np.int64, len(self.units))
        return highs, ids


CHANGES_KEPT = 256
"""Committed changes of rows a table's record keeps (:attr:`TableSpec.changes`)."""


class RowChange(NamedTuple):
    """A committed statement that changed a table's rows."""

    commit: int
    """The table's commit number it made."""
    statement: str
    """Its id (the client's, as batch ids are for inserts)."""
    rows: int
    """The rows it changed."""


@dataclass(frozen=True)
class TableSpec:
    """A table: its schema, how it is distributed, and where its files live (``uid``)."""

    name: str
    uid: str
    schema: pa.Schema
    kind: TableKind
    key: str | None = None
    group: str | None = None
    rows: int = 0
    key_index: bool = False
    """Whether every shard keeps an index on ``key`` (``create_table(key_index=True)``)."""
    grants: tuple[Grant, ...] = SHARED
    """Who else may do what with it (:mod:`shardflow.catalog.grants`)."""
    commit: int = 0
    """The table's commit number, one up each time its rows are changed otherwise than by
    adding to them (``TRUNCATE`` gives it new, empty files). A table starts at the catalog
    version it was made at, past every commit number a table of its name had before. A
    query reads every table at the commit its routing had, on every worker, or is run
    again (``Changed``)."""
    changes: tuple[RowChange, ...] = ()
    """The latest statements that changed its rows (``DELETE``, ``UPDATE``), newest last
    (at most :data:`CHANGES_KEPT`): a shard holding a prepared change applies it once its
    statement is here, and a statement retried with its id is answered from here."""

    @property
    def distributed(self) -> bool:
        return self.kind == "distributed"

    @property
    def round_robin(self) -> bool:
        return self.kind == "distributed" and self.key == ROUND_ROBIN

    def find_column(self, name: str) -> pa.Field | None:
        """The column ``name`` refers to under DuckDB's rule (:func:`name_key`), or None."""
        found = find_name(self.schema.names, name)
        return self.schema.field(found) if found is not None else None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "uid": self.uid,
            "schema": base64.b64encode(self.schema.serialize().to_pybytes()).decode(),
            "kind": self.kind,
            "key": self.key,
            "group": self.group,
            "rows": self.rows,
            "key_index": self.key_index,
            "grants": [list(grant) for grant in self.grants],
            "commit": self.commit,
            "changes": [list(change) for change in self.changes],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TableSpec:
        schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(data["schema"])))
        return cls(
            data["name"],
            data["uid"],
            schema,
            data["kind"],
            data["key"],
            data["group"],
            data.get("rows", 0),
            data.get("key_index", False),
            tuple(tuple(g) for g in data["grants"]) if "grants" in data else SHARED,
            data.get("commit", 0),
            tuple(RowChange(*change) for change in data.get("changes", ())),
        )

    def change(self, statement: str) -> RowChange | None:
        """The committed change of rows made by ``statement``, if it is one kept."""
        return next((c for c in self.changes if c.statement == statement), None)


@dataclass(frozen=True)
class ShardRef:
    """One shard: a table's slice of one unit."""

    table: str
    unit_id: int

    def __str__(self) -> str:
        return f"{self.table}#{self.unit_id}"


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused while a catalog is built or written out:
    a million units are millions of small objects, none in a cycle, which the collector
    would otherwise walk again and again (a 1M-unit catalog read in 1.0 s instead of 3.0)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def with_fields(catalog: Catalog, **changes: Any) -> Catalog:
    """``catalog`` with ``changes`` (``dataclasses.replace``), keeping what it found of its
    tables only while they stay the same."""
    if "tables" in changes:
        changes["tables_by_group"] = []
    return dataclasses.replace(catalog, **changes)


@dataclass(frozen=True)
class Catalog:
    version: int = 0
    epoch: int = 0
    n_buckets: int = 256
    nodes: tuple[str, ...] = ()
    tables: Mapping[str, TableSpec] = field(default_factory=lambda: MappingProxyType({}))
    groups: Mapping[str, Group] = field(default_factory=lambda: MappingProxyType({}))
    next_unit_id: int = 0
    next_node_index: int = 0
    excluded: tuple[str, ...] = ()
    """Nodes that get no new work (suspect or failing): no units are placed there and
    stages that may run anywhere run elsewhere."""
    tables_by_group: list[Mapping[str, tuple[str, ...]]] = field(
        default_factory=list, compare=False, repr=False
    )
    """The tables of each group, found once (empty until asked) and shared by the versions
    that keep these ``tables`` (a move, split or merge keeps them); a version with other
    tables starts a list of its own."""

    # -- reading -------------------------------------------------------------------------
    def find_table(self, name: str) -> TableSpec | None:
        """The table ``name`` refers to, or None. Names match as in DuckDB: ASCII letters
        case-insensitively, quoted or not, every other character exactly
        (:func:`shardflow.catalog.name_key`); the spec keeps the spelling it was created
        with. Every lookup of a user-given table name goes through here."""
        return self._tables_by_key.get(name_key(name))

    def table(self, name: str) -> TableSpec:
        """Like :meth:`find_table`, but a missing table is a ``KeyError``."""
        spec = self.find_table(name)
        if spec is None:
            raise KeyError(name)
        return spec

    @functools.cached_property
    def _tables_by_key(self) -> Mapping[str, TableSpec]:
        return {name_key(name): spec for name, spec in self.tables.items()}

    def routing(self, names: Iterable[str]) -> Catalog:
        """What a session needs to plan and route queries over the tables ``names``: this
        version's scalars (epoch, nodes, buckets), those tables (names it does not know are
        left out) and their groups' units; no other table. A session keeps such a view and
        asks again when a ``Moved`` or a new table says it must, so what it fetches grows
        with the tables it uses, not with the cluster."""
        specs = {spec.name: spec for n in names if (spec := self.find_table(n)) is not None}
        groups = {s.group: self.groups[s.group] for s in specs.values() if s.group is not None}
        return dataclasses.replace(
            self,
            tables=MappingProxyType(specs),
            groups=MappingProxyType(groups),
            tables_by_group=[],
        )

    def group_of(self, table: str) -> Group:
        spec = self.table(table)
        if spec.group is None:
            raise KeyError(f"table {table} is replicated and has no units")
        return self.groups[spec.group]

    def shards_on(self, node: str) -> list[ShardRef]:
        """Every shard of a distributed table that ``node`` owns."""
        refs = []
        for spec in self.tables.values():
            if spec.group is None:
                continue
            for unit in self.groups[spec.group].units:
                if unit.node == node:
                    refs.append(ShardRef(spec.name, unit.unit_id))
        return refs

    @property
    def serving(self) -> tuple[str, ...]:
        """The nodes work may be sent to: every node but the excluded (all of them, if
        every node is excluded)."""
        return tuple(n for n in self.nodes if n not in self.excluded) or self.nodes

    def with_excluded(self, nodes: Iterable[str]) -> Catalog:
        return self._next(excluded=tuple(sorted(set(nodes) & set(self.nodes), key=_node_order)))

    @property
    def primary(self) -> str | None:
        """The node that writes the log of replicated tables (the lowest-numbered node)."""
        return min(self.nodes, key=_node_order) if self.nodes else None

    def replicated_tables(self) -> list[TableSpec]:
        return [spec for spec in self.tables.values() if spec.kind == "replicated"]

    def group_tables(self, group_id: str) -> list[str]:
        if not self.tables_by_group:
            index: dict[str, list[str]] = {}
            for spec in self.tables.values():
                if spec.group is not None:
                    index.setdefault(spec.group, []).append(spec.name)
            self.tables_by_group.append({g: tuple(names) for g, names in index.items()})
        return list(self.tables_by_group[0].get(group_id, ()))

    # -- changing ------------------------------------------------------------------------
    def _next(self, **changes: Any) -> Catalog:
        return with_fields(self, version=self.version + 1, **changes)

    def with_nodes(self, nodes: Iterable[str], placement: Mapping[int, str]) -> Catalog:
        """Register the live node set; ``placement`` gives new owners of orphaned units."""
        nodes = tuple(sorted(set(nodes), key=_node_order))
        moved = False
        groups = {}
        for group_id, group in self.groups.items():
            units = []
            for unit in group.units:
                if unit.node not in nodes:
                    unit = dataclasses.replace(unit, node=placement[unit.unit_id])
                    moved = True
                units.append(unit)
            groups[group_id] = dataclasses.replace(group, units=tuple(units))
        indexes = [int(n.rsplit("-", 1)[1]) for n in nodes if n.rsplit("-", 1)[-1].isdigit()]
        return self._next(
            nodes=nodes,
            groups=MappingProxyType(groups),
            epoch=self.epoch + 1 if moved else self.epoch,
            next_node_index=max([self.next_node_index, *(i + 1 for i in indexes)]),
            excluded=tuple(n for n in self.excluded if n in nodes),
        )

    def node_ids(self, count: int) -> list[str]:
        """The ids of a cluster of ``count`` nodes over this catalog: its nodes first, so
        that every unit they own stays where it is, then ids never used before.

        >>> Catalog(nodes=("node-0", "node-2"), next_node_index=3).node_ids(3)
        ['node-0', 'node-2', 'node-3']
        >>> Catalog().node_ids(2)
        ['node-0', 'node-1']
        """
        fresh = (f"node-{i}" for i in range(self.next_node_index, self.next_node_index + count))
        return [*self.nodes[:count], *fresh][:count]

    def orphaned_units(self, nodes: Iterable[str]) -> list[Unit]:
        live = set(nodes)
        return [u for g in self.groups.values() for u in g.units if u.node not in live]

    def with_new_group(self, key_type: pa.DataType, owners: list[str]) -> tuple[Catalog, str]:
        """A new co-location group with one unit per entry of ``owners``."""
        group_id = f"g{uuid.uuid4().hex[:8]}"
        ranges = split_range(0, self.n_buckets, len(owners))
        units = tuple(
            Unit(self.next_unit_id + i, lo, hi, owner)
            for i, ((lo, hi), owner) in enumerate(zip(ranges, owners, strict=True))
        )
        group = Group(group_id, key_family(key_type), units)
        groups = {**self.groups, group_id: group}
        catalog = self._next(
            groups=MappingProxyType(groups), next_unit_id=self.next_unit_id + len(units)
        )
        return catalog, group_id

    def with_group(self, group: Group, next_unit_id: int) -> Catalog:
        """Add a group planned against an older version (its unit ids are reserved)."""
        return self._next(
            groups=MappingProxyType({**self.groups, group.group_id: group}),
            next_unit_id=max(self.next_unit_id, next_unit_id),
        )

    def with_unit_ids_reserved(self, count: int) -> tuple[Catalog, list[int]]:
        """Allocate ``count`` unit ids for units that do not exist yet (a move's targets)."""
        ids = list(range(self.next_unit_id, self.next_unit_id + count))
        return self._next(next_unit_id=self.next_unit_id + count), ids

    def with_node_added(self, node: str) -> Catalog:
        index = int(node.rsplit("-", 1)[1]) if node.rsplit("-", 1)[-1].isdigit() else -1
        return self._next(
            nodes=tuple(sorted({*self.nodes, node}, key=_node_order)),
            next_node_index=max(self.next_node_index, index + 1),
        )

    def with_units_replaced(
        self, group_id: str, remove: Iterable[int], add: Iterable[Unit]
    ) -> Catalog:
        """Replace units of a group by units covering the same buckets (a move, split or
        merge switching over); the routing epoch goes up."""
        group = self.groups[group_id]
        gone = set(remove)
        units = [u for u in group.units if u.unit_id not in gone] + list(add)
        units.sort(key=lambda u: u.lo)
        covered = [(u.lo, u.hi) for u in units]
        if (
            covered[0][0] != 0
            or covered[-1][1] != self.n_buckets
            or any(a[1] != b[0] for a, b in itertools.pairwise(covered))
        ):
            raise ValueError(f"units of {group_id} would not cover every bucket once: {covered}")
        replaced = dataclasses.replace(group, units=tuple(units))
        return self._next(
            groups=MappingProxyType({**self.groups, group_id: replaced}), epoch=self.epoch + 1
        )

    def with_table(self, spec: TableSpec) -> Catalog:
        """Add a table, or replace a table by a newer spec of itself (same ``uid``).

        Raises :class:`shardflow.TableExistsError` when another table has the same name
        under DuckDB's rule (``LINEITEM`` beside ``lineitem``), and
        :class:`shardflow.TableError` when two of its columns have the same name."""
        existing = self.find_table(spec.name)
        if existing is not None and existing.uid != spec.uid:
            raise TableExistsError(
                f"table {spec.name!r} already exists as {existing.name!r} (names match "
                "case-insensitively, as in DuckDB); drop it first or choose another name"
            )
        repeated = duplicate_names(spec.schema.names)
        if repeated:
            raise TableError(
                f"table {spec.name!r} has more than one column named {repeated[0]!r} "
                "(names match case-insensitively, as in DuckDB)"
            )
        tables = {k: v for k, v in self.tables.items() if existing is None or k != existing.name}
        return self._next(tables=MappingProxyType({**tables, spec.name: spec}))

    def with_table_truncated(self, name: str, uid: str) -> Catalog:
        """The table ``name`` with no rows: new, empty files (``uid``) and the next commit
        number; its units, grants and everything else kept."""
        spec = self.table(name)
        renewed = dataclasses.replace(spec, uid=uid, rows=0, commit=spec.commit + 1)
        tables = {k: v for k, v in self.tables.items() if k != spec.name}
        return self._next(tables=MappingProxyType({**tables, spec.name: renewed}))

    def with_rows_changed(self, name: str, statement: str, rows: int, deleted: int) -> Catalog:
        """The table ``name`` after ``statement`` changed ``rows`` of its rows (``deleted``
        of them are gone): the next commit number, the statement kept with it."""
        spec = self.table(name)
        commit = spec.commit + 1
        changes = (*spec.changes, RowChange(commit, statement, rows))[-CHANGES_KEPT:]
        renewed = dataclasses.replace(
            spec, rows=max(0, spec.rows - deleted), commit=commit, changes=changes
        )
        tables = {k: v for k, v in self.tables.items() if k != spec.name}
        return self._next(tables=MappingProxyType({**tables, spec.name: renewed}))

    def without_table(self, name: str) -> Catalog:
        spec = self.table(name)
        tables = {k: v for k, v in self.tables.items() if k != spec.name}
        groups = dict(self.groups)
        if spec.group is not None and not any(t.group == spec.group for t in tables.values()):
            del groups[spec.group]  # the last table of a group takes the group with it
        return self._next(tables=MappingProxyType(tables), groups=MappingProxyType(groups))

    # -- persistence ---------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        with collector_paused():
            return self._to_json()

    def _to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "epoch": self.epoch,
            "n_buckets": self.n_buckets,
            "nodes": list(self.nodes),
            "next_unit_id": self.next_unit_id,
            "next_node_index": self.next_node_index,
            "excluded": list(self.excluded),
            "tables": [t.to_json() for t in self.tables.values()],
            "groups": [
                {
                    "group_id": g.group_id,
                    "key_family": g.key_family,
                    "units": [[u.unit_id, u.lo, u.hi, u.node] for u in g.units],
                }
                for g in self.groups.values()
            ],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Catalog:
        with collector_paused():
            return cls._from_json(data)

    @classmethod
    def _from_json(cls, data: Mapping[str, Any]) -> Catalog:
        tables = {t["name"]: TableSpec.from_json(t) for t in data["tables"]}
        groups = {
            g["group_id"]: Group(
                g["group_id"], g["key_family"], tuple(Unit(*u) for u in g["units"])
            )
            for g in data["groups"]
        }
        return cls(
            version=data["version"],
            epoch=data["epoch"],
            n_buckets=data["n_buckets"],
            nodes=tuple(data["nodes"]),
            tables=MappingProxyType(tables),
            groups=MappingProxyType(groups),
            next_unit_id=data["next_unit_id"],
            next_node_index=data.get("next_node_index", len(data["nodes"])),
            excluded=tuple(data.get("excluded", ())),
        )
