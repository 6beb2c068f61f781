"""Shard pruning: a query whose rows must all have one of a few values of a distribution key
(``WHERE o.o_orderkey = 42``, ``... IN (1, 2, 3)``) needs only the shards that own those
values' buckets.

A fragment is pruned when a top-level conjunct of its own WHERE compares the key column of
a distributed table of its FROM/JOINs with constants: every row it returns then carries one
of those key values from that table, and that table's rows with a given value live in one
bucket. Other shards would return nothing (or, for a partial aggregate, an empty partial
that the merge does not change). Anything less certain (OR, expressions on the key, a key
compared with a column, a CTE or subquery in FROM) is not pruned.
"""

from __future__ import annotations

import pyarrow as pa
from sqlglot import exp

from shardflow.catalog import Catalog, TableSpec
from shardflow.catalog.buckets import buckets_of_values, key_family
from shardflow.sql.plan import KeyTerm

MAX_PRUNED_VALUES = 64
"""An IN-list longer than this scatters as usual (it would reach most shards anyway)."""


def key_terms(fragment: exp.Expr, catalog: Catalog) -> tuple[KeyTerm, ...]:
    """The conjuncts of ``fragment``'s WHERE that limit it to some values of a key."""
    if not isinstance(fragment, exp.Select):
        return ()
    where = fragment.args.get("where")
    if where is None:
        return ()
    specs = _distributed_sources(fragment, catalog)
    if not specs:
        return ()
    terms = []
    for conjunct in _conjuncts(where.this):
        values = _key_values(conjunct, specs)
        if values is not None:
            spec, constants = values
            terms.append(KeyTerm(spec.name, tuple((c.this, c.is_string) for c in constants)))
    return tuple(terms)


def change_key_terms(probe: exp.Expr, spec: TableSpec, catalog: Catalog) -> tuple[KeyTerm, ...]:
    """:func:`key_terms` of a DELETE's or UPDATE's probe (``SELECT ... FROM t AS alias
    WHERE ...``, its subqueries answered first): its WHERE reads the one table only, so a
    column it names without a table (``WHERE id = 7``, the usual way) is that table's, as
    DuckDB reads it. The planner's fragments come qualified; a statement's WHERE does not,
    and its key would route nothing."""
    if not isinstance(probe, exp.Select):
        return ()
    source = probe.args.get("from_") or probe.args.get("from")
    table = source.this if source is not None else None
    if not isinstance(table, exp.Table) or probe.find(exp.Subquery, exp.Exists) is not None:
        return ()
    qualified = probe.copy()
    where = qualified.args.get("where")
    for column in where.find_all(exp.Column) if where is not None else ():
        field = spec.find_column(column.name)
        if not column.table and field is not None:
            column.set("this", exp.to_identifier(field.name, quoted=True))
            column.set("table", exp.to_identifier(table.alias_or_name, quoted=True))
    return key_terms(qualified, catalog)


def buckets_of(terms: tuple[KeyTerm, ...], catalog: Catalog) -> tuple[int, ...] | None:
    """The buckets every row satisfying all ``terms`` falls in, or None when it may be in
    any."""
    found: set[int] | None = None
    for term in terms:
        spec = catalog.find_table(term.table)
        if spec is None or not spec.key:
            continue
        buckets = _buckets(spec, term.values, catalog.n_buckets)
        if buckets is None:
            continue
        if found is not None and not found & buckets:
            # contradictory (key = 2 AND key = 4): no row qualifies, but one shard must
            # still answer, with no rows or an empty partial aggregate
            return (min(found),)
        found = buckets if found is None else found & buckets
    return tuple(sorted(found)) if found is not None else None


def _distributed_sources(select: exp.Select, catalog: Catalog) -> dict[str, TableSpec]:
    """Alias (or name) -> spec of each distributed catalog table read directly in the
    FROM and JOINs of ``select``."""
    found: dict[str, TableSpec] = {}
    sources = [select.args.get("from_") or select.args.get("from")]
    sources += [  # a semi or anti join's rows are not in the result: its key says nothing
        join for join in select.args.get("joins") or [] if join.kind not in ("SEMI", "ANTI")
    ]
    for source in sources:
        table = source.this if source is not None else None
        if not isinstance(table, exp.Table) or not isinstance(table.this, exp.Identifier):
            continue
        spec = catalog.find_table(table.name)
        if spec is not None and spec.distributed and spec.key:
            found[table.alias_or_name] = spec
    return found


def _conjuncts(condition: exp.Expr) -> list[exp.Expr]:
    while isinstance(condition, exp.Paren):
        condition = condition.this
    if isinstance(condition, exp.And):
        return _conjuncts(condition.left) + _conjuncts(condition.right)
    return [condition]


def _key_values(
    conjunct: exp.Expr, specs: dict[str, TableSpec]
) -> tuple[TableSpec, list[exp.Literal]] | None:
    """(table, constants) when ``conjunct`` is ``key = constant`` or ``key IN (...)``."""
    if isinstance(conjunct, exp.EQ):
        column, other = conjunct.left, conjunct.right
        if not isinstance(column, exp.Column):
            column, other = other, column
        constants = [other]
    elif isinstance(conjunct, exp.In) and not conjunct.args.get("query"):
        column, constants = conjunct.this, list(conjunct.expressions)
        if not constants or len(constants) > MAX_PRUNED_VALUES:
            return None
    else:
        return None
    if not isinstance(column, exp.Column) or not column.table:
        return None
    spec = specs.get(column.table)
    if spec is None or column.name != spec.key:
        return None
    if not all(isinstance(c, exp.Literal) for c in constants):
        return None
    return spec, [c for c in constants if isinstance(c, exp.Literal)]


def _buckets(
    spec: TableSpec, constants: tuple[tuple[str, bool], ...], n_buckets: int
) -> set[int] | None:
    """The buckets of ``constants`` as values of ``spec``'s key, or None when a constant
    is not plainly one (only integer keys with integer literals and string keys with string
    literals are pruned: they hash exactly as the stored values)."""
    key_type = spec.schema.field(spec.key).type
    family = key_family(key_type)
    if family == "string" and all(is_string for _, is_string in constants):
        return set(buckets_of_values([text for text, _ in constants], n_buckets))
    if family != "integer" or not pa.types.is_integer(key_type):
        return None
    numbers: list[int] = []
    for text, is_string in constants:
        if is_string or not text.lstrip("-").isdigit():
            return None
        number = int(text)
        if not _fits(number, key_type):
            return None  # a constant the key cannot hold: no row matches; leave it to DuckDB
        numbers.append(number)
    return set(buckets_of_values(numbers, n_buckets))


def _fits(value: int, key_type: pa.DataType) -> bool:
    """Whether ``value`` is a value of the integer type ``key_type``."""
    bits = int(key_type.bit_width)
    if pa.types.is_signed_integer(key_type):
        return -(1 << (bits - 1)) <= value < (1 << (bits - 1))
    return 0 <= value < (1 << bits)
