"""The Arrow Flight SQL messages shardflow speaks, and the Arrow schemas of its metadata calls.

Flight SQL carries protobuf messages packed in ``google.protobuf.Any`` inside Flight
descriptors, tickets and action bodies. No maintained PyPI package ships these messages for
the current protocol (the one that does stops before bulk ingest and pins an old SQLAlchemy),
so the subset shardflow uses is declared here as a protobuf descriptor, with the names and
field numbers of ``FlightSql.proto``; the protobuf library does all encoding and decoding.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
from google.protobuf import any_pb2, descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError, Message

PACKAGE = "arrow.flight.protocol.sql"
PROFILE_KEY = b"shardflow.profile"
"""The schema metadata that carries a query's profile beside its answer (the ``profile``
action's answer)."""
TYPE_URL_PREFIX = "type.googleapis.com/"

_F = descriptor_pb2.FieldDescriptorProto
_SCALARS = {
    "string": _F.TYPE_STRING,
    "bytes": _F.TYPE_BYTES,
    "bool": _F.TYPE_BOOL,
    "int64": _F.TYPE_INT64,
    "int32": _F.TYPE_INT32,
    "uint32": _F.TYPE_UINT32,
}

# message -> [(field, number, type, repeated)]; a type that is not a scalar names a message
# (or, with "enum:", an enum) of this file
_MESSAGES: dict[str, list[tuple[str, int, str, bool]]] = {
    "CommandGetSqlInfo": [("info", 1, "uint32", True)],
    "CommandGetCatalogs": [],
    "CommandGetDbSchemas": [("catalog", 1, "string", False),
                            ("db_schema_filter_pattern", 2, "string", False)],
    "CommandGetTables": [("catalog", 1, "string", False),
                         ("db_schema_filter_pattern", 2, "string", False),
                         ("table_name_filter_pattern", 3, "string", False),
                         ("table_types", 4, "string", True),
                         ("include_schema", 5, "bool", False)],
    "CommandGetTableTypes": [],
    "CommandGetPrimaryKeys": [("catalog", 1, "string", False), ("db_schema", 2, "string", False),
                              ("table", 3, "string", False)],
    "CommandGetXdbcTypeInfo": [("data_type", 1, "int32", False)],
    "CommandStatementQuery": [("query", 1, "string", False), ("transaction_id", 2, "bytes", False)],
    "CommandStatementUpdate": [("query", 1, "string", False),
                               ("transaction_id", 2, "bytes", False)],
    "TicketStatementQuery": [("statement_handle", 1, "bytes", False)],
    "CommandPreparedStatementQuery": [("prepared_statement_handle", 1, "bytes", False)],
    "CommandPreparedStatementUpdate": [("prepared_statement_handle", 1, "bytes", False)],
    "ActionCreatePreparedStatementRequest": [("query", 1, "string", False),
                                             ("transaction_id", 2, "bytes", False)],
    "ActionCreatePreparedStatementResult": [("prepared_statement_handle", 1, "bytes", False),
                                            ("dataset_schema", 2, "bytes", False),
                                            ("parameter_schema", 3, "bytes", False)],
    "ActionClosePreparedStatementRequest": [("prepared_statement_handle", 1, "bytes", False)],
    "DoPutUpdateResult": [("record_count", 1, "int64", False)],
    "DoPutPreparedStatementResult": [("prepared_statement_handle", 1, "bytes", False)],
    "CommandStatementIngest": [
        ("table_definition_options", 1, "CommandStatementIngest.TableDefinitionOptions", False),
        ("table", 2, "string", False),
        ("schema", 3, "string", False),
        ("catalog", 4, "string", False),
        ("temporary", 5, "bool", False),
        ("transaction_id", 6, "bytes", False),
        ("options", 1000, "CommandStatementIngest.OptionsEntry", True),
    ],
}  # fmt: skip

