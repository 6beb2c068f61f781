"""What the runner needs to know about one SQL text before it compares answers: the kind of
statement, the relations it reads, functions whose answers cannot be compared, its outer
LIMIT, and the equi-join columns that choose the co-located layout. Pure (SQLGlot only).

>>> facts = analyze("SELECT a FROM t JOIN u ON t.k = u.k ORDER BY a LIMIT 3")
>>> sorted(facts.tables), facts.limited, facts.ordered
(['t', 'u'], True, True)
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import sqlglot
from sqlglot import exp
from sqlglot.errors import ParseError, TokenError

DIALECT = "duckdb"

QUERY_KEYWORDS = frozenset({"SELECT", "WITH", "FROM", "VALUES", "TABLE", "PIVOT", "UNPIVOT", "("})
"""First keywords of statements that are queries; anything else (DESCRIBE, EXPLAIN,
SUMMARIZE, PRAGMA, SHOW, CALL, INSERT ... RETURNING, ...) is not compared."""

READ_ONLY_KEYWORDS = frozenset(
    {"SELECT", "FROM", "VALUES", "TABLE", "(", "EXPLAIN", "DESCRIBE", "SHOW", "SUMMARIZE"}
)
"""Statements that change neither tables nor settings (the runner re-reads DuckDB's
tables only after any other statement)."""

# Functions whose value differs between two evaluations or two engines.
VOLATILE_FUNCTIONS = frozenset(
    {
        "random",
        "rand",
        "setseed",
        "uuid",
        "uuidv4",
        "uuidv7",
        "gen_random_uuid",
        "nextval",
        "currval",
        "now",
        "get_current_time",
        "get_current_timestamp",
        "current_timestamp",
        "current_time",
        "current_localtimestamp",
        "current_localtime",
        "localtime",
        "localtimestamp",
        "transaction_timestamp",
        "txid_current",
        # aggregates over a random sample of their input: another row order, another sample
        "reservoir_quantile",
    }
)
_VOLATILE_NODES = (exp.Rand, exp.Uuid, exp.CurrentTimestamp, exp.CurrentTime)

EXTERNAL_DATA = re.compile(
    r"\b(read_csv\w*|read_parquet|parquet_scan|read_json\w*|read_ndjson\w*|csv_scan|"
    r"read_text|read_blob|glob|parquet_metadata|parquet_schema|sniff_csv)\s*\(|"
    r"'[^']*\.(csv|parquet|json|tsv|gz|zst|db|duckdb)'|\bdata/|__TEST_DIR__|\{DATA_DIR\}",
    re.IGNORECASE,
)

_LEADING = re.compile(r"^(\s|--[^\n]*\n|/\*.*?\*/)*", re.DOTALL)


def first_keyword(sql: str) -> str:
    """The statement's first keyword, upper-case (``(`` for a parenthesised query)."""
    text = _LEADING.sub("", sql, count=1)
    if text.startswith("("):
        return "("
    match = re.match(r"[A-Za-z_]+", text)
    return match.group(0).upper() if match else ""


@dataclass(frozen=True)
class JoinEdge:
    """``left.left_column = right.right_column`` between two base tables (maybe the same)."""

    left: str
    left_column: str
    right: str
    right_column: str


@dataclass
class QueryFacts:
    sql: str
    keyword: str
    tree: exp.Expr | None = None
    parse_error: str | None = None
    tables: set[str] = field(default_factory=set)
    """Base relations read, lower-cased (CTE names excluded)."""
    qualified_tables: set[str] = field(default_factory=set)
    table_functions: set[str] = field(default_factory=set)
    functions: set[str] = field(default_factory=set)
    """Every function name called, lower-cased."""
    volatile: set[str] = field(default_factory=set)
    sampled: bool = False
    external_data: bool = False
    ordered: bool = False
    limited: bool = False
    """The outermost query has a LIMIT or OFFSET."""

    @property
    def is_query(self) -> bool:
        return self.keyword in QUERY_KEYWORDS


def _function_name(node: exp.Func) -> str:
    if isinstance(node, exp.Anonymous):
        return str(node.name).lower()
    return node.sql_name().lower()


