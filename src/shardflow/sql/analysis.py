"""Small read-only helpers over qualified SQLGlot trees, shared by the planner and its rules."""

from __future__ import annotations

import re
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass

from sqlglot import exp

QUERY_NODES = (exp.Select, exp.SetOperation)
ColumnId = tuple[int, str, str]
"""A column as (defining SELECT block, source alias, column name): unique in a whole query,
even where a subquery reuses an outer alias."""


@dataclass
class SourceRef:
    """A source in a SELECT's FROM clause: the FROM item or one JOIN."""

    alias: str
    node: exp.Expr
    join: exp.Join | None

    @property
    def side(self) -> str:
        return (self.join.side or "").upper() if self.join is not None else ""

    @property
    def kind(self) -> str:
        return (self.join.kind or "").upper() if self.join is not None else ""

    @property
    def outer_right(self) -> bool:
        """This source is on the null-supplying (or filtering) side of its join."""
        return self.side == "LEFT" or self.kind in ("SEMI", "ANTI")


def sources(select: exp.Select) -> list[SourceRef]:
    found = []
    from_ = select.args.get("from_")
    if from_ is not None:
        found.append(SourceRef(from_.this.alias_or_name, from_.this, None))
    for join in select.args.get("joins") or []:
        found.append(SourceRef(join.this.alias_or_name, join.this, join))
    return found


def conjuncts(condition: exp.Expr | None) -> list[exp.Expr]:
    """Split ``a AND (b AND c)`` into ``[a, b, c]`` (in order, without recursion: a
    generated filter may AND thousands of terms)."""
    if condition is None:
        return []
    if isinstance(condition, exp.Where):
        condition = condition.this
    found: list[exp.Expr] = []
    stack = [condition]
    while stack:
        part = stack.pop()
        while isinstance(part, exp.Paren):
            part = part.this
        if isinstance(part, exp.And):
            stack += [part.right, part.left]
        else:
            found.append(part)
    return found


def and_all(parts: Iterable[exp.Expr]) -> exp.Expr | None:
    parts = [p.copy() for p in parts]
    return balanced(exp.And, parts) if parts else None


def balanced(connector: type[exp.Connector], parts: list[exp.Expr]) -> exp.Expr:
    """``parts`` joined by ``connector`` (AND, OR) as a tree of logarithmic depth.

    Both are associative, so the shape changes nothing but the depth, and it prints as the
    same SQL; SQLGlot's scope analysis walks from every column to its SELECT, which costs
    the depth: ``a OR b OR ...`` parsed left-deep made planning quadratic in its length.

    >>> balanced(exp.Or, [exp.column(c) for c in "abcde"]).sql()
    'a OR b OR c OR d OR e'
    >>> balanced(exp.And, [exp.column("a"), exp.or_("b", "c")]).sql()
    'a AND (b OR c)'
    """
    if len(parts) == 1:
        part = parts[0]
        if isinstance(part, exp.Connector) and not isinstance(part, connector):
            return exp.paren(part, copy=False)  # SQL is printed from the tree: keep a OR b whole
        return part
    middle = len(parts) // 2
    return connector(
        this=balanced(connector, parts[:middle]), expression=balanced(connector, parts[middle:])
    )


def balance_connectors(tree: exp.Expr) -> None:
    """Rebuild every chain of three or more ANDs or ORs in ``tree`` as a balanced tree, in
    place (see :func:`balanced`)."""
    roots = [
        node
        for node in tree.walk()
        if isinstance(node, exp.And | exp.Or) and type(node.parent) is not type(node)
    ]
    for root in roots:
        operands: list[exp.Expr] = []
        stack: list[exp.Expr] = [root]
        while stack:
            node = stack.pop()
            if type(node) is type(root):
                stack += [node.expression, node.this]
            else:
                operands.append(node)
        if len(operands) > 2:
            root.replace(balanced(type(root), operands))