# CommandStatementIngest.TableDefinitionOptions
IF_NOT_EXIST = {"UNSPECIFIED": 0, "CREATE": 1, "FAIL": 2}
IF_EXISTS = {"UNSPECIFIED": 0, "FAIL": 1, "APPEND": 2, "REPLACE": 3}


def _field(
    name: str, number: int, kind: str, repeated: bool
) -> descriptor_pb2.FieldDescriptorProto:
    field = _F(name=name, number=number, json_name=_json_name(name))
    field.label = _F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL
    if kind.startswith("enum:"):
        field.type = _F.TYPE_ENUM
        field.type_name = f".{PACKAGE}.{kind[5:]}"
    elif kind in _SCALARS:
        field.type = _SCALARS[kind]
    else:
        field.type = _F.TYPE_MESSAGE
        field.type_name = f".{PACKAGE}.{kind}"
    return field


def _json_name(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def _ingest_nested(message: descriptor_pb2.DescriptorProto) -> None:
    options = message.nested_type.add(name="TableDefinitionOptions")
    for enum_name, values in (
        ("TableNotExistOption", IF_NOT_EXIST),
        ("TableExistsOption", IF_EXISTS),
    ):
        prefix = (
            "TABLE_NOT_EXIST_OPTION_"
            if enum_name == "TableNotExistOption"
            else ("TABLE_EXISTS_OPTION_")
        )
        enum = options.enum_type.add(name=enum_name)
        for value_name, number in values.items():
            enum.value.add(name=prefix + value_name, number=number)
    base = "CommandStatementIngest.TableDefinitionOptions."
    options.field.append(_field("if_not_exist", 1, f"enum:{base}TableNotExistOption", False))
    options.field.append(_field("if_exists", 2, f"enum:{base}TableExistsOption", False))
    entry = message.nested_type.add(name="OptionsEntry")
    entry.options.map_entry = True
    entry.field.append(_field("key", 1, "string", False))
    entry.field.append(_field("value", 2, "string", False))


def _build() -> dict[str, type[Message]]:
    file = descriptor_pb2.FileDescriptorProto(
        name="shardflow/flight_sql_subset.proto", package=PACKAGE, syntax="proto3"
    )
    for name, fields in _MESSAGES.items():
        message = file.message_type.add(name=name)
        if name == "CommandStatementIngest":
            _ingest_nested(message)
        for field in fields:
            message.field.append(_field(*field))
    pool = descriptor_pool.DescriptorPool()
    described = pool.Add(file)
    del described
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PACKAGE}.{name}"))
        for name in _MESSAGES
    }


MESSAGES = _build()


def new(name: str, **fields: Any) -> Any:
    """A new message of this name (``new("CommandStatementQuery", query="SELECT 1")``)."""
    return MESSAGES[name](**fields)


def pack(message: Message) -> bytes:
    """The message packed in ``google.protobuf.Any`` and serialized, as Flight SQL sends it."""
    packed = any_pb2.Any()
    packed.Pack(message, type_url_prefix=TYPE_URL_PREFIX.rstrip("/"))
    return bytes(packed.SerializeToString())


class MalformedCommand(ValueError):
    """Bytes that are not a Flight SQL message shardflow knows."""


def unpack(data: bytes) -> tuple[str, Any]:
    """(message name, message) of a packed Flight SQL command; MalformedCommand otherwise."""
    packed = any_pb2.Any()
    try:
        packed.ParseFromString(data)
    except DecodeError:
        raise MalformedCommand("not a Flight SQL command (no protobuf Any)") from None
    prefix = f"{TYPE_URL_PREFIX}{PACKAGE}."
    if not packed.type_url.startswith(prefix):
        raise MalformedCommand(f"not a Flight SQL command: {packed.type_url[:80]!r}")
    name = packed.type_url[len(prefix) :]
    if name not in MESSAGES:
        raise MalformedCommand(f"Flight SQL command {name} is not supported by shardflow")
    message = MESSAGES[name]()
    try:
        message.ParseFromString(packed.value)
    except DecodeError:
        raise MalformedCommand(f"malformed Flight SQL {name}") from None
    return name, message


