"""Hypothesis strategies producing random, valid, deterministic DuckDB SELECT statements
over the TPC-H schema, aimed at what a distributed planner must get right.

Layout assumed by the system under test: ``lineitem`` and ``orders`` are hash-distributed
on ``l_orderkey`` / ``o_orderkey`` and co-located; ``customer``, ``part``, ``partsupp``,
``supplier``, ``nation`` and ``region`` are replicated to every node.

Shapes (see :func:`sql_strategy_names`; pick a subset with ``select_queries(shapes=...)``):

``scan``
    single-table scan of lineitem or orders: random WHERE (comparisons with plausible
    literals, BETWEEN, IN / NOT IN lists, LIKE / NOT LIKE prefixes, IS [NOT] NULL on
    nullable expressions, column-vs-column comparisons, AND/OR/NOT nesting) and random
    projections (columns, decimal arithmetic, CASE with/without ELSE, NULLIF/COALESCE,
    EXTRACT, date differences, string functions, DOUBLE divisions, sometimes ``*``).
    Unbounded scans of lineitem/orders usually get an extra ``key BETWEEN a AND b``
    conjunct (a window of at most ~3000 order keys) to keep results small at SF 0.1.
``group_by``
    GROUP BY 1-3 keys (distribution key, other keys, low-cardinality columns, expressions;
    by repeating the expression or by ordinal) on lineitem or orders with SUM,
    COUNT(*), COUNT(col), AVG, MIN, MAX, COUNT(DISTINCT col), conditional SUM(CASE ...),
    optional HAVING on an aggregate.
``global_agg``
    aggregates without GROUP BY (one output row), optionally filtered.
``top_n``
    ORDER BY every output column + LIMIT, sometimes OFFSET, sometimes LIMIT 0, over a scan,
    a grouped aggregate or a join.
``join``
    inner equi-joins, written as JOIN ... ON or as a comma join with the condition in
    WHERE: lineitem-orders (co-located), orders-customer (replicated), lineitem-part,
    lineitem-supplier, lineitem-partsupp (two-column key), lineitem-orders-customer-nation;
    either projected or grouped.
``distinct``
    SELECT DISTINCT on distribution-key and non-key columns, single table or join.
``in_subquery``
    ``col [NOT] IN (SELECT key FROM <replicated table> WHERE ...)``, uncorrelated (part,
    supplier, partsupp -- whose keys repeat --, customer, nation), projected or aggregated.
``exists_subquery``
    ``[NOT] EXISTS (SELECT 1 FROM lineitem WHERE l_orderkey = o_orderkey AND ...)``,
    correlated on the distribution key, under orders (or orders JOIN customer).
``scalar_subquery``
    ``col > (SELECT avg/min/max/sum/count(...) FROM ...)`` in WHERE, or a scalar subquery
    in the SELECT list, over distributed or replicated tables.
``derived_table``
    a subquery in FROM: aggregate of an aggregate (TPC-H Q13 style, re-grouping on a
    computed count), a filtered/grouped projection of a projection (optionally joined back
    to its co-located partner on the distribution key), or orders joined to a per-order
    lineitem aggregate (Q18 style).
``replicated``
    queries over replicated tables only (customer, part, partsupp, supplier, nation,
    region, and customer-nation-region / supplier-nation joins): their result must not be
    multiplied by the number of nodes.
``cross_join``
    ``A CROSS JOIN B`` (replicated x replicated, distributed x replicated, and two
    distributed tables that are not joined on their key), distributed sides cut to a small
    window of keys; projected, grouped (sometimes DISTINCT after GROUP BY) or aggregated.
``correlated_subquery``
    subqueries correlated on other columns than the distribution key (decorrelated into
    grouped joins; TPC-H Q17 style), a replicated outer query over a distributed inner one,
    nested subqueries (``IN (... IN (...))``, an IN inside a correlated EXISTS), and
    correlated scalar subqueries in the SELECT list.
``names``
    outputs that share a name (``SELECT 51 AS l_orderkey, l_orderkey``), constants, and
    DISTINCT after GROUP BY.

Across the shapes, now and then: constants in SELECT (unaliased too, so DuckDB names them
by their text), in DISTINCT, as GROUP BY keys (non-integer as written, any by position)
and as ORDER BY keys (by position or alias); aggregates of constants (``sum(DISTINCT 11)``);
predicates with a NULL literal (``= NULL``, ``IN (.., NULL)``, ``NOT IN (.., NULL)``);
a derived table whose outputs share a name, read by DuckDB's renamed ``v0_1``; and table,
column and alias names in other cases, some quoted (:func:`_recase`).

Determinism rules honoured by every query: a LIMIT/OFFSET always comes with an ORDER BY
that lists every output column (so ties only occur between identical rows; every ORDER BY
does, so a strict ordered comparison is valid) -- an output whose name is shared, or a
constant, by position; an AVG (which may differ from DuckDB's in the last bit) is ordered
after every GROUP BY key and never under DISTINCT; no random or time-dependent functions;
SUM/AVG only aggregate exact (integer/decimal) expressions; no division by a column that
can be zero; every join but a CROSS JOIN has an equi-join condition; expressions (not bare
columns or constants) in the SELECT list always carry an alias (x0, x1, ...).
NULLs arise only from expressions (CASE without ELSE, NULLIF), which also exercises
three-valued logic in WHERE/NOT and COUNT(expr) vs COUNT(*). Literal ranges cover scale
factors 0.01-0.1.

Hypothesis' simplest (all-zero) choices take the common path (restricted scans, no NOT,
no HAVING, ...), so minimal and shrunk examples stay small and readable.
"""

from __future__ import annotations

import datetime as _dt
import random
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from hypothesis import strategies as st

__all__ = [
    "SHAPES",
    "labelled_select_queries",
    "select_queries",
    "sql_strategy_names",
]

Draw = Callable[[st.SearchStrategy[Any]], Any]

DATE_LO = _dt.date(1992, 1, 1)
DATE_HI = _dt.date(1998, 12, 31)

# --------------------------------------------------------------------------------------
# schema


@dataclass(frozen=True)
class Col:
    """A column (or derived-table output) with what is needed to make plausible literals.

    kind: "key" (integer id, lo..hi at SF 0.1), "int", "dec" (2 decimals), "date",
    "cat" (small set of string values), "text" (free text; ``values`` are LIKE prefixes).
    """

    name: str
    kind: str
    lo: float = 0
    hi: float = 0
    values: tuple[str, ...] = ()
    table: str = ""
    step: int = 1  # "dec" literals are multiples of step/100 (l_quantity: whole numbers)

    @property
    def numeric(self) -> bool:
        return self.kind in ("key", "int", "dec")


