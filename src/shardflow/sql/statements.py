"""The statements that change tables, read once for every door: ``db.sql``, the Flight SQL
service and the command line run ``DROP TABLE [IF EXISTS] t``, ``CREATE TABLE t AS
<query>``, ``INSERT INTO t [(columns)] <query> | VALUES ...``, ``TRUNCATE [TABLE] t``,
``DELETE FROM t [WHERE ...]`` and ``UPDATE t SET c = e, ... [WHERE ...]``
through this one reading (what to do, and the query that gives the rows); everything else
is a query.

>>> statement_of("INSERT INTO t (a, b) VALUES (1, 'x')")
InsertInto(name='t', columns=('a', 'b'), query="SELECT * FROM (VALUES (1, 'x')) AS v")
>>> statement_of("SELECT 1") is None
True
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass

import pyarrow as pa
import sqlglot
from sqlglot import exp

from shardflow.errors import QueryError, UnknownColumnError, UnsupportedError
from shardflow.sql.parse import sql_type, syntax_error

logging.getLogger("sqlglot").addFilter(
    lambda record: "Falling back to parsing as a 'Command'" not in record.getMessage()
)  # a statement SQLGlot reads only as text is refused here, saying so: no warning besides

_CHANGE_VERB = re.compile(r"^\s*(drop|create|insert|truncate|delete|update)\b", re.IGNORECASE)
_WITH = re.compile(r"^\s*with\b", re.IGNORECASE)
_CHANGE_WORD = re.compile(r"\b(insert|update|delete)\b", re.IGNORECASE)
"""A WITH query without one of these words is a query: not parsed again to see."""


@dataclass(frozen=True)
class DropTable:
    name: str
    if_exists: bool


@dataclass(frozen=True)
class CreateTableAs:
    name: str
    query: str
    """The query whose answer the new table holds."""


@dataclass(frozen=True)
class InsertInto:
    name: str
    columns: tuple[str, ...] | None
    """The target's columns the rows fill, in order (None: all of them, in order)."""
    query: str
    """The query whose answer is appended (``VALUES`` as a query over them)."""


@dataclass(frozen=True)
class Truncate:
    name: str


@dataclass(frozen=True)
class ChangeRows:
    """``DELETE FROM t [WHERE ...]`` or ``UPDATE t SET c = e, ... [WHERE ...]``: SQL over
    the table's own rows, named ``alias`` (the table's name, or the alias it was given)."""

    name: str
    alias: str
    where: str | None
    sets: tuple[tuple[str, str], ...] = ()
    """Per column set, its new value (an expression over the row's old values)."""
    returning: tuple[str, ...] | None = None
    """What each changed row gives back (``RETURNING``: the SQL of each item of its select
    list, over the row as the statement leaves it); None: the statement answers the count."""

    @property
    def delete(self) -> bool:
        return not self.sets


Change = DropTable | CreateTableAs | InsertInto | Truncate | ChangeRows


def changes_tables(sql: str) -> bool:
    """Whether ``sql`` is a statement that changes tables (one that needs the writer role
    through the service), whether shardflow runs it or not: it begins with such a verb,
    or with common table expressions before one (``WITH x AS (...) DELETE ...``)."""
    if not isinstance(sql, str):
        return False
    if _CHANGE_VERB.match(sql) is not None:
        return True
    if _WITH.match(sql) is None or _CHANGE_WORD.search(sql) is None:
        return False
    try:
        tree = sqlglot.parse_one(sql, read="duckdb")
    except (sqlglot.errors.ParseError, sqlglot.errors.TokenError):
        return False  # not run either: the planner says what is wrong with it
    return not isinstance(tree, exp.Query)


