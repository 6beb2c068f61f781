"""Parsing and name resolution: SQL text to a qualified SQLGlot tree, or a clear error."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable

import duckdb
import pyarrow as pa
from sqlglot import exp
from sqlglot.dialects.dialect import Dialect
from sqlglot.errors import OptimizeError, ParseError, TokenError
from sqlglot.optimizer.qualify import qualify
from sqlglot.tokenizer_core import Token, TokenType

from shardflow.catalog import Catalog, TableSpec, name_key
from shardflow.errors import (
    NotDistributable,
    QueryError,
    SqlSyntaxError,
    UnknownColumnError,
    UnknownTableError,
    UnreadableSql,
    UnsupportedError,
)
from shardflow.sql import analysis as a
from shardflow.sql import outputs

DIALECT = "duckdb"
_DIALECT = Dialect.get_or_raise(DIALECT)
QUERY_TYPES = (exp.Select, exp.SetOperation)
CHANGES = (exp.Insert, exp.Update, exp.Delete, exp.Create, exp.Drop, exp.Alter, exp.Merge)


def sql_type(arrow_type: pa.DataType) -> str:
    """The SQL type name of an Arrow type, for SQLGlot's schema."""
    if pa.types.is_boolean(arrow_type):
        return "BOOLEAN"
    if pa.types.is_int8(arrow_type):
        return "TINYINT"
    if pa.types.is_int16(arrow_type):
        return "SMALLINT"
    if pa.types.is_int32(arrow_type):
        return "INT"
    if pa.types.is_int64(arrow_type):
        return "BIGINT"
    if pa.types.is_unsigned_integer(arrow_type):
        return "UBIGINT"
    if pa.types.is_float32(arrow_type):
        return "FLOAT"
    if pa.types.is_floating(arrow_type):
        return "DOUBLE"
    if pa.types.is_decimal(arrow_type):
        return f"DECIMAL({arrow_type.precision}, {arrow_type.scale})"
    if pa.types.is_date(arrow_type):
        return "DATE"
    if pa.types.is_timestamp(arrow_type):
        return "TIMESTAMPTZ" if arrow_type.tz else "TIMESTAMP"
    if pa.types.is_time(arrow_type):
        return "TIME"
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return "VARCHAR"
    if pa.types.is_binary(arrow_type) or pa.types.is_large_binary(arrow_type):
        return "BLOB"
    return "UNKNOWN"


def catalog_schema(catalog: Catalog) -> dict[str, object]:
    """SQLGlot's schema of the catalog, keyed as DuckDB compares names (:func:`name_key`)."""
    return {
        name_key(name): {name_key(field.name): sql_type(field.type) for field in spec.schema}
        for name, spec in catalog.tables.items()
    }


MAX_NESTING = 30
"""Deepest nesting of brackets and CASE expressions the planner accepts (DuckDB's own
limit is 1,000). SQLGlot parses recursively, about 25 Python frames a level, under
Python's default limit of 1,000 frames: 30 levels plan even when the caller is 150 frames
deep (measured for parentheses, function calls, scalar subqueries and arithmetic)."""


def tokenize(sql: str) -> list[Token]:
    """``sql``'s tokens in shardflow's dialect (raises SQLGlot's error when it cannot)."""
    return _DIALECT.tokenize(sql)


