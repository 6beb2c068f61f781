"""Checking inserted data against a table's schema before anything is written."""

from __future__ import annotations

import pyarrow as pa

from shardflow.catalog.names import duplicate_names, find_name
from shardflow.catalog.types import storage_type
from shardflow.errors import SchemaMismatchError


def _family(t: pa.DataType) -> str:
    if pa.types.is_null(t):
        return "null"
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_decimal(t):
        return "decimal"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "string"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
        return "binary"
    if pa.types.is_date(t):
        return "date"
    if pa.types.is_timestamp(t):
        return f"timestamp[{t.tz}]"
    return str(t)


# (from family, to family) pairs an insert converts implicitly; the cast still fails on loss
_IMPLICIT = {
    ("int", "float"),
    ("int", "decimal"),
}


def conform(data: object, schema: pa.Schema, table: str) -> pa.Table:
    """``data`` as a table of exactly ``schema``; raises :class:`SchemaMismatchError`.
    Columns are matched by name under DuckDB's rule (``O_ORDERKEY`` is ``o_orderkey``)."""
    if isinstance(data, pa.RecordBatch):
        data = pa.Table.from_batches([data])
    if not isinstance(data, pa.Table):
        raise SchemaMismatchError(
            f"insert into {table} takes a pyarrow.Table or RecordBatch, not {type(data).__name__}"
        )
    names = data.column_names
    duplicated = sorted(set(duplicate_names(names)))
    if duplicated:
        raise SchemaMismatchError(f"insert into {table}: duplicate column(s) {duplicated}")
    given = {f.name: find_name(names, f.name) for f in schema}
    missing = [name for name, found in given.items() if found is None]
    extra = [n for n in names if find_name(schema.names, n) is None]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing column(s) {missing}")
        if extra:
            parts.append(f"unknown column(s) {extra}")
        raise SchemaMismatchError(
            f"insert into {table}: {'; '.join(parts)}; the table has {schema.names}"
        )
    columns = []
    for field in schema:
        column = data.column(given[field.name])
        source, target = column.type, field.type
        if source != target:
            families = (_family(source), _family(target))
            same_family = families[0] == families[1]
            if not (same_family or families[0] == "null" or families in _IMPLICIT):
                raise SchemaMismatchError(
                    f"insert into {table}: column {field.name!r} has type {source}, "
                    f"the table expects {target}"
                )
            try:
                column = column.cast(storage_type(target), safe=True)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as error:
                raise SchemaMismatchError(
                    f"insert into {table}: column {field.name!r} does not fit {target}: {error}"
                ) from None
        if not field.nullable and column.null_count:
            raise SchemaMismatchError(
                f"insert into {table}: column {field.name!r} is NOT NULL but "
                f"{column.null_count} row(s) are null"
            )
        columns.append(column)
    return pa.Table.from_arrays(columns, schema=schema)
