"""Merges that can go out as their parts arrive: an answer whose merge only puts the parts
in order (``ORDER BY`` over the concatenated partials, a ``LIMIT``/``OFFSET`` after it, the
columns picked and renamed) is a *sorted merge*. Each worker sorts its part by the same
keys, and the client interleaves the sorted parts batch by batch
(``runtime/query/merging.py``): the first rows leave before the last part is read, and no
part is held whole. Any other merge (an aggregate, ``DISTINCT``, an expression in the
select list or the ordering) is answered whole.

>>> merge = sorted_merge(
...     "SELECT _c0 AS id, _c1 AS v FROM __sf_partials ORDER BY _c1 DESC, _c0 LIMIT 10"
... )
>>> [(k.column, k.descending, k.nulls_first) for k in merge.keys], merge.limit
([('_c1', True, False), ('_c0', False, False)], 10)
>>> merge.part_sql("SELECT w.id AS _c0, w.v AS _c1 FROM w AS w")
'SELECT w.id AS _c0, w.v AS _c1 FROM w AS w ORDER BY _c1 DESC, _c0 ASC LIMIT 10'
>>> sorted_merge("SELECT _c0, count(*) AS n FROM __sf_partials GROUP BY _c0 ORDER BY n") is None
True
"""

from __future__ import annotations

from dataclasses import dataclass

import sqlglot
from sqlglot import exp
from sqlglot.errors import SqlglotError

from shardflow.sql.plan import PARTIALS

_UNSORTED_PARTS = (
    "joins", "where", "group", "having", "qualify", "distinct", "windows", "with", "laterals",
)  # fmt: skip
"""Clauses of a merge that do more than put the parts in order."""


@dataclass(frozen=True)
class SortKey:
    column: str
    """A column of the partials."""
    descending: bool
    nulls_first: bool
    """As DuckDB orders: NULLs last unless the query says ``NULLS FIRST``."""


@dataclass(frozen=True)
class SortedMerge:
    """A merge that only orders the partials, keeps some of their columns (``columns``, in
    the answer's order, renamed to the answer's names by position) and cuts the rows."""

    keys: tuple[SortKey, ...]
    columns: tuple[str, ...]
    limit: int | None
    offset: int

    def part_sql(self, stage_sql: str) -> str:
        """``stage_sql`` (a part, over one worker's shards) sorted by the keys; with a
        ``LIMIT``, the first ``limit + offset`` rows (no part needs more)."""
        tree = sqlglot.parse_one(stage_sql, read="duckdb")
        assert isinstance(tree, exp.Select)
        order = [
            exp.Ordered(this=exp.column(k.column), desc=k.descending, nulls_first=k.nulls_first)
            for k in self.keys
        ]
        tree.set("order", exp.Order(expressions=order))
        if self.limit is not None:
            tree.set("offset", None)
            tree = tree.limit(self.limit + self.offset, copy=False)
        return tree.sql(dialect="duckdb")


def sorted_merge(merge_sql: str | None) -> SortedMerge | None:
    """The sorted merge ``merge_sql`` is, or None where it is another merge (or none)."""
    if merge_sql is None:
        return None
    try:
        tree = sqlglot.parse_one(merge_sql, read="duckdb")
    except SqlglotError:
        return None
    if not isinstance(tree, exp.Select) or any(tree.args.get(part) for part in _UNSORTED_PARTS):
        return None
    source = tree.args.get("from_") or tree.args.get("from")
    table = source.this if isinstance(source, exp.From) else None
    if not isinstance(table, exp.Table) or table.name != PARTIALS or table.args.get("db"):
        return None
    columns = [_column_of(e.this if isinstance(e, exp.Alias) else e) for e in tree.expressions]
    order = tree.args.get("order")
    if not order or any(c is None for c in columns):
        return None
    keys = []
    for ordered in order.expressions:
        column = _column_of(ordered.this)
        if column is None:
            return None
        nulls_first = ordered.args.get("nulls_first") is True
        keys.append(SortKey(column, bool(ordered.args.get("desc")), nulls_first))
    limit, offset = tree.args.get("limit"), tree.args.get("offset")
    count, skip = _count(limit), _count(offset)
    if (limit is not None and count is None) or (offset is not None and skip is None):
        return None
    return SortedMerge(tuple(keys), tuple(c for c in columns if c), count, skip or 0)


def _column_of(node: exp.Expr | None) -> str | None:
    """The partials column ``node`` names, or None where it is anything else."""
    if isinstance(node, exp.Column) and not node.table:
        return node.name
    return None


def _count(clause: exp.Expr | None) -> int | None:
    """A ``LIMIT``'s or ``OFFSET``'s count where it is a whole number written out; None
    where there is no clause or it is anything else."""
    value = clause.args.get("expression") if clause is not None else None
    if isinstance(value, exp.Literal) and not value.is_string and value.this.isdigit():
        return int(value.this)
    return None