def parse(sql: str) -> exp.Expr:
    """Parse one SELECT statement (with CTEs, set operations, subqueries)."""
    if not isinstance(sql, str):
        raise SqlSyntaxError(f"a query must be a string, not {type(sql).__name__}")
    dialect = _DIALECT
    try:
        tokens = tokenize(sql)
        depth = _nesting(tokens)
        if depth > MAX_NESTING:
            raise UnsupportedError(
                f"the query nests brackets or CASE expressions {depth} levels deep; "
                f"shardflow plans at most {MAX_NESTING} (flatten the expression, e.g. "
                "drop redundant parentheses)"
            )
        parsed = dialect.parser().parse(tokens, sql)
        # a comment after the last ';' parses as a statement of its own
        statements = [s for s in parsed if s is not None and not isinstance(s, exp.Semicolon)]
    except (ParseError, TokenError) as error:
        raise syntax_error(sql, error) from None
    if not statements:
        raise SqlSyntaxError("the query is empty")
    if len(statements) > 1:
        raise UnsupportedError("db.sql() runs one statement at a time; split the text at ';'")
    tree = statements[0]
    while isinstance(tree, exp.Subquery) and isinstance(tree.this, (exp.Subquery, *QUERY_TYPES)):
        if any(value for key, value in tree.args.items() if key != "this"):
            # ``(SELECT ...) LIMIT 1``: the modifier belongs to the brackets, not the query
            raise NotDistributable("a bracketed query with ORDER BY or LIMIT after the brackets")
        tree = tree.this
    if not isinstance(tree, QUERY_TYPES) and is_select(sql):  # (VALUES ...), DuckDB's own
        raise NotDistributable(f"a {tree.key.upper()} query")
    if not isinstance(tree, QUERY_TYPES):
        kind = tree.key.upper()
        if isinstance(tree, CHANGES) and (tree.args.get("with_") or tree.args.get("with")):
            raise UnsupportedError(
                f"a WITH before {kind} is not supported yet: write the common table "
                f"expression where it is read ({kind} ... FROM (SELECT ...) AS name, or a "
                "subquery)"
            )
        hint = (
            "shardflow adds rows (INSERT INTO ... SELECT | VALUES, db.insert()), changes "
            "and deletes them (UPDATE, DELETE), empties tables (TRUNCATE t), makes tables "
            "(CREATE TABLE ... AS SELECT, db.create_table()) and drops them, each through "
            "db.sql(), not as a query"
            if isinstance(tree, CHANGES)
            else "write it as a SELECT"
        )
        raise UnsupportedError(
            f"db.sql() runs queries and the statements that add rows, make and drop tables; "
            f"{kind} statements are not supported: {hint}"
        )
    a.balance_connectors(tree)
    a.balance_set_operations(tree)
    return tree


_OPENING = {TokenType.L_PAREN, TokenType.L_BRACKET, TokenType.L_BRACE, TokenType.CASE}
_CLOSING = {TokenType.R_PAREN, TokenType.R_BRACKET, TokenType.R_BRACE, TokenType.END}


def _nesting(tokens: list[Token]) -> int:
    depth = deepest = 0
    for token in tokens:
        if token.token_type in _OPENING:
            depth += 1
            deepest = max(deepest, depth)
        elif token.token_type in _CLOSING:
            depth -= 1
    return deepest


def resolve(tree: exp.Expr, catalog: Catalog) -> exp.Expr:
    """Check table and column names against the catalog, qualify every column, give every
    SELECT unique output names and settle positional references (:mod:`.outputs`).

    Names match as DuckDB matches them (:func:`shardflow.catalog.name_key`, which SQLGlot's
    DuckDB dialect follows too); catalog tables and columns are then written as the
    catalog spells them, other names (aliases, CTEs) in their normalised form."""
    ctes = tables_read(tree, catalog)[1]
    refuse_row_ids(tree, catalog)
    schema = catalog_schema(catalog)
    outputs.name_outputs_as_duckdb(tree)
    # DuckDB names a derived table's repeated outputs x, x_1: the query may say x_1
    outputs.unique_output_names(tree, root=False)
    outputs.hide_positions(tree)
    qualified = _qualify(tree, schema)
    # a derived table whose output names repeat keeps SQLGlot from expanding a star over
    # it; once they are unique (as DuckDB makes them), qualify again to expand it
    while outputs.unique_output_names(qualified, root=False) and outputs.has_unexpanded_star(
        qualified
    ):
        qualified = _qualify(qualified, schema)
    _bind_order_by_names(qualified, catalog, ctes)
    outputs.unique_output_names(qualified)
    outputs.resolve_positions(qualified)
    _spell_as_catalog(qualified, catalog, ctes)
    return qualified


def named_tables(sql: str, error: Exception | None = None) -> set[str]:
    """The table names ``sql`` reads as far as SQLGlot can read it (CTE names among them),
    and the table DuckDB's ``error`` says it does not have: what a session that routes only
    the tables it has used fetches before planning ``sql`` again."""
    names: set[str] = set()
    try:
        for statement in _DIALECT.parse(sql):
            if statement is not None:
                names |= a.table_names(statement)
    except (ParseError, TokenError, RecursionError):
        pass
    if error is not None:
        names |= set(_MISSING_TABLE.findall(str(error)))
    return names


_MISSING_TABLE = re.compile(r'Table with name "?([^"\s!]+)"? does not exist')


