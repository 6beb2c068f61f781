"""Query shapes: queries that differ only in the constants they compare with share one plan,
made once and bound to each query's constants without parsing it.

A query's *shape* is its token sequence with the constants that are *compared with
something* taken out: the right side of ``=``, ``<>``, ``<``, ``<=``, ``>``, ``>=``,
``LIKE``, ``ILIKE``, the items of ``IN (...)``, both bounds of ``BETWEEN``, also when written
``DATE '...'``, ``CAST('...' AS ...)`` or negated. Such a constant decides which rows
qualify, never the form of the answer (a comparison is a boolean whatever the constant),
so it is a *parameter* of the shape. Every other constant (a LIMIT, a GROUP BY position, a
function's argument, a CASE result) stays part of the shape. So does each parameter's
kind (string, integer, or a decimal with its digits before and after the point), as DuckDB
types a literal by its spelling.

A shape's plan is a :class:`PlanTemplate`: the query planned with a unique *sentinel*
constant in place of each parameter. Binding replaces the sentinels in the stages' SQL with
the query's constants and recomputes the buckets of routed stages from their key terms.
A template is kept only if binding it to the constants of the query it was made from gives
exactly the plan the planner made for that query; otherwise the shape is planned query by
query (the caller keeps plans by exact text then).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from sqlglot import exp
from sqlglot.errors import SqlglotError
from sqlglot.tokenizer_core import Token, TokenType

from shardflow.catalog import Catalog
from shardflow.errors import Error
from shardflow.sql.parse import DIALECT, parse, tokenize
from shardflow.sql.plan import DistributedPlan, KeyTerm, Stage
from shardflow.sql.planner import plan
from shardflow.sql.pruning import buckets_of

__all__ = ["PlanTemplate", "Shape", "make_template", "shape_of"]

_COMPARISONS = frozenset(
    {
        TokenType.EQ,
        TokenType.NEQ,
        TokenType.LT,
        TokenType.LTE,
        TokenType.GT,
        TokenType.GTE,
        TokenType.LIKE,
        TokenType.ILIKE,
        TokenType.BETWEEN,
    }
)
_TYPED_STRINGS = frozenset(
    {TokenType.DATE, TokenType.TIMESTAMP, TokenType.TIMESTAMPTZ, TokenType.TIME}
)
"""Type names that may prefix a string constant: ``DATE '1995-03-15'``."""
_DECIMAL = re.compile(r"(\d+)\.(\d+)")
_SENTINEL_BASE = 7_340_000_000_000_000


@dataclass(frozen=True)
class Shape:
    """A query's shape (``key``) and its parameters: ``values`` as SQL, ``raw`` as written
    (a string's text without quotes), ``kinds`` (``s``, ``i``, ``d<p>.<s>``)."""

    key: tuple[object, ...]
    values: tuple[str, ...]
    raw: tuple[str, ...]
    kinds: tuple[str, ...]
    spans: tuple[tuple[int, int], ...]
    """Where each parameter is in the query's text (start, end inclusive)."""


def shape_of(sql: str) -> Shape | None:
    """``sql``'s shape, or None when it does not tokenize (the planner will say why)."""
    try:
        tokens = tokenize(sql)
    except SqlglotError:
        return None
    key: list[object] = []
    values: list[str] = []
    raw: list[str] = []
    kinds: list[str] = []
    spans: list[tuple[int, int]] = []
    for index, token in enumerate(tokens):
        kind = _kind(token)
        if kind is not None and _compared(tokens, index):
            key.append(kind)
            raw.append(token.text)
            values.append(_as_sql(token.text, kind))
            kinds.append(kind)
            spans.append((token.start, token.end))
        else:  # every other token as written (a keyword's spelling may name a column)
            key.append((token.token_type, token.text))
    return Shape(tuple(key), tuple(values), tuple(raw), tuple(kinds), tuple(spans))


def _kind(token: Token) -> str | None:
    """A constant's kind, or None for a token that cannot be a parameter."""
    if token.token_type == TokenType.STRING:
        return "s"
    if token.token_type != TokenType.NUMBER:
        return None
    if token.text.isdigit():
        return "i"
    decimal = _DECIMAL.fullmatch(token.text)
    if decimal is None:  # 1e5, .5, 0x1F: kept in the shape
        return None
    return f"d{len(decimal.group(1))}.{len(decimal.group(2))}"


def _operand_start(tokens: list[Token], index: int) -> int:
    """The first token of the constant operand ending at ``tokens[index]``: past a type
    prefix (``DATE '...'``), an opening ``CAST(`` and a minus sign."""
    start = index
    if start > 0 and tokens[start - 1].token_type in _TYPED_STRINGS:
        start -= 1
    if start > 1 and tokens[start - 1].token_type == TokenType.L_PAREN:
        if tokens[start - 2].text.upper() == "CAST":
            start -= 2
    if start > 0 and tokens[start - 1].token_type == TokenType.DASH:
        start -= 1
    return start


def _compared(tokens: list[Token], index: int) -> bool:
    """Whether the constant ``tokens[index]`` is compared with something."""
    before = _operand_start(tokens, index) - 1
    if before < 0:
        return False
    kind = tokens[before].token_type
    if kind in _COMPARISONS:
        return True
    if kind == TokenType.AND:  # the upper bound of BETWEEN a AND b
        lower = before - 1
        return (
            lower >= 0
            and _kind(tokens[lower]) is not None
            and tokens[_operand_start(tokens, lower) - 1].token_type == TokenType.BETWEEN
        )
    while kind == TokenType.COMMA:  # an item of IN (a, b, c): back over the items before
        item = before - 1
        if item < 0 or _kind(tokens[item]) is None:
            return False
        before = _operand_start(tokens, item) - 1
        if before < 0:
            return False
        kind = tokens[before].token_type
    return (
        kind == TokenType.L_PAREN and before > 0 and tokens[before - 1].token_type == TokenType.IN
    )


def _as_sql(text: str, kind: str) -> str:
    """A constant as the planner writes it in SQL."""
    return exp.Literal.string(text).sql(DIALECT) if kind == "s" else text


@dataclass(frozen=True)
class PlanTemplate:
    """A shape's plan with sentinels for its parameters (see the module's text)."""

    plan: DistributedPlan
    sentinels: tuple[str, ...]
    """Each parameter's sentinel as it appears in the stages' SQL."""
    raw_sentinels: tuple[str, ...]
    """Each sentinel as written in a key term (a string's text without quotes)."""
    pattern: re.Pattern[str] = dataclasses.field(compare=False)
    """Finds any of the sentinels in a stage's SQL."""

    def bind(self, shape: Shape, sql: str, catalog: Catalog) -> DistributedPlan:
        """The plan of ``sql`` (whose shape is ``shape``) from this template."""
        by_sentinel = dict(zip(self.sentinels, shape.values, strict=True))
        by_raw = dict(zip(self.raw_sentinels, shape.raw, strict=True))

        def text(value: str) -> str:
            return self.pattern.sub(lambda found: by_sentinel[found.group()], value)

        stages = []
        for stage in self.plan.stages:
            terms = tuple(
                KeyTerm(t.table, tuple((by_raw.get(v, v), s) for v, s in t.values))
                for t in stage.key_terms
            )
            stages.append(
                dataclasses.replace(
                    stage,
                    sql=text(stage.sql),
                    merge_sql=None if stage.merge_sql is None else text(stage.merge_sql),
                    reason=text(stage.reason),
                    key_terms=terms,
                    buckets=_rebucket(stage, terms, catalog),
                )
            )
        return DistributedPlan(sql, tuple(stages))


def _rebucket(stage: Stage, terms: tuple[KeyTerm, ...], catalog: Catalog) -> tuple[int, ...] | None:
    if stage.placement != "shards" or not terms:
        return stage.buckets
    return buckets_of(terms, catalog)


def make_template(
    shape: Shape, sql: str, planned: DistributedPlan, catalog: Catalog
) -> PlanTemplate | None:
    """The template of ``shape``, checked against ``planned`` (the plan the planner made for
    ``sql``); None when the shape has no parameters or its plan depends on them otherwise
    than through the text and the buckets."""
    if not shape.values or _names_may_hold_constants(sql):
        return None
    sentinels, raws = _sentinels(shape, sql)
    pieces, last = [], 0
    for (start, end), sentinel in zip(shape.spans, sentinels, strict=True):
        pieces += [sql[last:start], sentinel]
        last = end + 1
    pieces.append(sql[last:])
    try:
        sentinel_plan = plan("".join(pieces), catalog)
    except Error:
        return None
    pattern = re.compile("|".join(map(re.escape, sentinels)))
    template = PlanTemplate(sentinel_plan, sentinels, raws, pattern)
    if template.bind(shape, sql, catalog) != planned:
        return None
    return template


def _names_may_hold_constants(sql: str) -> bool:
    """Whether a column of the answer may be named after an expression with a constant in
    it (DuckDB names ``SELECT x = 5`` "(x = 5)"): its name would follow the constant, so
    the shape cannot keep one answer schema. Looks at the select list that names the answer
    and, when it has a ``*``, at the derived tables and CTEs the star may expand. Also True
    when the text does not parse."""
    try:
        tree = parse(sql)
    except Error:
        return True
    top = tree
    while isinstance(top, exp.SetOperation | exp.Subquery):  # the first branch names them
        top = top.this
    if not isinstance(top, exp.Select):
        return True
    if _unnamed_constant(top):
        return True
    if not any(isinstance(e, exp.Star) or e.find(exp.Star) for e in top.expressions):
        return False
    for select in tree.find_all(exp.Select):
        parent = select.parent
        derived = isinstance(parent, exp.CTE) or (
            isinstance(parent, exp.Subquery) and isinstance(parent.parent, exp.From | exp.Join)
        )
        if derived and _unnamed_constant(select):
            return True
    return False


def _unnamed_constant(select: exp.Select) -> bool:
    return any(
        not isinstance(column, exp.Alias) and any(isinstance(n, exp.Literal) for n in column.walk())
        for column in select.expressions
    )


def _sentinels(shape: Shape, sql: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A constant per parameter, of the parameter's kind, that is nowhere in ``sql``."""
    sentinels: list[str] = []
    raws: list[str] = []
    serial = 0
    for kind in shape.kinds:
        while True:
            serial += 1
            number = str(_SENTINEL_BASE + serial)
            if kind == "s":
                raw = f"sf{number}q"
            elif kind == "i":
                raw = number
            else:  # d<p>.<s>: the same digits after the point
                raw = f"{number}.{'5' * int(kind.split('.')[1])}"
            if raw not in sql:
                break
        raws.append(raw)
        sentinels.append(_as_sql(raw, "s" if kind == "s" else kind))
    return tuple(sentinels), tuple(raws)