def outer_query(tree: exp.Expr) -> exp.Expr:
    """Strip parentheses around the whole query that carry no ORDER BY or LIMIT."""
    node = tree
    while isinstance(node, exp.Subquery | exp.Paren) and not (
        node.args.get("order") or node.args.get("limit") or node.args.get("offset")
    ):
        node = node.this
    return node


def analyze(sql: str) -> QueryFacts:
    facts = QueryFacts(sql=sql, keyword=first_keyword(sql))
    facts.external_data = bool(EXTERNAL_DATA.search(sql))
    try:
        statements = [s for s in sqlglot.parse(sql, dialect=DIALECT) if s is not None]
    except (ParseError, TokenError) as error:
        facts.parse_error = str(error).splitlines()[0] if str(error) else type(error).__name__
        _regex_facts(facts)
        return facts
    if len(statements) != 1:
        facts.parse_error = f"{len(statements)} statements"
        _regex_facts(facts)
        return facts
    tree = statements[0]
    facts.tree = tree
    ctes = {str(cte.alias_or_name).lower() for cte in tree.find_all(exp.CTE)}
    for table in tree.find_all(exp.Table):
        if not isinstance(table.this, exp.Identifier):
            if isinstance(table.this, exp.Func):
                facts.table_functions.add(_function_name(table.this))
            continue
        name = str(table.name).lower()
        if table.args.get("db") or table.args.get("catalog"):
            facts.qualified_tables.add(table.sql(DIALECT))
        elif name not in ctes:
            facts.tables.add(name)
    for func in tree.find_all(exp.Func):
        name = _function_name(func)
        facts.functions.add(name)
        if name in VOLATILE_FUNCTIONS or isinstance(func, _VOLATILE_NODES):
            facts.volatile.add(name)
    for column in tree.find_all(exp.Column):  # CURRENT_TIMESTAMP and friends without ()
        if str(column.name).lower() in VOLATILE_FUNCTIONS and not column.table:
            facts.volatile.add(str(column.name).lower())
    facts.sampled = any(True for _ in tree.find_all(exp.TableSample))
    outer = outer_query(tree)
    if isinstance(outer, exp.Query):
        order = outer.args.get("order")
        facts.ordered = bool(order and order.expressions)
        facts.limited = bool(outer.args.get("limit") or outer.args.get("offset"))
    return facts


_FROM_NAME = re.compile(r"\b(?:FROM|JOIN)\s+([A-Za-z_][\w$]*)(\s*\()?", re.IGNORECASE)


def _regex_facts(facts: QueryFacts) -> None:
    """Best effort for SQL that SQLGlot cannot parse (shardflow will not parse it either)."""
    for match in _FROM_NAME.finditer(facts.sql):
        if match.group(2):
            facts.table_functions.add(match.group(1).lower())
        else:
            facts.tables.add(match.group(1).lower())
    lowered = facts.sql.lower()
    for name in VOLATILE_FUNCTIONS:
        if re.search(rf"\b{name}\s*\(", lowered):
            facts.volatile.add(name)
    facts.sampled = bool(re.search(r"\btablesample\b|\busing\s+sample\b", lowered))
    facts.ordered = bool(re.search(r"\border\s+by\b", lowered))
    facts.limited = bool(re.search(r"\b(limit|offset)\b", lowered))


def without_limit(facts: QueryFacts) -> str | None:
    """The query without its outermost LIMIT/OFFSET (its full answer), or None."""
    if facts.tree is None:
        return None
    tree = facts.tree.copy()
    outer = outer_query(tree)
    if not isinstance(outer, exp.Query):
        return None
    outer.set("limit", None)
    outer.set("offset", None)
    return tree.sql(DIALECT)


# --------------------------------------------------------------------------------------
# equi-joins, for the co-located layout