def tables_read(tree: exp.Expr, catalog: Catalog) -> tuple[list[TableSpec], set[str]]:
    """The catalog tables ``tree`` reads, and the keys of the CTE names it defines. Raises
    :class:`UnknownTableError` for a table that is neither."""
    ctes = {name_key(cte.alias_or_name) for cte in tree.find_all(exp.CTE)}
    read: dict[str, TableSpec] = {}
    for table in tree.find_all(exp.Table):
        if not isinstance(table.this, exp.Identifier):
            continue  # a table function such as read_parquet(...) or range(...)
        if table.args.get("db") or table.args.get("catalog"):
            raise UnknownTableError(
                f"unknown table {table.sql(DIALECT)}: shardflow tables have no schema prefix"
            )
        spec = catalog.find_table(table.name)
        if spec is None and name_key(table.name) not in ctes:
            known = ", ".join(sorted(catalog.tables)) or "none yet"
            raise UnknownTableError(f"unknown table {table.name!r} (tables: {known})")
        if spec is not None and name_key(table.name) not in ctes:
            read.setdefault(spec.name, spec)
    return sorted(read.values(), key=lambda spec: spec.name), ctes


def refuse_row_ids(tree: exp.Expr, catalog: Catalog) -> None:
    """DuckDB's ``rowid`` pseudo-column numbers a table's rows as stored in one file; a
    table cut into shards has no such numbering, so no answer could match DuckDB's."""
    _refuse_row_ids_among((column.name for column in tree.find_all(exp.Column)), catalog)


def refuse_row_ids_in_text(sql: str, catalog: Catalog) -> None:
    """:func:`refuse_row_ids` for text SQLGlot cannot parse: any word ``rowid`` counts."""
    words = tokenize(sql)
    _refuse_row_ids_among((t.text for t in words if t.token_type == TokenType.VAR), catalog)


FILE_FUNCTIONS = re.compile(
    r"(read_|parquet_|iceberg_|delta_|sniff_|st_read|glob$|.*_scan$)", re.IGNORECASE
)
"""DuckDB's functions that read files (``read_csv``, ``read_blob``, ``parquet_metadata``,
``glob``, ``parquet_scan``, ...): a worker's DuckDB opens shards' checkpoint files, so its
own file access is on within their folders; queries never use it."""


def refuse_file_functions(sql: str) -> None:
    """Refuse a query that calls a function reading files (any word of
    :data:`FILE_FUNCTIONS` followed by a bracket), parsed or not."""
    words = [t for t in tokenize(sql) if t.token_type != TokenType.STRING]
    for word, after in itertools.pairwise(words):
        if after.token_type == TokenType.L_PAREN and FILE_FUNCTIONS.match(word.text):
            raise UnsupportedError(
                f"{word.text}(): shardflow queries read shardflow tables, not files; load "
                "the file into a table first (db.create_table, shardflow load)"
            )


def is_select(sql: str) -> bool:
    """Whether DuckDB reads ``sql`` as one SELECT statement (a query, not a command)."""
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error:
        return False
    return len(statements) == 1 and statements[0].type == duckdb.StatementType.SELECT


def _refuse_row_ids_among(names: Iterable[str], catalog: Catalog) -> None:
    if not any(name_key(name) == "rowid" for name in names):
        return
    columns = {name_key(n) for spec in catalog.tables.values() for n in spec.schema.names}
    if "rowid" not in columns:
        raise UnsupportedError(
            "rowid: shardflow tables are cut into shards and have no DuckDB row ids; "
            "add an id column to the table instead"
        )


def _qualify(tree: exp.Expr, schema: dict[str, object]) -> exp.Expr:
    try:
        return qualify(
            tree,
            schema=schema,
            dialect=DIALECT,
            identify=False,
            validate_qualify_columns=True,
        )
    except OptimizeError as error:
        message = _first_line(error)
        if "could not be resolved" in message or "Unknown column" in message:
            raise UnknownColumnError(f"unknown column: {message}") from None
        raise QueryError(f"cannot resolve the query: {message}") from None


def _bind_order_by_names(tree: exp.Expr, catalog: Catalog, ctes: set[str]) -> None:
    """Bind names inside ORDER BY expressions as DuckDB does: a bare ``ORDER BY x`` names
    an output first, but in ``ORDER BY x + 0`` a column of the FROM clause comes first and
    an output name only when no source has one. SQLGlot binds both to the output; an output
    name left is replaced by its expression, so that rewrites see the grouped expression:
    ``SELECT -col1 AS col0 FROM t ORDER BY col0 + 0`` orders by ``t.col0``, not ``-t.col1``.
    """
    bodies = {name_key(c.alias_or_name): c.this for c in tree.find_all(exp.CTE)}
    for select in list(tree.find_all(exp.Select)):
        order = select.args.get("order")
        if order is None:
            continue
        outputs_by_key = {name_key(p.alias_or_name): p for p in select.expressions}
        for ordered in order.expressions:
            if isinstance(a.unparen(ordered.this), exp.Column):
                continue  # ORDER BY x: the output x, as SQLGlot has it
            for column in list(a.walk_block(ordered.this)):
                if not isinstance(column, exp.Column) or column.table:
                    continue
                source = _source_with_column(select, column.name, catalog, ctes, bodies)
                if source is not None:
                    column.set("table", a.identifier(source))
                elif name_key(column.name) in outputs_by_key:
                    output = outputs_by_key[name_key(column.name)].unalias()
                    column.replace(exp.paren(output.copy(), copy=False))