# -- the Arrow schemas of the metadata calls (FlightSql.proto documents each) --------------
CATALOGS_SCHEMA = pa.schema([pa.field("catalog_name", pa.utf8(), nullable=False)])
DB_SCHEMAS_SCHEMA = pa.schema(
    [pa.field("catalog_name", pa.utf8()), pa.field("db_schema_name", pa.utf8(), nullable=False)]
)
TABLES_SCHEMA = pa.schema(
    [
        pa.field("catalog_name", pa.utf8()),
        pa.field("db_schema_name", pa.utf8()),
        pa.field("table_name", pa.utf8(), nullable=False),
        pa.field("table_type", pa.utf8(), nullable=False),
    ]
)
TABLES_WITH_SCHEMA = TABLES_SCHEMA.append(pa.field("table_schema", pa.binary(), nullable=False))
TABLE_TYPES_SCHEMA = pa.schema([pa.field("table_type", pa.utf8(), nullable=False)])
PRIMARY_KEYS_SCHEMA = pa.schema(
    [
        pa.field("catalog_name", pa.utf8()),
        pa.field("db_schema_name", pa.utf8()),
        pa.field("table_name", pa.utf8(), nullable=False),
        pa.field("column_name", pa.utf8(), nullable=False),
        pa.field("key_name", pa.utf8()),
        pa.field("key_sequence", pa.int32(), nullable=False),
    ]
)
SQL_INFO_VALUE = pa.dense_union(
    [
        pa.field("string_value", pa.utf8()),
        pa.field("bool_value", pa.bool_()),
        pa.field("bigint_value", pa.int64()),
        pa.field("int32_bitmask", pa.int32()),
        pa.field("string_list", pa.list_(pa.field("item", pa.utf8()))),
        pa.field(
            "int32_to_int32_list_map",
            pa.map_(pa.int32(), pa.list_(pa.field("item", pa.int32()))),
        ),
    ],
    type_codes=[0, 1, 2, 3, 4, 5],
)
SQL_INFO_SCHEMA = pa.schema(
    [
        pa.field("info_name", pa.uint32(), nullable=False),
        pa.field("value", SQL_INFO_VALUE, nullable=False),
    ]
)

# SqlInfo ids (FlightSql.proto's enum SqlInfo) shardflow answers
SERVER_NAME, SERVER_VERSION, SERVER_ARROW_VERSION, SERVER_READ_ONLY = 0, 1, 2, 3
SERVER_SQL, SERVER_SUBSTRAIT, SERVER_TRANSACTION, SERVER_CANCEL = 4, 5, 8, 9
SQL_DDL_CATALOG, SQL_DDL_SCHEMA, SQL_DDL_TABLE = 500, 501, 502
SQL_IDENTIFIER_QUOTE_CHAR = 504


def sql_info_table(values: dict[int, str | bool | int]) -> pa.Table:
    """The GetSqlInfo answer: one row per info id, its value in the dense union."""
    ids = sorted(values)
    type_ids, offsets = [], []
    children: list[list[Any]] = [[] for _ in range(6)]
    for info in ids:
        value = values[info]
        code = 1 if isinstance(value, bool) else 2 if isinstance(value, int) else 0
        type_ids.append(code)
        offsets.append(len(children[code]))
        children[code].append(value)
    arrays = [pa.array(children[i], type=SQL_INFO_VALUE.field(i).type) for i in range(6)]
    union = pa.UnionArray.from_dense(
        pa.array(type_ids, type=pa.int8()),
        pa.array(offsets, type=pa.int32()),
        arrays,
        [SQL_INFO_VALUE.field(i).name for i in range(6)],
        [0, 1, 2, 3, 4, 5],
    )
    return pa.Table.from_arrays([pa.array(ids, type=pa.uint32()), union], schema=SQL_INFO_SCHEMA)