def statement_of(sql: str) -> Change | None:
    """What ``sql`` changes, or None where it is a query (the planner's to read). A
    statement of these verbs that shardflow does not run is a ``QueryError`` saying what
    it runs."""
    if not changes_tables(sql):
        return None
    try:
        statements = [s for s in sqlglot.parse(sql, read="duckdb") if s is not None]
    except (sqlglot.errors.ParseError, sqlglot.errors.TokenError) as error:
        raise syntax_error(sql, error) from None
    if len(statements) != 1:
        raise QueryError("one statement at a time; split the text at ';'")
    statement = statements[0]
    if isinstance(statement, exp.Drop) and statement.kind == "TABLE":
        dropped = statement.find(exp.Table)
        if dropped is None:
            raise QueryError("DROP TABLE names no table")
        return DropTable(dropped.name, bool(statement.args.get("exists")))
    if isinstance(statement, exp.Create) and statement.kind == "TABLE":
        select = statement.expression
        if not isinstance(select, exp.Query):
            raise QueryError(
                "shardflow creates tables from a query (CREATE TABLE t AS SELECT ...), by "
                "db.create_table() or by bulk ingest; a column list alone has no rows to place"
            )
        return CreateTableAs(statement.this.name, select.sql("duckdb"))
    if isinstance(statement, exp.TruncateTable):
        tables = statement.expressions
        if len(tables) != 1 or not isinstance(tables[0], exp.Table):
            raise QueryError("TRUNCATE empties one table at a time: TRUNCATE [TABLE] t")
        if statement.args.get("is_database"):
            raise QueryError("TRUNCATE empties a table, not a database: TRUNCATE [TABLE] t")
        return Truncate(tables[0].name)
    ctes = statement.args.get("with_")
    if isinstance(statement, exp.Insert):
        target = statement.this
        source = statement.expression
        if isinstance(source, exp.Values):
            alias = exp.TableAlias(this=exp.to_identifier("v"))
            source = exp.select("*").from_(exp.Subquery(this=source, alias=alias))
        if not isinstance(source, exp.Query):
            raise QueryError("INSERT takes its rows from a query or VALUES")
        if isinstance(ctes, exp.With):  # WITH x AS (...) INSERT ...: the query's own
            if source.args.get("with_"):
                raise UnsupportedError("a WITH before INSERT and another in its query")
            source = source.copy()
            source.set("with_", ctes.copy())
        if isinstance(target, exp.Schema):
            columns = tuple(c.name for c in target.expressions)
            return InsertInto(target.this.name, columns, source.sql("duckdb"))
        return InsertInto(target.name, None, source.sql("duckdb"))
    if isinstance(statement, exp.Delete | exp.Update):
        return _change_rows(_without_ctes(statement))
    if isinstance(ctes, exp.With):
        raise UnsupportedError(f"a WITH before {statement.key.upper()} is not supported")
    what = sql.split(None, 1)[0].upper() if isinstance(statement, exp.Command) else None
    raise QueryError(
        "shardflow runs SELECT, DROP TABLE, CREATE TABLE ... AS SELECT, INSERT INTO ... "
        "SELECT/VALUES, DELETE, UPDATE and TRUNCATE [TABLE] t"
        + (f"; it cannot read this {what} statement" if what else f"; not {statement.key.upper()}")
    )


def _change_rows(statement: exp.Delete | exp.Update) -> ChangeRows:
    """A DELETE or UPDATE of one table's rows by its own values and subqueries (the
    session runs the uncorrelated ones first, :func:`inline_subqueries`, and sends the
    tables the others read to every shard, :func:`shipped_reads`). What it would give back
    (``RETURNING``) is refused saying so.

    Rows chosen by other tables become subqueries, as DuckDB's own statements read:
    ``DELETE FROM t USING u WHERE c`` deletes the rows for which ``EXISTS (SELECT 1 FROM u
    WHERE c)``; ``UPDATE t SET x = e FROM u WHERE c`` sets ``x`` to ``(SELECT e FROM u
    WHERE c LIMIT 1)`` where ``EXISTS (SELECT 1 FROM u WHERE c)`` (a row that several rows
    of ``u`` match takes one of them, as DuckDB's UPDATE ... FROM does)."""
    verb = "DELETE" if isinstance(statement, exp.Delete) else "UPDATE"
    target = statement.this
    if not isinstance(target, exp.Table) or not target.name:
        raise QueryError(f"{verb} names no table")
    returned = statement.args.get("returning")
    if isinstance(returned, exp.Returning) and returned.args.get("into"):
        raise UnsupportedError(f"{verb} ... RETURNING ... INTO: shardflow answers the rows")
    returning = (
        tuple(e.sql("duckdb") for e in returned.expressions)
        if isinstance(returned, exp.Returning)
        else None
    )
    where = statement.args.get("where")
    condition = where.this.sql("duckdb") if isinstance(where, exp.Where) else None
    sets: list[tuple[str, str]] = []
    if isinstance(statement, exp.Update):
        for assignment in statement.expressions:
            sets.extend(_assignments(assignment))
    joined = _joined(statement)
    if joined is not None:
        filtered = f" WHERE {condition}" if condition else ""
        sets = [(c, f"(SELECT {v} FROM {joined}{filtered} LIMIT 1)") for c, v in sets]
        condition = f"EXISTS (SELECT 1 FROM {joined}{filtered})"
    alias = target.alias or target.name
    return ChangeRows(target.name, alias, condition, tuple(sets), returning)


