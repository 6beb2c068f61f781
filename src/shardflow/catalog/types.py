"""The column types tables are stored with."""

from __future__ import annotations

import pyarrow as pa


def storage_type(arrow_type: pa.DataType) -> pa.DataType:
    """View types become their plain forms: every engine and kernel supports those."""
    if pa.types.is_string_view(arrow_type) or pa.types.is_large_string(arrow_type):
        return pa.string()
    if pa.types.is_binary_view(arrow_type) or pa.types.is_large_binary(arrow_type):
        return pa.binary()
    if pa.types.is_dictionary(arrow_type):
        return storage_type(arrow_type.value_type)
    return arrow_type


def storage_schema(schema: pa.Schema) -> pa.Schema:
    return pa.schema(
        [pa.field(f.name, storage_type(f.type), f.nullable) for f in schema],
    )
