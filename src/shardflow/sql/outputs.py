"""Output names and positional references, settled once so that every rewrite can rely on
them: every SELECT names its outputs uniquely, and no GROUP BY or ORDER BY holds a position
or a constant that DuckDB would read as one.

DuckDB lets a query return two columns of one name (``SELECT 51 AS col1, col1 FROM t``)
and renames the repeats where the result becomes a table (a derived table, a CTE):
``col1, col1_1``. Fragments and merges pass results between engines as Arrow tables, which
need unique names, so every block takes DuckDB's table names; the answer is given DuckDB's
own names back by position at the end (the session binds the query in DuckDB for them).

In GROUP BY and ORDER BY, DuckDB reads an integer literal as a position in the SELECT list
and refuses other literals in ORDER BY, so a rewrite that copies a key expression must never
copy a position or a constant: positions are replaced by what they point at, constant ORDER
BY keys (which order nothing) are dropped, and constant GROUP BY keys by :func:`group_by`.
"""

from __future__ import annotations

from sqlglot import exp

from shardflow.catalog import name_key
from shardflow.errors import QueryError
from shardflow.sql import analysis as a


def name_outputs_as_duckdb(tree: exp.Expr) -> None:
    """Name every output that is neither a column nor aliased as DuckDB names it, by its SQL
    text (``'k'`` for the string literal ``'k'``), where SQLGlot would borrow a name from
    inside it (``k``; ``x`` for ``CAST(x AS INT)``): the borrowed name collided with a real
    output's, and ``ORDER BY k`` was bound to the literal. (The answer takes DuckDB's own
    names at the end; these only keep the names the query uses apart.)"""
    for select in list(tree.find_all(exp.Select)):
        for projection in list(select.expressions):
            inner = a.unparen(projection)
            if isinstance(inner, exp.Alias | exp.Column | exp.Star | exp.Dot):
                continue
            if projection.output_name:  # the name SQLGlot's qualify would give it
                text = projection.sql(dialect="duckdb")
                projection.replace(exp.alias_(projection.copy(), a.identifier(text)))


def unique_output_names(tree: exp.Expr, *, root: bool = True) -> bool:
    """Rename the repeated output names of every SELECT in ``tree`` as DuckDB names the
    columns of a derived table: the first keeps its name, a repeat of ``x`` becomes the
    first free ``x_1``, ``x_2``, ... (names compared as DuckDB compares them). Outputs
    without a name yet (unqualified expressions) are left alone; with ``root=False`` the
    outermost SELECT too. ``ORDER BY x`` of a repeated name meant the last output of that
    name in DuckDB, and keeps meaning it. Returns whether a nested block was renamed (a
    ``SELECT *`` over it then needs qualifying again).

    >>> tree = exp.select("1 AS a", "2 AS a_1", "3 AS A").from_("t").order_by("a")
    >>> unique_output_names(tree), tree.sql()
    (False, 'SELECT 1 AS a, 2 AS a_1, 3 AS "A_2" FROM t ORDER BY "A_2"')
    """
    nested_renamed = False
    for select in list(tree.find_all(exp.Select)):
        if (select is tree and not root) or any(_is_star(p) for p in select.expressions):
            continue  # its names are not known (yet)
        used: set[str] = set()
        last: dict[str, str] = {}  # name -> what the last output of that name is called now
        repeated: set[str] = set()
        for projection in select.expressions:
            name = projection.alias_or_name
            if not name:
                continue
            unique = name
            suffix = 0
            while name_key(unique) in used:
                suffix += 1
                unique = f"{name}_{suffix}"
            used.add(name_key(unique))
            if name_key(name) in last:
                repeated.add(name_key(name))
            last[name_key(name)] = unique
            if unique != name:
                projection.replace(exp.alias_(projection.unalias().copy(), a.identifier(unique)))
        if repeated:
            _order_by_last(select, repeated, last)
        nested_renamed |= bool(repeated) and select is not tree
    return nested_renamed


def _order_by_last(select: exp.Select, repeated: set[str], last: dict[str, str]) -> None:
    order = select.args.get("order")
    for ordered in order.expressions if order is not None else []:
        key = a.unparen(ordered.this)
        if isinstance(key, exp.Column) and not key.table and name_key(key.name) in repeated:
            key.set("this", a.identifier(last[name_key(key.name)]))