SEGMENTS = ("AUTOMOBILE", "BUILDING", "FURNITURE", "HOUSEHOLD", "MACHINERY")
PRIORITIES = ("1-URGENT", "2-HIGH", "3-MEDIUM", "4-NOT SPECIFIED", "5-LOW")
SHIPMODES = ("AIR", "FOB", "MAIL", "RAIL", "REG AIR", "SHIP", "TRUCK")
INSTRUCTS = ("COLLECT COD", "DELIVER IN PERSON", "NONE", "TAKE BACK RETURN")
NATIONS = (
    "ALGERIA",
    "ARGENTINA",
    "BRAZIL",
    "CANADA",
    "EGYPT",
    "ETHIOPIA",
    "FRANCE",
    "GERMANY",
    "INDIA",
    "INDONESIA",
    "IRAN",
    "IRAQ",
    "JAPAN",
    "JORDAN",
    "KENYA",
    "MOROCCO",
    "MOZAMBIQUE",
    "PERU",
    "CHINA",
    "ROMANIA",
    "SAUDI ARABIA",
    "VIETNAM",
    "RUSSIA",
    "UNITED KINGDOM",
    "UNITED STATES",
)
REGIONS = ("AFRICA", "AMERICA", "ASIA", "EUROPE", "MIDDLE EAST")
BRANDS = tuple(f"Brand#{m}{n}" for m in range(1, 6) for n in range(1, 6))
MFGRS = tuple(f"Manufacturer#{m}" for m in range(1, 6))
CONTAINERS = tuple(
    f"{a} {b}"
    for a in ("SM", "LG", "MED", "JUMBO", "WRAP")
    for b in ("CASE", "BOX", "BAG", "JAR", "PKG", "PACK", "CAN", "DRUM")
)
TYPES = tuple(
    f"{a} {b} {c}"
    for a in ("STANDARD", "SMALL", "MEDIUM", "LARGE", "ECONOMY", "PROMO")
    for b in ("ANODIZED", "BURNISHED", "PLATED", "POLISHED", "BRUSHED")
    for c in ("TIN", "NICKEL", "BRASS", "STEEL", "COPPER")
)
COMMENT_WORDS = (
    "furiously",
    "carefully",
    "blithely",
    "quickly",
    "slyly",
    "regular",
    "final",
    "ironic",
    "express",
    "special",
    "pending",
    "bold",
    "even",
    "silent",
    "fluffily",
    "the",
    "s",
)
COLORS = (
    "almond",
    "antique",
    "azure",
    "beige",
    "black",
    "blue",
    "blush",
    "brown",
    "chartreuse",
    "chocolate",
    "coral",
    "cornflower",
    "cream",
    "cyan",
    "dark",
    "dim",
    "forest",
    "frosted",
    "ghost",
    "green",
    "honeydew",
    "hot",
    "ivory",
    "khaki",
    "lace",
    "lavender",
    "lemon",
    "light",
    "lime",
    "linen",
    "maroon",
    "medium",
    "midnight",
    "mint",
    "navy",
    "olive",
    "orange",
    "orchid",
    "pale",
    "peach",
    "pink",
    "plum",
    "powder",
    "puff",
    "purple",
    "red",
    "rose",
    "royal",
    "saddle",
    "salmon",
    "sandy",
    "sienna",
    "sky",
    "slate",
    "smoke",
    "snow",
    "spring",
    "steel",
    "tan",
    "thistle",
    "tomato",
    "turquoise",
    "violet",
    "wheat",
    "white",
    "yellow",
)


def _t(table: str, *cols: Col) -> tuple[Col, ...]:
    return tuple(replace(c, table=table) for c in cols)


ORDERKEY_HI = 600_000
TABLES: dict[str, tuple[Col, ...]] = {
    "lineitem": _t(
        "lineitem",
        Col("l_orderkey", "key", 1, ORDERKEY_HI),
        Col("l_partkey", "key", 1, 20_000),
        Col("l_suppkey", "key", 1, 1_000),
        Col("l_linenumber", "int", 1, 7),
        Col("l_quantity", "dec", 1, 50, step=100),
        Col("l_extendedprice", "dec", 900, 105_000),
        Col("l_discount", "dec", 0, 0.10),
        Col("l_tax", "dec", 0, 0.08),
        Col("l_returnflag", "cat", values=("A", "N", "R")),
        Col("l_linestatus", "cat", values=("F", "O")),
        Col("l_shipdate", "date"),
        Col("l_commitdate", "date"),
        Col("l_receiptdate", "date"),
        Col("l_shipinstruct", "cat", values=INSTRUCTS),
        Col("l_shipmode", "cat", values=SHIPMODES),
        Col("l_comment", "text", values=COMMENT_WORDS),
    ),
    "orders": _t(
        "orders",
        Col("o_orderkey", "key", 1, ORDERKEY_HI),
        Col("o_custkey", "key", 1, 15_000),
        Col("o_orderstatus", "cat", values=("F", "O", "P")),
        Col("o_totalprice", "dec", 800, 560_000),
        Col("o_orderdate", "date"),
        Col("o_orderpriority", "cat", values=PRIORITIES),
        Col("o_clerk", "text", values=tuple(f"Clerk#00000{i:02d}" for i in range(100))),
        Col("o_shippriority", "int", 0, 0),
        Col("o_comment", "text", values=COMMENT_WORDS),
    ),
    "customer": _t(
        "customer",
        Col("c_custkey", "key", 1, 15_000),
        Col("c_name", "text", values=tuple(f"Customer#0000{i:02d}" for i in range(100))),
        Col("c_address", "text", values=tuple("abcdefghijklmnopqrstuvwxyzABCDEFGHIJ0123")),
        Col("c_nationkey", "key", 0, 24),
        Col("c_phone", "text", values=tuple(f"{i}-" for i in range(10, 35))),
        Col("c_acctbal", "dec", -999.99, 9999.99),
        Col("c_mktsegment", "cat", values=SEGMENTS),
        Col("c_comment", "text", values=COMMENT_WORDS),
    ),
    "part": _t(
        "part",
        Col("p_partkey", "key", 1, 20_000),
        Col("p_name", "text", values=COLORS),
        Col("p_mfgr", "cat", values=MFGRS),
        Col("p_brand", "cat", values=BRANDS),
        Col("p_type", "cat", values=TYPES),
        Col("p_size", "int", 1, 50),
        Col("p_container", "cat", values=CONTAINERS),
        Col("p_retailprice", "dec", 900, 2_100),
        Col("p_comment", "text", values=COMMENT_WORDS),
    ),
    "partsupp": _t(
        "partsupp",
        Col("ps_partkey", "key", 1, 20_000),
        Col("ps_suppkey", "key", 1, 1_000),
        Col("ps_availqty", "int", 1, 9_999),
        Col("ps_supplycost", "dec", 1, 1_000),
        Col("ps_comment", "text", values=COMMENT_WORDS),
    ),
    "supplier": _t(
        "supplier",
        Col("s_suppkey", "key", 1, 1_000),
        Col("s_name", "text", values=tuple(f"Supplier#0000000{i:02d}" for i in range(100))),
        Col("s_address", "text", values=tuple("abcdefghijklmnopqrstuvwxyz0123456789")),
        Col("s_nationkey", "key", 0, 24),
        Col("s_phone", "text", values=tuple(f"{i}-" for i in range(10, 35))),
        Col("s_acctbal", "dec", -999.99, 9999.99),
        Col("s_comment", "text", values=COMMENT_WORDS),
    ),
    "nation": _t(
        "nation",
        Col("n_nationkey", "key", 0, 24),
        Col("n_name", "cat", values=NATIONS),
        Col("n_regionkey", "key", 0, 4),
        Col("n_comment", "text", values=COMMENT_WORDS),
    ),
    "region": _t(
        "region",
        Col("r_regionkey", "key", 0, 4),
        Col("r_name", "cat", values=REGIONS),
        Col("r_comment", "text", values=COMMENT_WORDS),
    ),
}
DISTRIBUTED = ("lineitem", "orders")
REPLICATED = ("customer", "part", "partsupp", "supplier", "nation", "region")
# Low-cardinality columns that make good GROUP BY keys.
GROUPABLE = frozenset(
    {
        "l_returnflag",
        "l_linestatus",
        "l_shipmode",
        "l_shipinstruct",
        "l_linenumber",
        "o_orderstatus",
        "o_orderpriority",
        "o_shippriority",
        "c_mktsegment",
        "c_nationkey",
        "n_name",
        "n_regionkey",
        "r_name",
        "p_mfgr",
        "p_brand",
        "p_size",
        "p_container",
        "s_nationkey",
    }
)


def _col(name: str) -> Col:
    for cols in TABLES.values():
        for c in cols:
            if c.name == name:
                return c
    raise KeyError(name)


# --------------------------------------------------------------------------------------
# expressions


@dataclass(frozen=True)
class Expr:
    sql: str
    kind: str  # "int", "dec", "float", "date", "str", "bool"
    nullable: bool = False
    bare: str | None = None  # column name when the expression is a bare column
    constant: bool = False  # a literal: never an ORDER BY / GROUP BY key as written
    aggregate: bool = False

    @property
    def exact_numeric(self) -> bool:
        return self.kind in ("int", "dec")


def _one_in(draw: Draw, n: int) -> bool:
    """True with probability 1/n; False for Hypothesis' simplest (all-zero) choice, so the
    minimal and shrunk examples take the common path."""
    return bool(draw(st.integers(0, n - 1)) == n - 1)


