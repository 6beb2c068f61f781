"""How the runner lays out a file's tables in shardflow. Each file runs in every layout:

1. ``first-column`` -- every table distributed (hashed) on its first column whose type can
   be a distribution key; a table without one is spread round-robin.
2. ``replicated`` -- every table replicated on every worker.
3. ``join-keys`` -- only where the file joins on columns: each table distributed on the
   column it is most often equi-joined on (``a.x = b.y`` in ON / WHERE, or USING, in any
   statement or query of the file; ties go to the earlier column), and tables joined on
   their chosen columns, with keys of one hash family, co-located (``colocate_with``).
   Omitted when it would equal ``first-column``.

>>> import pyarrow as pa
>>> s = {"t": pa.schema([("a", pa.int64()), ("k", pa.int64())]),
...      "u": pa.schema([("k", pa.int64())])}
>>> [p.name for p in plan_layouts(s, ["SELECT * FROM t JOIN u ON t.k = u.k"])]
['first-column', 'replicated', 'join-keys']
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import pyarrow as pa

from shardflow.catalog.buckets import key_family
from tests.conformance.analysis import QUERY_KEYWORDS, analyze, first_keyword, join_edges

__all__ = ["FIRST_COLUMN", "REPLICATED", "LayoutPlan", "Placement", "plan_layouts"]

_MAX_JOIN_SCAN_CHARS = 20_000
"""Longer statements (bulk INSERT ... VALUES) are not parsed for joins."""


@dataclass(frozen=True)
class Placement:
    distributed_by: str | None = None
    replicated: bool = False
    colocate_with: str | None = None


def family(arrow_type: pa.DataType) -> str | None:
    try:
        return key_family(arrow_type)
    except TypeError:
        return None


def first_hashable(schema: pa.Schema) -> str | None:
    return next((f.name for f in schema if family(f.type) is not None), None)


@dataclass(frozen=True)
class LayoutPlan:
    name: str
    replicated: bool = False
    keys: Mapping[str, str] = field(default_factory=dict)
    """Lower-cased table name -> lower-cased key column."""
    groups: Mapping[str, int] = field(default_factory=dict)
    """Lower-cased table name -> co-location group."""

    def place(self, table: str, schema: pa.Schema, held: Mapping[str, str]) -> Placement:
        """Where ``table`` goes, given the tables shardflow ``held`` (lower -> name)."""
        if self.replicated:
            return Placement(replicated=True)
        key = None
        wanted = self.keys.get(table)
        if wanted is not None:
            key = next((f.name for f in schema if f.name.lower() == wanted), None)
        key = key or first_hashable(schema)
        if key is None:
            return Placement()
        partner = None
        group = self.groups.get(table)
        if group is not None:
            partner = next(
                (held[t] for t, g in sorted(self.groups.items()) if g == group and t in held),
                None,
            )
        return Placement(distributed_by=key, colocate_with=partner)


FIRST_COLUMN = LayoutPlan("first-column")
REPLICATED = LayoutPlan("replicated", replicated=True)


def plan_layouts(schemas: Mapping[str, pa.Schema], sqls: Iterable[str]) -> list[LayoutPlan]:
    """The layouts for a file whose tables had ``schemas`` (lower-cased names) and whose
    statements and queries were ``sqls``."""
    names = {t: s.names for t, s in schemas.items()}
    uses: Counter[tuple[str, str]] = Counter()
    edges = []
    for sql in sqls:
        if len(sql) > _MAX_JOIN_SCAN_CHARS or ("=" not in sql and "using" not in sql.lower()):
            continue
        keyword = first_keyword(sql)
        if keyword not in QUERY_KEYWORDS and keyword not in ("CREATE", "INSERT"):
            continue
        for edge in join_edges(analyze(sql), names):
            edges.append(edge)
            uses[(edge.left, edge.left_column)] += 1
            uses[(edge.right, edge.right_column)] += 1
    keys: dict[str, str] = {}
    for table, schema in schemas.items():
        order = {f.name.lower(): i for i, f in enumerate(schema)}
        types = {f.name.lower(): f.type for f in schema}
        candidates = [
            (-n, order[c], c)
            for (t, c), n in uses.items()
            if t == table and c in types and family(types[c]) is not None
        ]
        if candidates:
            keys[table] = min(candidates)[2]
    parent: dict[str, str] = {}

    def find(t: str) -> str:
        while parent.get(t, t) != t:
            t = parent[t]
        return t

    for edge in edges:
        a, b = edge.left, edge.right
        if a == b or keys.get(a) != edge.left_column or keys.get(b) != edge.right_column:
            continue
        fa = family(_type(schemas[a], edge.left_column))
        fb = family(_type(schemas[b], edge.right_column))
        if fa is not None and fa == fb:
            parent[find(a)] = find(b)
    roots = sorted({find(t) for t in parent} | set(parent))
    members: dict[str, list[str]] = {}
    for t in roots:
        members.setdefault(find(t), []).append(t)
    groups = {t: i for i, ts in enumerate(members.values()) if len(ts) > 1 for t in ts}
    join = LayoutPlan("join-keys", keys=keys, groups=groups)
    differs = bool(groups) or any(
        keys.get(t) is not None and keys[t] != (first_hashable(s) or "").lower()
        for t, s in schemas.items()
    )
    return [FIRST_COLUMN, REPLICATED, join] if differs else [FIRST_COLUMN, REPLICATED]


def _type(schema: pa.Schema, column: str) -> pa.DataType:
    return next(f.type for f in schema if f.name.lower() == column)