def typed(expression: str, arrow_type: pa.DataType) -> str:
    """``expression`` cast to the SQL type of a column of ``arrow_type``; as it is where
    that type has no plain SQL name (a list, a struct: DuckDB casts it as it stores it)."""
    name = sql_type(arrow_type)
    return f"({expression})" if name == "UNKNOWN" else f"CAST(({expression}) AS {name})"


def _without_ctes(statement: exp.Delete | exp.Update) -> exp.Delete | exp.Update:
    """``statement`` with its common table expressions (``WITH x AS (...) DELETE ...``)
    written where they are read, each as a subquery under its name: the statement reads
    them as queries, as it reads any subquery."""
    ctes = statement.args.get("with_")
    if not isinstance(ctes, exp.With):
        return statement
    if ctes.args.get("recursive"):
        raise UnsupportedError(
            f"WITH RECURSIVE before {statement.key.upper()}: run the recursive query first "
            "and change the rows by its answer"
        )
    statement = statement.copy()
    statement.set("with_", None)
    bodies: dict[str, tuple[exp.Expr, list[exp.Identifier]]] = {}
    for cte in ctes.expressions:
        body = cte.this.copy()
        _read_as_subqueries(body, bodies)
        named = cte.args.get("alias")
        columns = list(named.columns) if isinstance(named, exp.TableAlias) else []
        bodies[cte.alias_or_name.lower()] = (body, columns)
    _read_as_subqueries(statement, bodies, changed=statement.this)
    return statement


def _read_as_subqueries(
    tree: exp.Expr,
    bodies: dict[str, tuple[exp.Expr, list[exp.Identifier]]],
    changed: exp.Expr | None = None,
) -> None:
    """Each table of ``tree`` that names one of ``bodies`` (besides ``changed``, the table a
    statement changes) replaced by that query, under the name it was read as, its
    columns named as the common table expression names them (``WITH v(a, b) AS ...``)."""
    for table in list(tree.find_all(exp.Table)):
        if table is changed or table.args.get("db") or table.args.get("catalog"):
            continue
        found = bodies.get(table.name.lower())
        if found is None or not isinstance(table.this, exp.Identifier):
            continue
        body, columns = found
        read_as = table.args.get("alias")
        if isinstance(read_as, exp.TableAlias) and read_as.columns:
            columns = list(read_as.columns)
        alias = exp.TableAlias(
            this=exp.to_identifier(table.alias_or_name), columns=[c.copy() for c in columns]
        )
        table.replace(exp.Subquery(this=body.copy(), alias=alias))


def _joined(statement: exp.Delete | exp.Update) -> str | None:
    """The tables ``USING`` (a DELETE's) or ``FROM`` (an UPDATE's) names, as SQL of a
    FROM clause; None where there is none."""
    using = statement.args.get("using")
    if using:
        return ", ".join(item.sql("duckdb") for item in using)
    found = statement.args.get("from_") or statement.args.get("from")
    return found.this.sql("duckdb") if isinstance(found, exp.From) else None


def _assignments(assignment: exp.Expr) -> list[tuple[str, str]]:
    """``c = v`` as one (column, value); ``(a, b) = (x, y)`` as a pair each, and
    ``(a, b) = v`` as ``v`` for each, as DuckDB reads them."""
    if not isinstance(assignment, exp.EQ):
        raise QueryError("UPDATE sets columns: UPDATE t SET c = value, ...")
    target, value = assignment.this, assignment.expression
    if any(
        isinstance(v, exp.Column)
        and v.name.upper() == "DEFAULT"
        and not v.table
        and not v.this.quoted
        for v in [value, *value.find_all(exp.Column)]
    ):
        raise UnsupportedError(
            "UPDATE ... SET c = DEFAULT: shardflow's tables keep no column defaults; set the "
            "value (NULL, say)"
        )
    if isinstance(target, exp.Column):
        return [(target.name, value.sql("duckdb"))]
    if not isinstance(target, exp.Tuple) or not all(
        isinstance(c, exp.Column) for c in target.expressions
    ):
        raise QueryError("UPDATE sets columns: UPDATE t SET c = value, (a, b) = (x, y), ...")
    columns = [c.name for c in target.expressions]
    if not isinstance(value, exp.Tuple):
        return [(column, value.sql("duckdb")) for column in columns]
    if len(value.expressions) != len(columns):
        raise QueryError(
            f"UPDATE SET ({', '.join(columns)}) = (...): expected {len(columns)} values, got "
            f"{len(value.expressions)}"
        )
    return [(c, v.sql("duckdb")) for c, v in zip(columns, value.expressions, strict=True)]