def _source_with_column(
    select: exp.Select, name: str, catalog: Catalog, ctes: set[str], bodies: dict[str, exp.Expr]
) -> str | None:
    """The alias of the source of ``select`` that has a column ``name``, if one has."""
    key = name_key(name)
    for ref in a.sources(select):
        node = ref.node
        names: list[str] = []
        if isinstance(node, exp.Table) and isinstance(node.this, exp.Identifier):
            body = bodies.get(name_key(node.name)) if name_key(node.name) in ctes else None
            spec = catalog.find_table(node.name) if body is None else None
            if spec is not None:
                names = spec.schema.names
            elif body is not None:
                names = _output_names(body)
        elif isinstance(node, exp.Subquery):
            names = _output_names(node.this)
        if any(name_key(n) == key for n in names):
            return ref.alias
    return None


def _output_names(query: exp.Expr) -> list[str]:
    while isinstance(query, exp.SetOperation):
        query = query.left
    while isinstance(query, exp.Subquery):
        query = query.this
    return [p.alias_or_name for p in query.selects] if isinstance(query, exp.Query) else []


def _spell_as_catalog(tree: exp.Expr, catalog: Catalog, ctes: set[str]) -> None:
    """Write every catalog table, and every column read from one, as the catalog spells it
    (qualification left them normalised), so that engines matching names exactly see the
    names the shards carry."""
    tables: dict[int, TableSpec] = {}  # id(Table node) -> its table
    sources: dict[int, dict[str, TableSpec]] = {}  # id(SELECT) -> its catalog sources
    for select in tree.find_all(exp.Select):
        own: dict[str, TableSpec] = {}
        for ref in a.sources(select):
            node = ref.node
            if not isinstance(node, exp.Table) or not isinstance(node.this, exp.Identifier):
                continue
            if name_key(node.name) in ctes:
                continue
            spec = catalog.find_table(node.name)
            if spec is not None:
                own[ref.alias] = spec
                tables[id(node)] = spec
        sources[id(select)] = own
    for table in tree.find_all(exp.Table):
        spec = tables.get(id(table))
        if spec is not None:
            table.set("this", a.identifier(spec.name))
    for column in tree.find_all(exp.Column):
        if not column.table or not isinstance(column.this, exp.Identifier):
            continue
        scope: exp.Select | None = column.find_ancestor(exp.Select)
        while scope is not None:
            spec = sources.get(id(scope), {}).get(column.table)
            if spec is not None:
                field = spec.find_column(column.name)
                if field is not None:
                    column.set("this", a.identifier(field.name))
                break
            if any(ref.alias == column.table for ref in a.sources(scope)):
                break  # a source of another kind: its names are its own
            scope = scope.parent_select


def syntax_error(sql: str, error: ParseError | TokenError) -> QueryError:
    """The error for text SQLGlot cannot parse. DuckDB's parser is the judge of DuckDB's
    syntax and points at the mistake itself (``LINE n:`` and a caret under the token), so a
    :class:`SqlSyntaxError` carries its message; text DuckDB reads but SQLGlot does not is an
    :class:`UnsupportedError` that shows where SQLGlot stopped."""
    try:
        duckdb.extract_statements(sql)
    except duckdb.Error as refused:
        return SqlSyntaxError(str(refused).strip())
    return UnreadableSql(
        f"shardflow's SQL parser cannot read this query, though DuckDB can: {_where(sql, error)}"
    )


def _where(sql: str, error: ParseError | TokenError) -> str:
    """SQLGlot's complaint, with the line it stopped on and a caret under the column."""
    found = error.errors[0] if isinstance(error, ParseError) and error.errors else None
    if not found or not found.get("line"):
        return _first_line(error)
    line, col = int(found["line"]), int(found["col"])
    text = sql.splitlines()[line - 1] if line <= len(sql.splitlines()) else ""
    highlight = max(1, len(str(found.get("highlight") or "")))
    caret = " " * max(0, col - highlight) + "^" * highlight
    return f"{found['description']} (line {line}, column {col})\n  {text}\n  {caret}"


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