def balance_set_operations(tree: exp.Expr) -> None:
    """Rebuild every chain of three or more UNIONs (or INTERSECTs) of one kind in ``tree``
    as a balanced tree, in place. Both are associative, so only the depth changes: SQLGlot
    looks up a set operation's column names down its left spine, which made a left-deep
    chain of n branches cost n^2. EXCEPT is not associative and stays as written; modifiers
    (ORDER BY, LIMIT, WITH) stay on the chain's root, the branches keep their order."""
    roots = [
        node
        for node in tree.walk()
        if isinstance(node, exp.Union | exp.Intersect) and not _continues(node, node.parent)
    ]
    for root in roots:
        operands: list[exp.Expr] = []
        stack: list[exp.Expr] = [root]
        while stack:
            node = stack.pop()
            if node is root or _continues(node, root):
                stack += [node.expression, node.this]
            else:
                operands.append(node)
        if len(operands) > 2:
            middle = len(operands) // 2
            root.set("this", _balanced_set(root, operands[:middle]))
            root.set("expression", _balanced_set(root, operands[middle:]))


def _continues(node: exp.Expr, root: exp.Expr | None) -> bool:
    """Whether ``node`` continues ``root``'s chain: the same operation, ALL or DISTINCT
    alike, and nothing of its own (no ORDER BY, LIMIT, BY NAME, ...)."""
    if root is None or type(node) is not type(root):
        return False
    own = {k for k, v in node.args.items() if v and k not in ("this", "expression", "distinct")}
    return not own and bool(node.args.get("distinct")) == bool(root.args.get("distinct"))


def _balanced_set(root: exp.Expr, parts: list[exp.Expr]) -> exp.Expr:
    if len(parts) == 1:
        return parts[0]
    middle = len(parts) // 2
    return type(root)(
        this=_balanced_set(root, parts[:middle]),
        expression=_balanced_set(root, parts[middle:]),
        distinct=bool(root.args.get("distinct")),
    )


def column_id(column: exp.Column) -> ColumnId:
    """The scoped id of a qualified column: the nearest enclosing SELECT defining its alias."""
    select = column.find_ancestor(exp.Select)
    while select is not None:
        if any(s.alias == column.table for s in sources(select)):
            return (id(select), column.table, column.name)
        select = select.parent_select
    return (0, column.table, column.name)


def source_column(select: exp.Select, alias: str, name: str) -> ColumnId:
    return (id(select), alias, name)


def equalities(condition: exp.Expr | None) -> Iterator[tuple[ColumnId, ColumnId]]:
    """Column pairs that a conjunct ``a.x = b.y`` makes equal on every row that passes."""
    for part in conjuncts(condition):
        if isinstance(part, exp.EQ):
            left, right = _strip(part.left), _strip(part.right)
            if isinstance(left, exp.Column) and isinstance(right, exp.Column):
                if left.table and right.table:
                    yield column_id(left), column_id(right)


def _strip(node: exp.Expr) -> exp.Expr:
    while isinstance(node, exp.Paren):
        node = node.this
    return node


def walk_block(node: exp.Expr) -> Iterator[exp.Expr]:
    """Every node of ``node`` that belongs to its own SELECT block (not to nested queries)."""
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        for child in current.iter_expressions():
            if isinstance(child, QUERY_NODES) or (
                isinstance(child, exp.Subquery) and isinstance(child.this, QUERY_NODES)
            ):
                continue
            stack.append(child)


def nested_queries(select: exp.Select) -> list[exp.Expr]:
    """Queries nested in expressions of ``select`` (WHERE, SELECT list, HAVING, ON, ...),
    not the derived tables of its FROM clause, not deeper ones."""
    found: list[exp.Expr] = []
    roots = [
        value
        for key, value in select.args.items()
        if key not in ("from_", "joins", "with_") and isinstance(value, exp.Expr)
    ]
    roots += [e for e in select.args.get("expressions") or []]
    roots += [j.args["on"] for j in select.args.get("joins") or [] if j.args.get("on")]
    seen: set[int] = set()
    for root in roots:
        for node in _walk_until_query(root):
            if id(node) not in seen:
                seen.add(id(node))
                found.append(node)
    return found