MAX_INLINED_VALUES = 100_000
"""The most values a subquery of a DELETE or UPDATE may answer (they become a list)."""


def inline_subqueries(sql: str, run: Callable[[str], pa.Table], outer: Collection[str] = ()) -> str:
    """``sql`` (a statement's WHERE or SET value) with each uncorrelated subquery replaced
    by its answer, which ``run`` gives (a query over the cluster): ``x IN (SELECT ...)`` by
    the list of values, ``EXISTS (SELECT ...)`` by TRUE or FALSE, a scalar ``(SELECT ...)``
    by its value (NULL where it has no row; more than one is an error, as DuckDB says). A
    subquery that reads the changed table's row (correlated: it does not run alone) stays,
    for every shard to evaluate per row (:func:`shipped_reads`).

    ``outer``: the names the changed table goes by, where ``sql`` is the WHERE. An
    ``EXISTS`` among its conditions that ties one column of the changed row to the rows it
    reads by ``=`` (``DELETE FROM t USING u WHERE t.k = u.k AND u.x > 0``) is read as ``t.k
    IN (SELECT u.k FROM u WHERE u.x > 0)`` where that subquery runs alone and answers at
    most :data:`MAX_INLINED_VALUES` values: the statement then carries those values (and
    is routed by them where the column is the key) rather than the table, to every shard."""
    tree = exp.Paren(this=sqlglot.parse_one(sql, read="duckdb"))  # a root to replace under
    if tree.find(exp.Query) is None:
        return sql
    names = {name.lower() for name in outer}
    for condition in _conjuncts(tree.this) if names else []:
        if isinstance(condition, exp.Exists):
            _exists_as_in(condition, names, run)
    for node in list(tree.find_all(exp.In, exp.Exists, exp.Subquery)):
        if node.parent is None or node.find_ancestor(exp.Query) is not None:
            continue  # inside a subquery (or one replaced already): runs with it
        if isinstance(node, exp.In) and isinstance(node.args.get("query"), exp.Expr):
            answer = _answer(node.args["query"], run, MAX_INLINED_VALUES + 1)
            if answer is None:
                continue
            values = answer.column(0)
            if len(values) > MAX_INLINED_VALUES:
                raise UnsupportedError(
                    f"a subquery of a DELETE or UPDATE answers more than {MAX_INLINED_VALUES:,} "
                    "values; change the rows in parts"
                )
            node.replace(_in_values(node.this, values))
        elif isinstance(node, exp.Exists):
            found = _answer(node.this, run, 1)
            if found is not None:
                node.replace(exp.true() if found.num_rows else exp.false())
        elif isinstance(node, exp.Subquery) and not isinstance(node.parent, exp.In):
            if isinstance(node.parent, exp.Any | exp.All):
                raise UnsupportedError("ANY and ALL over a subquery in a DELETE or UPDATE")
            found = _answer(node, run, 2)
            if found is None:
                continue
            if found.num_rows > 1:
                raise QueryError("More than one row returned by a subquery used as an expression")
            column = found.column(0)
            value = column[0].as_py() if found.num_rows else None
            node.replace(_literal(value, column.type))
    return str(tree.this.sql("duckdb"))


def _in_values(tested: exp.Expr, values: pa.ChunkedArray) -> exp.Expr:
    """``tested IN (values...)``; FALSE where there are none."""
    if not len(values):
        return exp.false()
    literals = [_literal(v, values.type) for v in values.to_pylist()]
    return exp.In(this=tested.copy(), expressions=literals)


def _conjuncts(condition: exp.Expr) -> list[exp.Expr]:
    """The conditions ``condition`` ANDs together (brackets looked through)."""
    if isinstance(condition, exp.Paren):
        return _conjuncts(condition.this)
    if isinstance(condition, exp.And):
        return _conjuncts(condition.this) + _conjuncts(condition.expression)
    return [condition]