def join_edges(facts: QueryFacts, schemas: Mapping[str, Iterable[str]]) -> list[JoinEdge]:
    """``a.x = b.y`` comparisons (in ON, USING and WHERE) between columns of base tables.

    ``schemas`` maps lower-cased table names to their column names; a column without a
    qualifier is given to the one table of its SELECT that has it.
    """
    if facts.tree is None:
        return []
    columns = {t: {c.lower() for c in cols} for t, cols in schemas.items()}
    edges: list[JoinEdge] = []
    for select in facts.tree.find_all(exp.Select):
        sources: dict[str, str] = {}
        from_ = select.args.get("from_") or select.args.get("from")
        joins = list(select.args.get("joins") or [])
        relations = ([from_.this] if from_ is not None else []) + [j.this for j in joins]
        for rel in relations:
            if isinstance(rel, exp.Table) and isinstance(rel.this, exp.Identifier):
                name = str(rel.name).lower()
                if name in columns:
                    sources[str(rel.alias_or_name).lower()] = name

        def resolve(col: exp.Column, sources: dict[str, str] = sources) -> tuple[str, str] | None:
            cname = str(col.name).lower()
            if col.table:
                table = sources.get(str(col.table).lower())
                return (table, cname) if table and cname in columns[table] else None
            owners = {t for t in sources.values() if cname in columns[t]}
            return (owners.pop(), cname) if len(owners) == 1 else None

        conditions: list[exp.Expr] = []
        if select.args.get("where") is not None:
            conditions.append(select.args["where"])
        for join in joins:
            if join.args.get("on") is not None:
                conditions.append(join.args["on"])
            using = join.args.get("using") or []
            right = join.this
            if using and isinstance(right, exp.Table):
                right_name = sources.get(str(right.alias_or_name).lower())
                for ident in using:
                    cname = str(ident.name).lower()
                    left = [
                        t for a, t in sources.items() if t != right_name and cname in columns[t]
                    ]
                    if right_name and left:
                        edges.append(JoinEdge(left[0], cname, right_name, cname))
        for condition in conditions:
            for eq in condition.find_all(exp.EQ):
                if eq.find_ancestor(exp.Select) is not select:
                    continue
                if isinstance(eq.this, exp.Column) and isinstance(eq.expression, exp.Column):
                    a, b = resolve(eq.this), resolve(eq.expression)
                    if a and b and a != b:
                        edges.append(JoinEdge(a[0], a[1], b[0], b[1]))
    return edges


# --------------------------------------------------------------------------------------
# DuckDB's default_null_order, made explicit


def _nulls_first(setting: str, desc: bool) -> bool | None:
    return {
        "nulls_first": True,
        "nulls_last": False,
        "nulls_first_on_asc_last_on_desc": not desc,
        "nulls_last_on_asc_first_on_desc": desc,
    }.get(setting.lower())


_EXPLICIT_NULLS = re.compile(r"\bNULLS\s+(FIRST|LAST)\b", re.IGNORECASE)


def with_null_order(facts: QueryFacts, setting: str) -> str | None:
    """The query with every ORDER BY item (outer, subquery, window, aggregate) given the
    NULLS FIRST/LAST that ``SET default_null_order = setting`` implies, so that it means
    the same under DuckDB's default; None where that cannot be done (no parse tree, an
    unknown setting, or NULLS FIRST/LAST already written somewhere: SQLGlot does not keep
    whether NULLS LAST was written or implied).

    >>> with_null_order(analyze("SELECT a FROM t ORDER BY a DESC"), "nulls_first")
    'SELECT a FROM t ORDER BY a DESC NULLS FIRST'
    """
    if facts.tree is None or _EXPLICIT_NULLS.search(facts.sql):
        return None
    tree = facts.tree.copy()
    for ordered in tree.find_all(exp.Ordered):
        first = _nulls_first(setting, bool(ordered.args.get("desc")))
        if first is None:
            return None
        ordered.set("nulls_first", first)
    return tree.sql(DIALECT)


CATALOG_FUNCTIONS = re.compile(
    r"^(pragma_\w+|duckdb_\w+|histogram_values|query|query_table|summary|"
    r"which_secret|icu_calendar_names|test_vector_types)$"
)
"""Table functions that read DuckDB's catalog or a table by name: shardflow's workers hold
other catalogs, so their answers are not comparable."""