def _walk_until_query(root: exp.Expr) -> Iterator[exp.Expr]:
    stack = [root]
    while stack:
        current = stack.pop()
        if isinstance(current, QUERY_NODES):
            yield current
            continue
        stack.extend(current.iter_expressions())


def block_parts(select: exp.Select, keys: tuple[str, ...]) -> list[exp.Expr]:
    parts: list[exp.Expr] = []
    for key in keys:
        value = select.args.get(key)
        if isinstance(value, list):
            parts.extend(value)
        elif isinstance(value, exp.Expr):
            parts.append(value)
    return parts


def defined_aliases(query: exp.Expr) -> set[str]:
    """Every source alias and CTE name defined anywhere inside ``query``."""
    names: set[str] = set()
    for node in query.walk():
        if isinstance(node, exp.Select):
            names.update(s.alias for s in sources(node))
        elif isinstance(node, exp.CTE):
            names.add(node.alias_or_name)
    return names


def external_columns(query: exp.Expr) -> list[exp.Column]:
    """Columns of ``query`` that refer to sources outside it (correlation)."""
    inner = defined_aliases(query)
    return [c for c in query.find_all(exp.Column) if c.table and c.table not in inner]


def is_aggregate(node: exp.Expr) -> bool:
    """An aggregate call evaluated by GROUP BY (a window function is not)."""
    return isinstance(node, exp.AggFunc) and not isinstance(node.parent, exp.Window)


def block_has_aggregates(select: exp.Select) -> bool:
    parts = block_parts(select, ("expressions", "having", "order", "qualify"))
    return any(is_aggregate(n) for part in parts for n in walk_block(part))


def block_windows(select: exp.Select) -> list[exp.Window]:
    parts = block_parts(select, ("expressions", "order", "qualify"))
    return [n for part in parts for n in walk_block(part) if isinstance(n, exp.Window)]


_PLAIN_NAME = re.compile(r"[a-z_][a-z0-9_]*")
_CONSTANT_NODES = (
    exp.Literal,
    exp.Null,
    exp.Boolean,
    exp.Paren,
    exp.Neg,
    exp.Not,
    exp.Cast,
    exp.TryCast,
    exp.DataType,
    exp.DataTypeParam,
    exp.Interval,
    exp.Var,
    exp.Binary,
)


def identifier(name: str) -> exp.Identifier:
    """``name`` as an identifier, quoted unless it is a plain lower-case name, so that
    engines that match names exactly (Polars) see it as it is spelled."""
    return exp.to_identifier(name, quoted=not _PLAIN_NAME.fullmatch(name))


def unparen(node: exp.Expr) -> exp.Expr:
    while isinstance(node, exp.Paren):
        node = node.this
    return node


def is_constant(node: exp.Expr) -> bool:
    """Built of literals and operators alone (no column, function, aggregate or subquery):
    the same value on every row.

    >>> is_constant(exp.Neg(this=exp.Literal.number(5))), is_constant(exp.column("x"))
    (True, False)
    """
    return all(isinstance(n, _CONSTANT_NODES) for n in node.walk())


def is_position(node: exp.Expr) -> bool:
    """An integer literal, which DuckDB reads as a position in GROUP BY and ORDER BY."""
    node = unparen(node)
    return isinstance(node, exp.Literal) and node.is_int


def table_names(query: exp.Expr) -> set[str]:
    """Names of the (non-function) tables a query reads, CTE names included."""
    return {t.name for t in query.find_all(exp.Table) if isinstance(t.this, exp.Identifier)}


class UnionFind:
    def __init__(self) -> None:
        self._parent: dict[Hashable, Hashable] = {}

    def find(self, item: Hashable) -> Hashable:
        parent = self._parent.setdefault(item, item)
        if parent != item:
            parent = self._parent[item] = self.find(parent)
        return parent

    def items(self) -> list[Hashable]:
        return list(self._parent)

    def union(self, a: Hashable, b: Hashable) -> None:
        root_a, root_b = self.find(a), self.find(b)
        if root_a != root_b:
            self._parent[root_a] = root_b