def _q(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def _fmt_cents(cents: int) -> str:
    sign = "-" if cents < 0 else ""
    return f"{sign}{abs(cents) // 100}.{abs(cents) % 100:02d}"


CONSTANTS: tuple[tuple[str, str], ...] = (
    # (literal, kind); integers are positions in GROUP BY / ORDER BY, so only ever
    # referred to there by position or alias
    ("83", "int"),
    ("-53", "int"),
    ("0", "int"),
    ("2.5", "dec"),
    ("-0.75", "dec"),
    ("'k'", "str"),
    ("NULL", "int"),
    ("TRUE", "bool"),
)


def _constant(draw: Draw, *, integers: bool = True) -> Expr:
    """A literal; with ``integers=False`` never an integer (safe as a GROUP BY key)."""
    choices = [c for c in CONSTANTS if integers or c[1] != "int" or c[0] == "NULL"]
    literal, kind = draw(st.sampled_from(choices))
    return Expr(literal, kind, nullable=literal == "NULL", constant=True)


def _expr_kind(col: Col) -> str:
    return {"key": "int", "int": "int", "dec": "dec", "date": "date"}.get(col.kind, "str")


def _col_expr(col: Col) -> Expr:
    return Expr(col.name, _expr_kind(col), bare=col.name)


def _lit(draw: Draw, col: Col) -> str:
    """A plausible literal for comparisons with ``col``."""
    if col.kind == "key":
        lo, hi = int(col.lo), int(col.hi)
        small = max(lo, hi // 10)  # the SF 0.01 range, favoured
        return str(draw(st.integers(lo, small) | st.integers(lo, hi)))
    if col.kind == "int":
        return str(draw(st.integers(int(col.lo), int(col.hi))))
    if col.kind == "dec":
        lo, hi = round(col.lo * 100) // col.step, round(col.hi * 100) // col.step
        return _fmt_cents(draw(st.integers(lo, hi)) * col.step)
    if col.kind == "date":
        return f"DATE '{draw(st.dates(DATE_LO, DATE_HI)).isoformat()}'"
    return _q(draw(st.sampled_from(col.values)))


def _two_lits(draw: Draw, col: Col) -> tuple[str, str]:
    """Two literals lo <= hi for BETWEEN."""
    if col.kind in ("key", "int"):
        a = int(_lit(draw, col))
        width = draw(st.integers(0, max(0, int((col.hi - col.lo) // 4))))
        return str(a), str(min(int(col.hi), a + width))
    if col.kind == "dec":
        a = round(float(_lit(draw, col)) * 100)
        width = draw(st.integers(0, max(1, round((col.hi - col.lo) * 100 / 3))))
        return _fmt_cents(a), _fmt_cents(a + width)
    if col.kind == "date":
        a = draw(st.dates(DATE_LO, DATE_HI))
        b = a + _dt.timedelta(days=draw(st.integers(0, 800)))
        return f"DATE '{a.isoformat()}'", f"DATE '{b.isoformat()}'"
    vals = sorted(draw(st.lists(st.sampled_from(col.values), min_size=2, max_size=2)))
    return _q(vals[0]), _q(vals[1])


def _like_pattern(draw: Draw, col: Col) -> str:
    if col.kind == "cat":
        v = draw(st.sampled_from(col.values))
        n = draw(st.integers(1, max(1, len(v))))
        if draw(st.integers(0, 3)) == 0:
            return _q("%" + v[-n:])  # suffix, like TPC-H Q2's p_type LIKE '%BRASS'
        return _q(v[:n] + "%")
    word = draw(st.sampled_from(col.values))
    if col.name.endswith("_comment") or col.name == "p_name":
        return _q(draw(st.sampled_from((f"{word}%", f"%{word}%", f"% {word} %"))))
    return _q(f"{word}%")


_CMP = ("=", "<>", "<", "<=", ">", ">=")
# Equality with a random literal rarely matches a wide-ranged column: favour ranges.
_RANGE_CMP = ("=", "<>", "<", "<=", ">", ">=", "<", "<=", ">", ">=")


def _cmp_op(draw: Draw, col: Col) -> str:
    if col.kind == "cat" or (col.kind == "int" and col.hi - col.lo < 60):
        return draw(st.sampled_from(_CMP))
    return draw(st.sampled_from(_RANGE_CMP))


def _comparable(a: Col, b: Col) -> bool:
    """Columns worth comparing with each other: same type and overlapping values."""
    if a.name == b.name or _expr_kind(a) != _expr_kind(b) or a.kind in ("cat", "text"):
        return False
    return a.kind == "date" or max(a.lo, b.lo) <= min(a.hi, b.hi)


def _nullable_num(draw: Draw, cols: Sequence[Col], nest: int = 1) -> tuple[Expr, Col] | None:
    """A nullable numeric expression built from an exact numeric column (and that column).
    ``nest`` bounds how deep CASE conditions may nest further nullable expressions."""
    nums = [c for c in cols if c.kind in ("int", "dec")]
    if not nums:
        return None
    c = draw(st.sampled_from(nums))
    if nest <= 0 or draw(st.booleans()):
        return Expr(f"NULLIF({c.name}, {_lit(draw, c)})", _expr_kind(c), nullable=True), c
    cond = _atom(draw, cols, nest - 1)
    return Expr(f"CASE WHEN {cond} THEN {c.name} END", _expr_kind(c), nullable=True), c


def _atom(draw: Draw, cols: Sequence[Col], nest: int = 1) -> str:
    col = draw(st.sampled_from(list(cols)))
    name = col.name
    options: list[str] = ["cmp"]
    if col.kind in ("key", "int", "dec", "date", "cat"):
        options += ["between", "in"]
    if col.kind in ("cat", "text"):
        options += ["like", "like"]
    if col.kind == "text":
        options = ["like", "like", "cmp_text"]
    options += ["null", "colcol", "nullable_cmp", "null_literal"]
    choice = draw(st.sampled_from(options))
    if choice == "cmp":
        return f"{name} {_cmp_op(draw, col)} {_lit(draw, col)}"
    if choice == "cmp_text":
        return f"{name} {draw(st.sampled_from(('<', '>=')))} {_lit(draw, col)}"
    if choice == "between":
        lo, hi = _two_lits(draw, col)
        neg = "NOT " if _one_in(draw, 5) else ""
        return f"{name} {neg}BETWEEN {lo} AND {hi}"
    if choice == "in":
        n = draw(st.integers(1, 5))
        lits = sorted({_lit(draw, col) for _ in range(n)})
        neg = "NOT " if _one_in(draw, 4) else ""
        return f"{name} {neg}IN ({', '.join(lits)})"
    if choice == "like":
        neg = "NOT " if _one_in(draw, 4) else ""
        return f"{name} {neg}LIKE {_like_pattern(draw, col)}"
    if choice == "null":
        ne = _nullable_num(draw, cols, nest) if draw(st.integers(0, 2)) else None
        if ne is None:  # TPC-H columns are never NULL: mostly the always-true form
            return f"{name} IS {draw(st.sampled_from(('NOT ', 'NOT ', '')))}NULL"
        return f"{ne[0].sql} IS {draw(st.sampled_from(('', 'NOT ')))}NULL"
    if choice == "null_literal":
        # three-valued logic with a NULL literal: = NULL is never true, NOT IN (..., NULL)
        # never true, IN (..., NULL) true where the others match
        if col.kind == "text":
            return f"{name} {draw(st.sampled_from(('=', '<>')))} NULL"
        lits = sorted({_lit(draw, col) for _ in range(draw(st.integers(1, 3)))})
        form = draw(st.integers(0, 4))
        if form == 0:
            return f"{name} {draw(st.sampled_from(('=', '<>', '<')))} NULL"
        if form == 1:
            return f"{name} NOT IN ({', '.join([*lits, 'NULL'])})"
        if form == 2:
            return f"NULL IS {draw(st.sampled_from(('', 'NOT ')))}NULL"
        return f"{name} IN ({', '.join(['NULL', *lits])})"
    if choice == "colcol":
        same = [c for c in cols if _comparable(col, c)]
        if same:
            other = draw(st.sampled_from(same))
            return f"{name} {draw(st.sampled_from(_CMP))} {other.name}"
        if col.kind == "text":
            return f"{name} LIKE {_like_pattern(draw, col)}"
        return f"{name} {_cmp_op(draw, col)} {_lit(draw, col)}"
    # nullable_cmp: three-valued logic (NULL comparisons are neither true nor false)
    ne = _nullable_num(draw, cols, nest)
    if ne is None:
        if col.kind == "text":
            return f"{name} LIKE {_like_pattern(draw, col)}"
        return f"{name} {_cmp_op(draw, col)} {_lit(draw, col)}"
    return f"{ne[0].sql} {_cmp_op(draw, ne[1])} {_lit(draw, ne[1])}"


def predicate(draw: Draw, cols: Sequence[Col], depth: int = 2) -> str:
    """A random boolean condition over ``cols`` (AND/OR/NOT of atoms)."""
    if depth <= 0 or draw(st.integers(0, 2)) == 0:
        return _atom(draw, cols)
    op = draw(st.sampled_from(("AND", "AND", "OR", "NOT")))
    if op == "NOT":
        return f"NOT ({predicate(draw, cols, depth - 1)})"
    return f"({predicate(draw, cols, depth - 1)} {op} {predicate(draw, cols, depth - 1)})"


def _num_expr(draw: Draw, cols: Sequence[Col]) -> Expr:
    """An exact (integer/decimal), non-null numeric expression."""
    nums = [c for c in cols if c.kind in ("int", "dec", "key")]
    decs = [c for c in cols if c.kind == "dec"]
    names = {c.name for c in cols}
    c = draw(st.sampled_from(decs if decs and not _one_in(draw, 3) else nums))
    k = _expr_kind(c)
    choice = draw(st.integers(0, 7))
    if choice == 0 and "l_discount" in names and c.name == "l_extendedprice":
        sql = "l_extendedprice * (1 - l_discount)"
        if "l_tax" in names and draw(st.booleans()):
            sql += " * (1 + l_tax)"
        return Expr(sql, "dec")
    if choice == 1:
        return Expr(f"{c.name} * {draw(st.integers(2, 10))}", k)
    if choice == 2:
        return Expr(f"{c.name} - {_lit(draw, c)}", k)
    if choice == 3 and len(decs) >= 2:
        a, b = draw(st.lists(st.sampled_from(decs), min_size=2, max_size=2))
        return Expr(f"{a.name} {draw(st.sampled_from(('+', '-')))} {b.name}", "dec")
    if choice == 4:
        return Expr(f"CASE WHEN {predicate(draw, cols, 1)} THEN {c.name} ELSE 0 END", k)
    if choice == 5:
        return Expr(f"abs({c.name} - {_lit(draw, c)})", k)
    dates = [d for d in cols if d.kind == "date"]
    if choice == 6 and dates:
        return Expr(f"extract(year FROM {draw(st.sampled_from(dates)).name})", "int")
    return _col_expr(c)


def scalar_expr(draw: Draw, cols: Sequence[Col], *, allow_float: bool = True) -> Expr:
    """A projection expression; bare columns are the most likely."""
    choice = draw(st.integers(0, 11))
    if choice <= 3:
        return _col_expr(draw(st.sampled_from(list(cols))))
    if choice <= 5:
        return _num_expr(draw, cols)
    dates = [c for c in cols if c.kind == "date"]
    strs = [c for c in cols if c.kind in ("cat", "text")]
    if choice == 6 and dates:
        if len(dates) >= 2 and draw(st.booleans()):
            a, b = draw(st.lists(st.sampled_from(dates), min_size=2, max_size=2, unique=True))
            return Expr(f"{a.name} - {b.name}", "int")
        d = draw(st.sampled_from(dates))
        part = draw(st.sampled_from(("year", "month", "quarter")))
        return Expr(f"extract({part} FROM {d.name})", "int")
    if choice == 7 and strs:
        s = draw(st.sampled_from(strs))
        fn = draw(st.sampled_from(("upper", "lower", "length", "substr", "concat")))
        if fn == "length":
            return Expr(f"length({s.name})", "int")
        if fn == "substr":
            return Expr(f"substr({s.name}, 1, {draw(st.integers(1, 4))})", "str")
        if fn == "concat":
            t = draw(st.sampled_from(strs))
            return Expr(f"{s.name} || '|' || {t.name}", "str")
        return Expr(f"{fn}({s.name})", "str")
    if choice == 8:
        cond = predicate(draw, cols, 1)
        if draw(st.booleans()):
            return Expr(f"CASE WHEN {cond} THEN 1 ELSE 0 END", "int")
        strs_cat = [c for c in cols if c.kind == "cat"]
        if strs_cat and draw(st.booleans()):
            s = draw(st.sampled_from(strs_cat))
            return Expr(f"CASE WHEN {cond} THEN {s.name} ELSE 'other' END", "str")
        n = _num_expr(draw, cols)
        return Expr(f"CASE WHEN {cond} THEN {n.sql} END", n.kind, nullable=True)
    if choice == 9:
        ne = _nullable_num(draw, cols)
        if ne is not None:
            e = ne[0]
            if draw(st.booleans()):
                return Expr(f"COALESCE({e.sql}, -1)", e.kind)
            return e
    if choice == 10 and allow_float:
        decs = [c for c in cols if c.kind == "dec"]
        names = {c.name for c in cols}
        if decs:
            d = draw(st.sampled_from(decs))
            if "l_quantity" in names and d.name != "l_quantity" and draw(st.booleans()):
                return Expr(f"{d.name} / l_quantity", "float")
            return Expr(f"CAST({d.name} AS DOUBLE) / {draw(st.integers(2, 1000))}", "float")
    return _col_expr(draw(st.sampled_from(list(cols))))


def _agg(draw: Draw, cols: Sequence[Col], *, allow_float: bool = True) -> Expr:
    """A random aggregate; SUM/AVG only over exact numeric expressions. Without
    ``allow_float`` no AVG: DISTINCT over a DOUBLE compares values that may differ in the
    last bit between engines (AVG of a DECIMAL divides in another order than DuckDB)."""
    choice = draw(
        st.sampled_from(
            ("sum", "sum", "count_star", "count", "avg", "min", "max", "count_distinct", "sum_case")
        )
    )
    if _one_in(draw, 8):  # an aggregate of a constant
        return draw(
            st.sampled_from(
                (
                    Expr("sum(7)", "int"),
                    Expr("count(3)", "int"),
                    Expr("sum(DISTINCT 11)", "int"),
                    Expr("count(DISTINCT 'a')", "int"),
                    Expr("min(-2)", "int"),
                    Expr("max(2.5)", "dec"),
                    Expr("avg(2)", "float"),
                    Expr("count(NULL)", "int"),
                )
            )
        )
    if choice == "count_star":
        return Expr("count(*)", "int")
    if choice == "count":
        if draw(st.booleans()):
            ne = _nullable_num(draw, cols)
            if ne is not None:
                return Expr(f"count({ne[0].sql})", "int")
        return Expr(f"count({draw(st.sampled_from(list(cols))).name})", "int")
    if choice == "count_distinct":
        c = draw(st.sampled_from([c for c in cols if c.kind != "text"] or list(cols)))
        return Expr(f"count(DISTINCT {c.name})", "int")
    if choice in ("min", "max"):
        if draw(st.booleans()):
            e = _num_expr(draw, cols)
        else:
            e = _col_expr(draw(st.sampled_from(list(cols))))
        return Expr(f"{choice}({e.sql})", e.kind)
    if choice == "sum_case":
        n = _num_expr(draw, cols)
        return Expr(f"sum(CASE WHEN {predicate(draw, cols, 1)} THEN {n.sql} ELSE 0 END)", n.kind)
    n = _num_expr(draw, cols)
    if choice == "avg" and allow_float:
        return Expr(f"avg({n.sql})", "float", aggregate=True)
    return Expr(f"sum({n.sql})", n.kind)


def _having(draw: Draw, cols: Sequence[Col]) -> str:
    choice = draw(st.integers(0, 3))
    if choice == 0:
        return f"count(*) {draw(st.sampled_from(('>', '>=', '<', '=')))} {draw(st.integers(1, 8))}"
    nums = [c for c in cols if c.kind in ("int", "dec")]
    if not nums:
        return f"count(*) > {draw(st.integers(1, 8))}"
    c = draw(st.sampled_from(nums))
    op = draw(st.sampled_from(_CMP[1:]))
    if choice == 1:
        # sums grow with group size: scale the literal up a bit
        return f"sum({c.name}) {op} {_lit(draw, c)} * {draw(st.integers(1, 20))}"
    if choice == 2:
        fn = draw(st.sampled_from(("min", "max")))
        return f"{fn}({c.name}) {op} {_lit(draw, c)}"
    # avg is a DOUBLE: add an odd third decimal so it never equals the literal exactly
    return f"avg({c.name}) {op} {_lit(draw, c)}{'' if c.kind == 'dec' else '.0'}37"


# --------------------------------------------------------------------------------------
# relations (FROM clauses)


@dataclass
class Relation:
    from_sql: str
    cols: list[Col]
    where: list[str] = field(default_factory=list)  # join conditions for comma joins
    big: list[str] = field(default_factory=list)  # key columns that can restrict scans
    star_ok: bool = True  # "SELECT *" lists exactly ``cols`` (not so for derived tables)


def _tables_cols(*tables: str) -> list[Col]:
    return [c for t in tables for c in TABLES[t]]


def _single(table: str) -> Relation:
    big = {"lineitem": ["l_orderkey"], "orders": ["o_orderkey"]}.get(table, [])
    return Relation(table, list(TABLES[table]), big=big)


JOINS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # name: (tables in join order, one equi-condition per join step)
    "lineitem_orders": (("lineitem", "orders"), ("l_orderkey = o_orderkey",)),
    "orders_customer": (("orders", "customer"), ("o_custkey = c_custkey",)),
    "lineitem_part": (("lineitem", "part"), ("l_partkey = p_partkey",)),
    "lineitem_supplier": (("lineitem", "supplier"), ("l_suppkey = s_suppkey",)),
    "lineitem_partsupp": (
        ("lineitem", "partsupp"),
        ("l_partkey = ps_partkey AND l_suppkey = ps_suppkey",),
    ),
    "lineitem_orders_customer_nation": (
        ("lineitem", "orders", "customer", "nation"),
        ("l_orderkey = o_orderkey", "o_custkey = c_custkey", "c_nationkey = n_nationkey"),
    ),
}
REPLICATED_JOINS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "customer_nation_region": (
        ("customer", "nation", "region"),
        ("c_nationkey = n_nationkey", "n_regionkey = r_regionkey"),
    ),
    "supplier_nation": (("supplier", "nation"), ("s_nationkey = n_nationkey",)),
    "partsupp_part": (("partsupp", "part"), ("ps_partkey = p_partkey",)),
}


def _flip(cond: str, draw: Draw) -> str:
    """Randomly write ``a = b`` as ``b = a`` (per conjunct)."""
    out = []
    for part in cond.split(" AND "):
        a, b = part.split(" = ")
        out.append(f"{b} = {a}" if draw(st.booleans()) else part)
    return " AND ".join(out)


def _join(draw: Draw, tables: Sequence[str], conds: Sequence[str]) -> Relation:
    conds = [_flip(c, draw) for c in conds]
    cols = _tables_cols(*tables)
    big = [k for t, k in (("lineitem", "l_orderkey"), ("orders", "o_orderkey")) if t in tables]
    style = draw(st.sampled_from(("on", "on", "inner", "comma")))
    if style == "comma":
        return Relation(", ".join(tables), cols, where=list(conds), big=big)
    kw = "INNER JOIN" if style == "inner" else "JOIN"
    sql = tables[0]
    for t, c in zip(tables[1:], conds, strict=True):
        sql += f" {kw} {t} ON {c}"
    return Relation(sql, cols, big=big)


def _join_relation(
    draw: Draw, joins: dict[str, tuple[tuple[str, ...], tuple[str, ...]]]
) -> Relation:
    name = draw(st.sampled_from(sorted(joins)))
    tables, conds = joins[name]
    if len(tables) == 2 and draw(st.booleans()):
        tables = (tables[1], tables[0])  # the same join written the other way round
    return _join(draw, tables, conds)


# --------------------------------------------------------------------------------------
# SELECT blocks


@dataclass
class Block:
    """Options for :func:`_select`."""

    mode: str = "plain"  # "plain", "group", "global"
    distinct: bool = False
    limit: bool | None = None  # None: random
    extra_where: list[str] = field(default_factory=list)
    extra_items: list[Expr] = field(default_factory=list)  # e.g. scalar subqueries
    pred: bool | None = None  # None: random
    restrict: bool = True  # allow restricting unbounded scans of big tables
    repeat_names: bool = False  # two outputs of one name (else now and then)


def _repeat_a_name(
    draw: Draw, items: list[tuple[Expr, str | None]], cols: Sequence[Col], mode: str
) -> None:
    """Add an output named like an earlier one (DuckDB allows it: ``SELECT 51 AS col1,
    col1``): the same item again, a constant, or (row-wise queries) another expression."""
    e, alias = items[draw(st.integers(0, len(items) - 1))]
    name = alias or e.bare
    choice = draw(st.integers(0, 2))
    if name is None or choice == 0:
        items.append((e, alias))  # the same output twice
    elif choice == 1 or mode != "plain":
        items.append((_constant(draw), name))
    else:
        items.append((scalar_expr(draw, cols, allow_float=False), name))


def _pick_group_keys(draw: Draw, cols: Sequence[Col]) -> list[Expr]:
    groupable = [c for c in cols if c.name in GROUPABLE]
    keys_any = [c for c in cols if c.kind == "key"]
    n = draw(st.integers(1, 3))
    keys: list[Expr] = []
    for _ in range(n):
        choice = draw(st.integers(0, 9))
        if choice <= 4 and groupable:
            e = _col_expr(draw(st.sampled_from(groupable)))
        elif choice <= 6 and keys_any:
            e = _col_expr(draw(st.sampled_from(keys_any)))
        elif choice == 7:
            dates = [c for c in cols if c.kind == "date"]
            e = (
                Expr(f"extract(year FROM {draw(st.sampled_from(dates)).name})", "int")
                if dates
                else _col_expr(draw(st.sampled_from(list(cols))))
            )
        elif choice == 8:
            e = (
                _constant(draw, integers=False)
                if _one_in(draw, 3)
                else scalar_expr(draw, cols, allow_float=False)
            )
        else:
            e = _col_expr(draw(st.sampled_from(list(cols))))
        if all(e.sql != k.sql for k in keys):
            keys.append(e)
    return keys


def _order_limit(
    draw: Draw,
    items: Sequence[tuple[Expr, str | None]],
    *,
    limit: bool | None,
    allow_order: bool = True,
) -> str:
    """ORDER BY every output column (by alias, name, ordinal or expression), optionally
    with LIMIT/OFFSET."""
    if not allow_order:
        return ""
    if limit is None:
        mode = draw(st.sampled_from(("none", "none", "order", "limit", "limit_offset")))
    else:
        mode = (
            draw(st.sampled_from(("limit", "limit_offset")))
            if limit
            else draw(st.sampled_from(("none", "order")))
        )
    if mode == "none":
        return ""
    positions = draw(st.permutations(range(len(items))))
    # aggregates that are DOUBLE (AVG) last: they may differ from DuckDB's in the last bit
    floats = [p for p in positions if items[p][0].kind == "float" and items[p][0].aggregate]
    positions = [p for p in positions if p not in floats] + floats
    names = [(alias or e.bare or "").lower() for e, alias in items]
    keys = []
    for pos in positions:
        e, alias = items[pos]
        name = alias or e.bare
        # a name two outputs share (or one shared with a column used by another output)
        # is ambiguous, and a literal is a position or an error: such keys are positions
        unique = name is not None and names.count(name.lower()) == 1
        as_written = not e.sql.startswith("(SELECT") and not e.constant
        how = draw(st.integers(0, 3))
        if how == 1 and as_written and (unique or e.bare is None):
            ref = e.sql
        elif how != 0 and unique:
            ref = name or str(pos + 1)
        else:
            ref = str(pos + 1)
        direction = draw(st.sampled_from(("", " ASC", " DESC")))
        nulls = draw(st.sampled_from(("", "", "", " NULLS FIRST", " NULLS LAST")))
        keys.append(f"{ref}{direction}{nulls}")
    sql = " ORDER BY " + ", ".join(keys)
    if mode in ("limit", "limit_offset"):
        n = draw(st.integers(0, 3)) if _one_in(draw, 6) else draw(st.integers(1, 100))
        sql += f" LIMIT {n}"
        if mode == "limit_offset":
            off = draw(st.integers(5, 50)) if _one_in(draw, 3) else draw(st.integers(0, 4))
            sql += f" OFFSET {off}"
    return sql


def _select(draw: Draw, rel: Relation, opts: Block) -> str:
    cols = rel.cols
    items: list[tuple[Expr, str | None]] = []
    group_sql = ""
    having_sql = ""
    alias_no = 0
    star = False

    def add(e: Expr, force_alias: bool = False) -> None:
        nonlocal alias_no
        if (
            e.bare is not None
            and not force_alias
            and all((x.bare != e.bare) or a for x, a in items)
        ) or (e.constant and not force_alias):
            items.append((e, None))  # a constant without alias: DuckDB names it by its text
        else:
            items.append((e, f"x{alias_no}"))
            alias_no += 1

    def add_constants() -> None:
        for _ in range(draw(st.integers(1, 2))):
            add(_constant(draw), force_alias=draw(st.booleans()))

    if opts.mode == "group":
        keys = _pick_group_keys(draw, cols)
        for k in keys:
            if not _one_in(draw, 6) or not items:  # usually output every key
                add(k)
        # an AVG may differ from DuckDB's in the last bit: never DISTINCT over one, and
        # ordered only after all the keys (then it never decides the order)
        avg_ok = not opts.distinct and len(items) == len(keys)
        for _ in range(draw(st.integers(1, 4))):
            add(_agg(draw, cols, allow_float=avg_ok), force_alias=True)
        if _one_in(draw, 5):
            add_constants()
        if _one_in(draw, 5):
            refs = [str(i + 1) for i, (e, _) in enumerate(items) if any(e is k for k in keys)]
            if len(refs) == len(keys):
                # by position, constant outputs too (an integer there is a position)
                refs += [str(i + 1) for i, (e, _) in enumerate(items) if e.constant]
                group_sql = " GROUP BY " + ", ".join(sorted(set(refs), key=int))
        if not group_sql:
            group_sql = " GROUP BY " + ", ".join(k.sql for k in keys)
        if _one_in(draw, 3):
            having_sql = f" HAVING {_having(draw, cols)}"
    elif opts.mode == "global":
        for _ in range(draw(st.integers(1, 4))):
            add(_agg(draw, cols), force_alias=True)
        if _one_in(draw, 6):
            add_constants()
    elif rel.star_ok and not opts.distinct and not opts.extra_items and _one_in(draw, 15):
        star = True
        items.extend((_col_expr(c), None) for c in cols)
    else:
        for _ in range(draw(st.integers(1, 5))):
            e = scalar_expr(draw, cols, allow_float=not opts.distinct)
            add(e, force_alias=e.bare is None)
        if _one_in(draw, 5):
            add_constants()
    for e in opts.extra_items:
        add(e, force_alias=True)
    if not star and (opts.repeat_names or _one_in(draw, 8)):
        _repeat_a_name(draw, items, cols, opts.mode)

    where = list(rel.where)
    if opts.pred is True or (opts.pred is None and draw(st.integers(0, 4)) > 0):
        where.append(predicate(draw, cols))
    where.extend(opts.extra_where)

    order_sql = _order_limit(draw, items, limit=opts.limit, allow_order=opts.mode != "global")
    bounded = " LIMIT " in order_sql or opts.mode != "plain"
    if not bounded and rel.big and opts.restrict and not _one_in(draw, 10):
        # keep unbounded scans of the big tables small at SF 0.1
        key = draw(st.sampled_from(rel.big))
        lo = draw(st.integers(1, 60_000))
        where.append(f"{key} BETWEEN {lo} AND {lo + draw(st.integers(300, 3_000))}")

    select_list = ", ".join(e.sql if a is None else f"{e.sql} AS {a}" for e, a in items)
    if star:
        select_list = "*"
    distinct = "DISTINCT " if opts.distinct else ""
    sql = f"SELECT {distinct}{select_list} FROM {rel.from_sql}"
    if where:
        sql += " WHERE " + " AND ".join(_paren(w) for w in where)
    return sql + group_sql + having_sql + order_sql


def _paren(cond: str) -> str:
    """Parenthesise a conjunct that contains OR unless it is already wrapped as a whole."""
    if " OR " not in cond or _wrapped(cond):
        return cond
    return f"({cond})"


def _wrapped(s: str) -> bool:
    if not (s.startswith("(") and s.endswith(")")):
        return False
    depth = 0
    for i, ch in enumerate(s):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0 and i < len(s) - 1:
            return False
    return True


# --------------------------------------------------------------------------------------
# shapes


def _scan(draw: Draw) -> str:
    rel = _single(draw(st.sampled_from(DISTRIBUTED)))
    return _select(draw, rel, Block(mode="plain", pred=draw(st.integers(0, 5)) > 0))


def _group_by(draw: Draw) -> str:
    rel = _single(draw(st.sampled_from(DISTRIBUTED)))
    return _select(draw, rel, Block(mode="group"))


def _global_agg(draw: Draw) -> str:
    rel = _single(draw(st.sampled_from(DISTRIBUTED)))
    if draw(st.integers(0, 3)) == 0:
        rel = _join_relation(draw, JOINS)
    return _select(draw, rel, Block(mode="global"))


def _top_n(draw: Draw) -> str:
    choice = draw(st.integers(0, 2))
    rel = _single(draw(st.sampled_from(DISTRIBUTED))) if choice < 2 else _join_relation(draw, JOINS)
    mode = draw(st.sampled_from(("plain", "group")))
    return _select(draw, rel, Block(mode=mode, limit=True))


def _join_shape(draw: Draw) -> str:
    rel = _join_relation(draw, JOINS)
    mode = draw(st.sampled_from(("plain", "group", "group")))
    return _select(draw, rel, Block(mode=mode))


def _distinct(draw: Draw) -> str:
    if draw(st.integers(0, 3)) == 0:
        rel = _join_relation(draw, JOINS)
    else:
        rel = _single(draw(st.sampled_from(DISTRIBUTED)))
    return _select(draw, rel, Block(mode="plain", distinct=True))


IN_SUBQUERIES: tuple[tuple[str, str, str, str], ...] = (
    # (outer column, inner key, inner table, outer tables that have the column)
    ("l_partkey", "p_partkey", "part", "lineitem"),
    ("l_suppkey", "s_suppkey", "supplier", "lineitem"),
    ("l_partkey", "ps_partkey", "partsupp", "lineitem"),  # duplicates in the subquery
    ("o_custkey", "c_custkey", "customer", "orders"),
    ("c_nationkey", "n_nationkey", "nation", "customer"),
)


def _in_subquery(draw: Draw) -> str:
    outer_col, key, table, outer_table = draw(st.sampled_from(IN_SUBQUERIES))
    if outer_table == "customer":
        rel = _join(draw, ("orders", "customer"), ("o_custkey = c_custkey",))
    elif draw(st.integers(0, 3)) == 0:
        rel = _join(draw, ("lineitem", "orders"), ("l_orderkey = o_orderkey",))
    else:
        rel = _single(outer_table)
    inner_cols = list(TABLES[table])
    inner = f"SELECT {key} FROM {table}"
    if table == "nation":
        inner += f" WHERE n_regionkey = {draw(st.integers(0, 4))}"
    elif draw(st.integers(0, 5)) > 0:
        inner += f" WHERE {predicate(draw, inner_cols, 1)}"
    neg = "NOT " if _one_in(draw, 4) else ""
    cond = f"{outer_col} {neg}IN ({inner})"
    mode = draw(st.sampled_from(("plain", "group", "global")))
    return _select(draw, rel, Block(mode=mode, extra_where=[cond]))


def _exists_subquery(draw: Draw) -> str:
    if draw(st.integers(0, 3)) == 0:
        rel = _join(draw, ("orders", "customer"), ("o_custkey = c_custkey",))
    else:
        rel = _single("orders")
    corr = draw(st.sampled_from(("l_orderkey = o_orderkey", "o_orderkey = l_orderkey")))
    inner = f"SELECT 1 FROM lineitem WHERE {corr}"
    if draw(st.integers(0, 4)) > 0:
        inner += f" AND {_paren(predicate(draw, list(TABLES['lineitem']), 1))}"
    neg = "NOT " if _one_in(draw, 4) else ""
    mode = draw(st.sampled_from(("plain", "group", "group", "global")))
    return _select(draw, rel, Block(mode=mode, extra_where=[f"{neg}EXISTS ({inner})"]))


SCALAR_SOURCES: tuple[tuple[str, str, str], ...] = (
    # (outer column, subquery column, subquery table): same kind of values
    ("l_quantity", "l_quantity", "lineitem"),
    ("l_extendedprice", "l_extendedprice", "lineitem"),
    ("l_discount", "l_discount", "lineitem"),
    ("o_totalprice", "o_totalprice", "orders"),
    ("l_extendedprice", "p_retailprice", "part"),
    ("o_totalprice", "c_acctbal", "customer"),
    ("l_partkey", "p_partkey", "part"),
    ("o_custkey", "c_custkey", "customer"),
    ("l_shipdate", "o_orderdate", "orders"),
)


def _scalar_subquery_sql(draw: Draw, sub_col: str, table: str, *, for_compare: bool) -> str:
    c = _col(sub_col)
    if c.kind == "date":
        fn = draw(st.sampled_from(("min", "max")))
    else:
        fn = draw(st.sampled_from(("avg", "avg", "min", "max", "sum", "count")))
    agg = "count(*)" if fn == "count" else f"{fn}({sub_col})"
    sql = f"SELECT {agg} FROM {table}"
    if fn == "avg" and for_compare:
        # avg is a DOUBLE: only broad (categorical) filters, so it never equals a value
        cats = [x for x in TABLES[table] if x.kind == "cat"]
        if cats and draw(st.booleans()):
            cat = draw(st.sampled_from(cats))
            sql += f" WHERE {cat.name} = {_lit(draw, cat)}"
    elif draw(st.booleans()):
        sql += f" WHERE {predicate(draw, list(TABLES[table]), 1)}"
    return f"({sql})"


def _scalar_subquery(draw: Draw) -> str:
    outer_col, sub_col, table = draw(st.sampled_from(SCALAR_SOURCES))
    outer_table = _col(outer_col).table
    rel = _single(outer_table)
    if draw(st.integers(0, 2)) == 0:
        # scalar subquery in the SELECT list instead
        other_col, other_table = draw(st.sampled_from([(s, t) for _, s, t in SCALAR_SOURCES]))
        sub = _scalar_subquery_sql(draw, other_col, other_table, for_compare=False)
        return _select(draw, rel, Block(mode="plain", extra_items=[Expr(sub, "float")]))
    sub = _scalar_subquery_sql(draw, sub_col, table, for_compare=True)
    op = draw(st.sampled_from(("<", "<=", ">", ">=")))
    cond = f"{outer_col} {op} {sub}"
    mode = draw(st.sampled_from(("plain", "group", "global")))
    return _select(draw, rel, Block(mode=mode, extra_where=[cond]))


def _derived_table(draw: Draw) -> str:
    choice = draw(st.integers(0, 3))
    if choice == 0:
        # aggregate of an aggregate (TPC-H Q13 style): regroup on a computed count
        table, key = draw(
            st.sampled_from(
                (
                    ("orders", "o_custkey"),
                    ("orders", "o_clerk"),
                    ("lineitem", "l_orderkey"),
                    ("lineitem", "l_partkey"),
                    ("lineitem", "l_suppkey"),
                )
            )
        )
        inner_where = ""
        if draw(st.booleans()):
            inner_where = f" WHERE {predicate(draw, list(TABLES[table]), 1)}"
        inner = f"SELECT {key}, count(*) AS cnt FROM {table}{inner_where} GROUP BY {key}"
        rel = Relation(f"({inner}) AS d", [Col("cnt", "int", 1, 40)], star_ok=False)
        agg = draw(st.sampled_from(("count(*)", "count(*)", "sum(cnt)", "min(cnt)")))
        sql = f"SELECT cnt, {agg} AS x0 FROM {rel.from_sql}"
        if draw(st.booleans()):
            sql += f" WHERE cnt {draw(st.sampled_from(_CMP))} {draw(st.integers(1, 12))}"
        sql += " GROUP BY cnt"
        return sql + _order_limit(
            draw, [(Expr("cnt", "int", bare="cnt"), None), (Expr(agg, "int"), "x0")], limit=None
        )
    if choice == 1:
        # orders joined with a per-order lineitem aggregate (TPC-H Q18 style)
        inner_pred = ""
        if draw(st.booleans()):
            inner_pred = f" WHERE {predicate(draw, list(TABLES['lineitem']), 1)}"
        agg = draw(st.sampled_from(("sum(l_quantity)", "count(*)", "max(l_extendedprice)")))
        inner = f"SELECT l_orderkey, {agg} AS q FROM lineitem{inner_pred} GROUP BY l_orderkey"
        cond = draw(st.sampled_from(("o_orderkey = t.l_orderkey", "t.l_orderkey = o_orderkey")))
        q_col = (
            Col("q", "dec", 1, 300)
            if "quantity" in agg
            else (Col("q", "int", 1, 7) if "count" in agg else Col("q", "dec", 900, 105_000))
        )
        rel = Relation(
            f"orders JOIN ({inner}) AS t ON {cond}",
            [*TABLES["orders"], q_col],
            big=["o_orderkey"],
            star_ok=False,  # t also outputs l_orderkey
        )
        mode = draw(st.sampled_from(("plain", "group", "global")))
        q_filter = f"q {draw(st.sampled_from(_CMP[2:]))} {_lit(draw, q_col)}"
        return _select(draw, rel, Block(mode=mode, extra_where=[q_filter]))
    # filtered / grouped projection of a projection
    base = _single(draw(st.sampled_from(DISTRIBUTED)))
    inner_items: list[tuple[Expr, str]] = []
    out_cols: list[Col] = []
    used: set[str] = set()
    for i in range(draw(st.integers(2, 5))):
        e = (
            _num_expr(draw, base.cols)
            if draw(st.booleans())
            else _col_expr(draw(st.sampled_from(base.cols)))
        )
        if e.sql in used:
            continue
        used.add(e.sql)
        name = f"v{i}"
        inner_items.append((e, name))
        src = _col(e.bare) if e.bare else Col(name, "dec" if e.kind == "dec" else "int", 0, 1000)
        out_cols.append(replace(src, name=name, table=""))
    if _one_in(draw, 4):
        # an output named like an earlier one: DuckDB calls it v<i>_1 outside
        j = draw(st.integers(0, len(inner_items) - 1))
        e = _num_expr(draw, base.cols)
        inner_items.append((e, inner_items[j][1]))
        out_cols.append(Col(f"{inner_items[j][1]}_1", "dec" if e.kind == "dec" else "int", 0, 1000))
    inner_where = ""
    if draw(st.integers(0, 3)) > 0:
        inner_where = f" WHERE {predicate(draw, base.cols, 1)}"
    key = base.big[0]
    inner_items.append((_col_expr(_col(key)), "k"))
    out_cols.append(Col("k", "key", 1, ORDERKEY_HI))
    inner = (
        "SELECT "
        + ", ".join(f"{e.sql} AS {n}" for e, n in inner_items)
        + f" FROM {base.from_sql}{inner_where}"
    )
    rel = Relation(f"({inner}) AS d", out_cols, big=["k"])
    if choice == 3:
        # join the derived table back to its partner on the distribution key
        partner = "orders" if base.from_sql == "lineitem" else "lineitem"
        pkey = "o_orderkey" if partner == "orders" else "l_orderkey"
        rel = Relation(
            f"({inner}) AS d JOIN {partner} ON d.k = {pkey}",
            [*out_cols, *TABLES[partner]],
            big=["k"],
        )
    mode = draw(st.sampled_from(("plain", "group", "global")))
    return _select(draw, rel, Block(mode=mode))


def _replicated(draw: Draw) -> str:
    if draw(st.integers(0, 2)) == 0:
        rel = _join_relation(draw, REPLICATED_JOINS)
    else:
        rel = _single(draw(st.sampled_from(REPLICATED)))
    mode = draw(st.sampled_from(("plain", "group", "global")))
    return _select(draw, rel, Block(mode=mode, distinct=mode == "plain" and _one_in(draw, 4)))


CROSS_JOINS: tuple[tuple[tuple[str, str], tuple[str, ...]], ...] = (
    # (tables, distributed keys cut to a small window: a cross join multiplies rows)
    (("orders", "region"), ("o_orderkey",)),
    (("nation", "region"), ()),
    (("supplier", "region"), ()),
    (("lineitem", "nation"), ("l_orderkey",)),
    (("region", "lineitem"), ("l_orderkey",)),
    (("orders", "lineitem"), ("o_orderkey", "l_orderkey")),
)


def _cross_join(draw: Draw) -> str:
    tables, keys = draw(st.sampled_from(CROSS_JOINS))
    where = []
    for key in keys:
        lo = draw(st.integers(1, 60_000))
        where.append(f"{key} BETWEEN {lo} AND {lo + draw(st.integers(0, 200))}")
    rel = Relation(f"{tables[0]} CROSS JOIN {tables[1]}", _tables_cols(*tables), where=where)
    mode = draw(st.sampled_from(("plain", "group", "global")))
    distinct = mode != "global" and _one_in(draw, 4)
    return _select(draw, rel, Block(mode=mode, distinct=distinct))


def _correlated_subquery(draw: Draw) -> str:
    """Subqueries correlated on other columns than the distribution key (decorrelated into
    grouped joins), nested subqueries, and correlated scalar subqueries in the SELECT list."""
    choice = draw(st.integers(0, 6))
    op = draw(st.sampled_from(("<", ">")))
    neg = "NOT " if _one_in(draw, 3) else ""
    extra_items: list[Expr] = []
    if choice == 0:
        rel = _single("orders")
        cond = (
            f"o_totalprice {op} (SELECT avg(o2.o_totalprice) FROM orders AS o2 "
            "WHERE o2.o_custkey = orders.o_custkey)"
        )
    elif choice == 1:  # TPC-H Q17
        rel = _single("lineitem")
        cond = (
            f"l_quantity {op} (SELECT 0.5 * avg(l2.l_quantity) FROM lineitem AS l2 "
            "WHERE l2.l_partkey = lineitem.l_partkey)"
        )
    elif choice == 2:  # a replicated outer query, a distributed inner one
        rel = _single(draw(st.sampled_from(("part", "supplier"))))
        key = "p_partkey" if rel.from_sql == "part" else "s_suppkey"
        column = "l_partkey" if rel.from_sql == "part" else "l_suppkey"
        cond = (
            f"{neg}EXISTS (SELECT 1 FROM lineitem WHERE {column} = {key} "
            f"AND l_quantity > {draw(st.integers(1, 50))})"
        )
    elif choice == 3:  # nested, uncorrelated
        rel = _single("lineitem")
        cond = (
            f"l_suppkey {neg}IN (SELECT s_suppkey FROM supplier WHERE s_nationkey IN "
            f"(SELECT n_nationkey FROM nation WHERE n_regionkey = {draw(st.integers(0, 4))}))"
        )
    elif choice == 4:  # correlated on the key, with a nested subquery inside
        rel = _single("orders")
        cond = (
            f"{neg}EXISTS (SELECT 1 FROM lineitem WHERE l_orderkey = o_orderkey AND l_partkey "
            f"IN (SELECT p_partkey FROM part WHERE p_size < {draw(st.integers(1, 50))}))"
        )
    else:  # a correlated scalar subquery in the SELECT list
        rel = _single("orders")
        cond = ""
        extra_items.append(
            draw(
                st.sampled_from(
                    (
                        Expr(
                            "(SELECT count(*) FROM lineitem WHERE l_orderkey = o_orderkey "
                            "AND l_quantity > 25)",
                            "int",
                        ),
                        Expr("(SELECT c_acctbal FROM customer WHERE c_custkey = o_custkey)", "dec"),
                        Expr(
                            "(SELECT count(*) FROM orders AS o2 "
                            "WHERE o2.o_custkey = orders.o_custkey)",
                            "int",
                        ),
                    )
                )
            )
        )
    modes = ("plain",) if extra_items else ("plain", "group", "global")
    mode = draw(st.sampled_from(modes))
    return _select(
        draw,
        rel,
        Block(mode=mode, extra_where=[cond] if cond else [], extra_items=extra_items),
    )


def _names(draw: Draw) -> str:
    """Outputs that share a name, constants in SELECT, DISTINCT, GROUP BY and ORDER BY."""
    rel = _single(draw(st.sampled_from(DISTRIBUTED)))
    if _one_in(draw, 3):
        rel = _join_relation(draw, JOINS)
    mode = draw(st.sampled_from(("plain", "group", "group", "global")))
    distinct = mode != "global" and draw(st.booleans())  # DISTINCT after GROUP BY too
    return _select(draw, rel, Block(mode=mode, distinct=distinct, repeat_names=True))


_BUILDERS: dict[str, Callable[[Draw], str]] = {
    "scan": _scan,
    "group_by": _group_by,
    "global_agg": _global_agg,
    "top_n": _top_n,
    "join": _join_shape,
    "distinct": _distinct,
    "in_subquery": _in_subquery,
    "exists_subquery": _exists_subquery,
    "scalar_subquery": _scalar_subquery,
    "derived_table": _derived_table,
    "replicated": _replicated,
    "cross_join": _cross_join,
    "correlated_subquery": _correlated_subquery,
    "names": _names,
}
SHAPES: tuple[str, ...] = tuple(_BUILDERS)


_SHAPE_ALIASES = ("d", "t", "k", "q", "cnt", "o2", "l2")
_IDENTIFIERS = frozenset(
    [*TABLES, *(c.name for cols in TABLES.values() for c in cols), *_SHAPE_ALIASES]
)
_ALIAS = re.compile(r"(x|v)[0-9]+(_1)?")
_STRING = re.compile(r"'(?:[^']|'')*'")
_WORD = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\b")


def _recase(sql: str, seed: int) -> str:
    """``sql`` with its table, column and alias names spelled in other cases, some quoted:
    DuckDB matches names case-insensitively, quoted or not, and keeps an alias as written.
    String literals are left alone."""
    rng = random.Random(seed)

    def spell(match: re.Match[str]) -> str:
        word = match.group(0)
        if word not in _IDENTIFIERS and not _ALIAS.fullmatch(word):
            return word
        style = rng.randrange(5)
        if style == 0:
            return word
        if style == 1:
            return word.upper()
        mixed = "".join(c.upper() if rng.random() < 0.5 else c for c in word)
        return f'"{mixed}"' if style >= 3 else mixed

    pieces = []
    last = 0
    for literal in _STRING.finditer(sql):
        pieces.append(_WORD.sub(spell, sql[last : literal.start()]))
        pieces.append(literal.group(0))
        last = literal.end()
    pieces.append(_WORD.sub(spell, sql[last:]))
    return "".join(pieces)


def sql_strategy_names() -> tuple[str, ...]:
    """Names of the query shapes :func:`select_queries` produces (see module docstring)."""
    return SHAPES


def labelled_select_queries(
    shapes: Iterable[str] | None = None,
) -> st.SearchStrategy[tuple[str, str]]:
    """Like :func:`select_queries` but yields ``(shape, sql)``."""
    names = tuple(shapes) if shapes is not None else SHAPES
    unknown = [s for s in names if s not in _BUILDERS]
    if unknown or not names:
        raise ValueError(f"unknown shapes {unknown}; choose from {SHAPES}")

    @st.composite
    def _strategy(draw: Draw) -> tuple[str, str]:
        shape = draw(st.sampled_from(names))
        sql = _BUILDERS[shape](draw)
        if _one_in(draw, 5):
            sql = _recase(sql, draw(st.integers(0, 2**16)))
        return shape, sql

    return _strategy()


def select_queries(shapes: Iterable[str] | None = None) -> st.SearchStrategy[str]:
    """Random, valid, deterministic DuckDB SELECT statements over the TPC-H schema.

    ``shapes`` restricts the query shapes (default: all of :data:`SHAPES`).
    """
    return labelled_select_queries(shapes).map(lambda pair: pair[1])