def _exists_as_in(exists: exp.Exists, outer: set[str], run: Callable[[str], pa.Table]) -> None:
    """Replace ``exists`` (a condition of a DELETE's or UPDATE's WHERE, ANDed with the
    others) by ``o IN (values)`` where its subquery ties the changed row to its rows by
    one ``o = i`` alone (``o`` a column of the changed table, by one of the ``outer``
    names) and ``SELECT i FROM ... WHERE <the rest>`` runs alone with at most
    :data:`MAX_INLINED_VALUES` values. (Both keep a row where some row of the subquery has
    ``i = o``; a NULL on either side keeps none.) Left as it is otherwise."""
    select = exists.this
    if not isinstance(select, exp.Select) or any(
        select.args.get(part) for part in ("group", "having", "limit", "offset", "qualify", "with_")
    ):
        return
    if any(e.find(exp.AggFunc, exp.Window) for e in select.expressions):
        return  # an aggregate answers a row whatever matches: EXISTS holds for every row
    where = select.args.get("where")
    if not isinstance(where, exp.Where):
        return
    conditions = _conjuncts(where.this)

    def reads_outer(node: exp.Expr) -> bool:
        return any(c.table.lower() in outer for c in node.find_all(exp.Column) if c.table)

    ties = [
        c
        for c in conditions
        if isinstance(c, exp.EQ) and reads_outer(c.this) != reads_outer(c.expression)
    ]
    if len(ties) != 1:
        return
    [tie] = ties
    tested, inner = (
        (tie.this, tie.expression) if reads_outer(tie.this) else (tie.expression, tie.this)
    )
    rest = [c for c in conditions if c is not tie]
    if not isinstance(tested, exp.Column) or any(reads_outer(c) for c in rest):
        return
    if inner.find(exp.Query) is not None or reads_outer(inner):
        return
    query = select.copy()
    query.set("expressions", [inner.copy()])
    query.set("distinct", exp.Distinct())
    query.set("where", exp.Where(this=exp.and_(*rest)) if rest else None)
    try:
        answer = _answer(query, run, MAX_INLINED_VALUES + 1)
    except QueryError:
        return  # it does not run alone as written: the subquery stays as it is
    if answer is None or answer.num_rows > MAX_INLINED_VALUES:
        return
    exists.replace(_in_values(tested, answer.column(0)))


def _answer(query: exp.Expr, run: Callable[[str], pa.Table], rows: int) -> pa.Table | None:
    """The first ``rows`` rows of a subquery run alone; None where it reads a column of
    the changed row (correlated: SQL binds a name to the innermost table that has it, so
    one that runs alone reads none)."""
    inner = query.this if isinstance(query, exp.Subquery) else query
    try:
        return run(f"SELECT * FROM ({inner.sql('duckdb')}) AS sub LIMIT {rows}")
    except UnknownColumnError:
        return None
    except QueryError as error:  # a column named by the changed table's name or alias
        if _OUTER_TABLE.search(str(error)):
            return None  # (a table truly unknown is said when the statement is bound)
        raise


_OUTER_TABLE = re.compile(r'Referenced table "[^"]*" not found')


SHIPPED_PREFIX = "__sf_in_"
"""What a table a correlated subquery reads is named as on the shards (its copy)."""


def shipped_reads(sql: str) -> tuple[str, tuple[str, ...]]:
    """``sql`` (a WHERE or SET value whose subqueries left are correlated) with each table
    they read named as the copy the session sends to every shard (``SHIPPED_PREFIX`` and
    its name, under the name or alias it had), and the names of those tables. Each shard
    then evaluates the subqueries per row as DuckDB does, over the whole tables."""
    tree = exp.Paren(this=sqlglot.parse_one(sql, read="duckdb"))
    ctes = {cte.alias_or_name.lower() for cte in tree.find_all(exp.CTE)}
    names: set[str] = set()
    for table in list(tree.find_all(exp.Table)):
        if not table.name or not isinstance(table.this, exp.Identifier):
            raise UnsupportedError(
                "a subquery of a DELETE or UPDATE reads tables of the cluster only, not "
                f"{table.sql('duckdb')}"
            )
        if table.name.lower() in ctes and not table.db:
            continue
        if table.db or table.catalog:
            raise UnsupportedError(
                f"a subquery of a DELETE or UPDATE reads tables by their names alone, not "
                f"{table.sql('duckdb')}"
            )
        names.add(table.name)
        copy = exp.Table(
            this=exp.to_identifier(SHIPPED_PREFIX + table.name.lower(), quoted=True),
            alias=exp.TableAlias(this=exp.to_identifier(table.alias_or_name)),
            joins=table.args.get("joins"),
        )
        table.replace(copy)
    return str(tree.this.sql("duckdb")), tuple(sorted(names, key=str.lower))


def _literal(value: object, arrow_type: pa.DataType) -> exp.Expr:
    """A subquery's value as SQL: a plain literal for numbers, text and booleans (a key
    compared with literals routes the statement to its shards), else cast to its type."""
    if value is None:
        return exp.null()
    plain = (
        pa.types.is_integer(arrow_type)
        or pa.types.is_floating(arrow_type)
        or pa.types.is_string(arrow_type)
        or pa.types.is_large_string(arrow_type)
        or pa.types.is_boolean(arrow_type)
    )
    return exp.convert(value) if plain else exp.cast(exp.convert(value), sql_type(arrow_type))
