"""The session's part in a change of rows (``DELETE``, ``UPDATE``): the statement read
against the table (its subqueries answered first where they run alone, the tables the
others read sent along, every value typed), planned as a query so that a mistake is said
before any shard prepares anything, routed by its key where its WHERE fixes it, then
asked of the coordinator, which runs its two phases
(``runtime/coordinator/node.CoordinatorNode.change_rows``)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar

import pyarrow as pa

from shardflow.catalog import Catalog, TableSpec
from shardflow.errors import QueryError, UnknownColumnError, UnsupportedError
from shardflow.runtime.protocol import Coordinator
from shardflow.runtime.query.executor import ExecutionReport
from shardflow.runtime.query.planning import Binder, PlannedQuery
from shardflow.sql.parse import parse
from shardflow.sql.pruning import buckets_of, change_key_terms
from shardflow.sql.statements import (
    SHIPPED_PREFIX,
    ChangeRows,
    inline_subqueries,
    shipped_reads,
    typed,
)
from shardflow.storage import RowRewrite
from shardflow.storage.shard import returning_query

T = TypeVar("T")
_STATEMENT_ID = re.compile(r"[0-9A-Za-z_-]{1,64}")
MAX_SHIPPED_ROWS = 1_000_000
"""The most rows of a table a correlated subquery of a DELETE or UPDATE may read (the
table goes to every shard the statement changes)."""
MAX_SHIPPED_BYTES = 256 << 20
"""And the most bytes."""


class ChangeHost(Protocol):
    """What a change of rows asks of its session."""

    catalog: Catalog
    coordinator: Coordinator

    def table_spec(self, name: str) -> TableSpec: ...
    def query(self, sql: str) -> tuple[pa.Table, ExecutionReport]: ...
    def plan(self, sql: str) -> PlannedQuery: ...
    def retrying(self, what: str, attempt: Callable[[], T]) -> T: ...
    def refresh(self, more: Iterable[str] = ()) -> Catalog: ...


class RowChanger:
    """Runs a session's DELETE and UPDATE statements (see the module)."""

    def __init__(self, host: ChangeHost, binder: Binder) -> None:
        self.host = host
        self.binder = binder

    def change_rows(
        self, change: ChangeRows, statement: str | None = None
    ) -> tuple[int, pa.Table | None]:
        """Delete or update rows of a table (``DELETE``, ``UPDATE``) all or nothing across
        its shards; answers the rows changed, and what the statement gives back where it
        says ``RETURNING`` (else None). ``statement``: the statement's id (a new one if
        None); tried again with the same id, it is applied once. A query sees it on every
        shard or on none (it is the table's next commit)."""
        spec = self.host.table_spec(change.name)

        def answer(query: str) -> pa.Table:
            return self.host.query(query)[0]

        reads: set[str] = set()

        def inlined(sql: str, outer: tuple[str, ...] = ()) -> str:
            sql, read = shipped_reads(inline_subqueries(sql, answer, outer))
            reads.update(read)
            return sql

        where = inlined(change.where, (change.alias, spec.name)) if change.where else None
        sets = []
        for column, expression in change.sets:
            expression = inlined(expression)
            field = spec.find_column(column)
            if field is None:
                raise UnknownColumnError(
                    f"table {spec.name!r} has no column {column!r}; it has "
                    f"{', '.join(spec.schema.names)}"
                )
            sets.append((field.name, expression))
        returning = (
            ", ".join(inlined(item) for item in change.returning) if change.returning else None
        )
        # the statement's SQL is planned as a query's is first (columns, types, functions
        # refused): a mistake is said before any shard prepares anything; and where its
        # WHERE fixes the key, only the shards of those buckets are asked
        typed_sets = tuple(
            (column, typed(expression, spec.schema.field(column).type))
            for column, expression in sets
        )
        values = ", ".join(expression for _, expression in typed_sets)
        table = f'"{spec.name}"'
        probe = f'SELECT {values or "count(*)"} FROM {table} AS "{change.alias}"'
        probe += f" WHERE {where}" if where else ""
        probes = [probe]
        if returning is not None:
            probes.append(
                returning_query(table, change.alias, where, typed_sets, returning) + " LIMIT 0"
            )
        inputs = {SHIPPED_PREFIX + name.lower(): self._shipped(name) for name in sorted(reads)}
        if inputs:  # correlated subqueries: every shard reads the tables they read whole
            schemas = [self._check_locally(p, spec, inputs) for p in probes]
            buckets = None
        else:
            schemas = [self.host.plan(p).schema for p in probes]
            catalog = self.host.catalog
            buckets = buckets_of(change_key_terms(parse(probe), spec, catalog), catalog)
        rekey = spec.key if any(column == spec.key for column, _ in sets) else None
        rewrite = RowRewrite(
            change.alias,
            where,
            tuple(sets),
            delete=change.delete,
            key=rekey,
            inputs=inputs,
            returning=returning,
            typed_sets=typed_sets,
        )
        statement = statement or uuid.uuid4().hex
        if not _STATEMENT_ID.fullmatch(statement):
            raise QueryError("a statement id is 1 to 64 letters, digits, '_' or '-'")
        done = self.host.retrying(
            f"{'DELETE' if change.delete else 'UPDATE'} of {spec.name}",
            lambda: self.host.coordinator.change_rows(spec.name, statement, rewrite, buckets).get(),
        )
        self.host.refresh([spec.name])
        if returning is None:
            return int(done["rows"]), None
        returned: list[pa.Table] = done.get("returned") or []
        schema = schemas[-1]
        parts = [part.rename_columns(schema.names).cast(schema) for part in returned]
        return int(done["rows"]), pa.concat_tables([schema.empty_table(), *parts])

    def _shipped(self, name: str) -> pa.Table:
        """The whole of table ``name``, which a correlated subquery of a DELETE or UPDATE
        reads: it goes to every shard the statement changes (at most
        :data:`MAX_SHIPPED_ROWS` rows and :data:`MAX_SHIPPED_BYTES`)."""
        spec = self.host.table_spec(name)
        rows = self.host.query(f'SELECT * FROM "{spec.name}" LIMIT {MAX_SHIPPED_ROWS + 1}')[0]
        if rows.num_rows > MAX_SHIPPED_ROWS or rows.nbytes > MAX_SHIPPED_BYTES:
            raise UnsupportedError(
                f"a correlated subquery of a DELETE or UPDATE reads {spec.name}, which is "
                f"too big to send to every shard (at most {MAX_SHIPPED_ROWS:,} rows and "
                f"{MAX_SHIPPED_BYTES >> 20} MB): write the subquery so that it runs alone "
                "(x IN (SELECT ...)), or change the rows in parts"
            )
        return rows

    def _check_locally(self, probe: str, spec: TableSpec, inputs: dict[str, pa.Table]) -> pa.Schema:
        """Bind a statement whose subqueries read the changed row over no rows here, with
        the tables they read: a mistake (a column, a type, a function) is said before any
        shard prepares anything. Answers its schema."""
        empty = "__sf_changed"
        tables = {**inputs, empty: spec.schema.empty_table()}
        local = probe.replace(f'FROM "{spec.name}" AS', f"FROM {empty} AS", 1)
        return self.binder.schema_over(f"SELECT * FROM ({local}) AS probe LIMIT 0", tables)