def has_unexpanded_star(tree: exp.Expr) -> bool:
    return any(_is_star(p) for s in tree.find_all(exp.Select) for p in s.expressions)


def _is_star(projection: exp.Expr) -> bool:
    return isinstance(projection, exp.Star) or (
        isinstance(projection, exp.Column) and isinstance(projection.this, exp.Star)
    )


_POSITION = "shardflow_position"


def hide_positions(tree: exp.Expr) -> None:
    """Replace the positions in GROUP BY and ORDER BY by placeholders before qualification,
    for :func:`resolve_positions` to settle after it: SQLGlot cannot settle a position that
    points at a repeated name or into a ``*`` it does not expand yet (it fails on those)."""
    for query in list(tree.find_all(exp.Select, exp.SetOperation)):
        order = query.args.get("order")
        group = query.args.get("group")
        keys = [o.this for o in order.expressions] if order is not None else []
        keys += list(group.expressions) if group is not None else []
        for key in keys:
            if a.is_position(key):
                placeholder = exp.Placeholder()
                placeholder.meta[_POSITION] = int(a.unparen(key).name)
                key.replace(placeholder)


def resolve_positions(tree: exp.Expr) -> None:
    """Replace the positions :func:`hide_positions` hid by what they point at (a GROUP BY
    key by the expression, an ORDER BY key by the output name), drop constant ORDER BY keys
    and make every GROUP BY free of constants DuckDB would misread (:func:`group_keys`)."""
    for query in list(tree.find_all(exp.Select, exp.SetOperation)):
        order = query.args.get("order")
        group = query.args.get("group") if isinstance(query, exp.Select) else None
        if order is None and group is None:
            continue
        selects = _output_projections(query)
        if order is not None:
            kept = []
            for ordered in order.expressions:
                target = _position(ordered.this, selects)
                if target is not None:
                    if a.is_constant(target.unalias()):
                        continue  # a constant orders nothing
                    ordered.set("this", exp.column(a.identifier(target.alias_or_name)))
                elif isinstance(query, exp.Select) and a.is_constant(ordered.this):
                    continue
                kept.append(ordered)
            query.set("order", exp.Order(expressions=kept) if kept else None)
        if group is not None and group.expressions:
            keys = []
            for key in group.expressions:
                target = _position(key, selects)
                keys.append(target.unalias().copy() if target is not None else key)
            group.set("expressions", group_keys(keys))


def _output_projections(query: exp.Expr) -> list[exp.Expr]:
    while isinstance(query, exp.SetOperation):
        query = query.left
    while isinstance(query, exp.Subquery):
        query = query.this
    return list(query.expressions) if isinstance(query, exp.Select) else []


def _position(key: exp.Expr, selects: list[exp.Expr]) -> exp.Expr | None:
    """The SELECT item a GROUP BY / ORDER BY key names by position, if it is a position."""
    position = key.meta.get(_POSITION) if isinstance(key, exp.Placeholder) else None
    if not isinstance(position, int):
        return None
    if not 0 < position <= len(selects):
        raise QueryError(f"position {position} is not in the SELECT list (1 to {len(selects)})")
    return selects[position - 1]


def group_keys(keys: list[exp.Expr]) -> list[exp.Expr]:
    """GROUP BY keys that group as ``keys`` do and that DuckDB reads as expressions: a
    constant key groups nothing and is left out (an integer would be read as a position);
    when every key is a constant, ``TRUE`` keeps the grouping (one group when there are
    rows, none when there are none, unlike no GROUP BY at all).

    >>> [k.sql() for k in group_keys([exp.column("x"), exp.Literal.number(83)])]
    ['x']
    >>> [k.sql() for k in group_keys([exp.Literal.number(83)])]
    ['TRUE']
    """
    kept = [k for k in keys if not a.is_constant(k)]
    if keys and not kept:
        return [exp.true()]
    return kept


def group_by(keys: list[exp.Expr]) -> exp.Group | None:
    """A GROUP BY clause over ``keys`` (see :func:`group_keys`), None when there are none."""
    kept = group_keys(keys)
    return exp.Group(expressions=[k.copy() for k in kept]) if kept else None
