"""Distributed planning: a qualified query becomes stages that run on shards, on one worker
or on the client.

The planner decides, block by block, where each part of a query can run:

* **replicated** — every table it reads has a full copy on every worker: one worker runs it;
* **partitioned** — it is *shard-local*: running it on every worker over that worker's shards
  and concatenating gives the right answer (scans, filters, joins of co-located tables on
  their key, joins with replicated tables, GROUP BY that includes the key, subqueries
  correlated on the key);
* **non-local** — it is not: GROUP BY on another column, global aggregates, windows, LIMIT.

A non-local part that feeds another part (a CTE, a derived table, an uncorrelated subquery,
the far side of a join that is not co-located) is *materialized* by a stage of its own, whose
result every later stage sees like a replicated table. The final part is finished by the
first rule of :data:`shardflow.sql.rules.FINISHING_RULES` that applies; the last of them,
``gather``, applies to everything, so no query is ever refused or answered wrongly for being
hard to distribute: it is answered more slowly.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from sqlglot import exp
from sqlglot.tokenizer_core import TokenType

from shardflow.catalog import Catalog, TableSpec
from shardflow.errors import NotDistributable, QueryError, UnsupportedError
from shardflow.sql import analysis as a
from shardflow.sql.decorrelate import decorrelate, mark, semijoin_reduction
from shardflow.sql.parse import (
    DIALECT,
    MAX_NESTING,
    parse,
    refuse_file_functions,
    refuse_row_ids,
    resolve,
    tables_read,
    tokenize,
)
from shardflow.sql.plan import TEMP_PREFIX, WHOLE, DistributedPlan, Placement, Stage
from shardflow.sql.pruning import buckets_of, key_terms
from shardflow.sql.rules import FINISHING_RULES, Finish
from shardflow.sql.verbatim import resolved_whole_reason, whole_query_reason

log = logging.getLogger(__name__)

DistKind = Literal["replicated", "partitioned", "nonlocal"]
MAX_SETTLE_ROUNDS = 32


@dataclass(frozen=True)
class Dist:
    """How the result of a query block is spread over the workers."""

    kind: DistKind
    group: str | None = None
    keys: frozenset[str] = frozenset()
    rows: int = 0
    reason: str = ""
    anchored: bool = False


REPLICATED = Dist("replicated")


@dataclass(frozen=True)
class Frame:
    """What a correlated subquery sees of its enclosing block: the key's column class."""

    group: str | None
    key_ids: frozenset[a.ColumnId]


@dataclass
class Env:
    ctes: dict[str, tuple[Dist, exp.CTE]] = field(default_factory=dict)
    temps: set[str] = field(default_factory=set)


@dataclass
class _Source:
    ref: a.SourceRef
    dist: Dist


def plan(sql: str, catalog: Catalog) -> DistributedPlan:
    """Plan ``sql`` against ``catalog``. Raises :class:`shardflow.QueryError` subclasses."""
    try:
        tree = parse(sql)
        refuse_file_functions(sql)
        read, _ = tables_read(tree, catalog)
        refuse_row_ids(tree, catalog)
        _refuse_tables_by_name(tree, catalog)
        if not any(spec.distributed for spec in read):
            if read:
                _check_names(tree, catalog)
            return _as_written(sql, read)
        whole_plan = _whole_on_one_node(sql, read, catalog)
        if whole_plan is not None:
            _check_names(tree, catalog)
            return whole_plan
        whole = whole_query_reason(tree)
        if whole is not None:
            return gather_plan(sql, catalog, whole)
        resolved = resolve(tree, catalog)
        whole = resolved_whole_reason(resolved)
        if whole is not None:
            return gather_plan(sql, catalog, whole)
        planner = Planner(catalog)
        planner.plan_query(resolved, Env(), output="")
        check_stage_groups(planner.stages, catalog)
    except RecursionError:  # a nesting the token count does not see (NOT NOT NOT ...)
        raise UnsupportedError(
            "the query is nested too deeply for the planner: flatten it (at most "
            f"{MAX_NESTING} levels of brackets or CASE expressions are supported)"
        ) from None
    return DistributedPlan(sql, tuple(planner.stages))


def _refuse_tables_by_name(tree: exp.Expr, catalog: Catalog) -> None:
    """A table function that reads a table named in its arguments (``histogram(t, x)``)
    would look for it in DuckDB's catalog, where shardflow tables are not."""
    for table in tree.find_all(exp.Table):
        if isinstance(table.this, exp.Identifier):
            continue
        for name in table.this.find_all(exp.Column, exp.Identifier):
            spec = catalog.find_table(name.name)
            if spec is not None:
                raise UnsupportedError(
                    f"a table function reads table {spec.name!r} by name; shardflow tables "
                    "are read only in FROM and JOIN"
                )


def _check_names(tree: exp.Expr, catalog: Catalog) -> None:
    """The planner's name errors for a query it will not take apart (an unknown column says
    which); what else its resolution stumbles on is left to DuckDB, which runs it as written."""
    try:
        resolve(tree.copy(), catalog)
    except QueryError:
        raise
    except Exception as error:
        log.debug("name check of a query run as written stopped: %r", error)


def _as_written(sql: str, read: list[TableSpec]) -> DistributedPlan:
    """A query that reads no distributed table runs as written in one place: on a worker
    (which holds every replicated table) or, reading no table at all, on the client."""
    placement: Placement = "worker" if read else "client"
    reason = "reads only replicated tables" if read else "reads no table"
    return DistributedPlan(sql, (Stage("", sql, placement, "replicated", reason=reason),))


def _whole_on_one_node(sql: str, read: list[TableSpec], catalog: Catalog) -> DistributedPlan | None:
    """The plan of a query whose distributed tables are all of one co-location group with
    every unit on one node (a table small enough to be one shard,
    :func:`shardflow.control.placement.initial_unit_count`): it runs there as written, in
    one fragment over the node's shards and replicated tables, nothing split, merged or
    handed from stage to stage. None for any other query."""
    distributed = [spec for spec in read if spec.distributed]
    group = catalog.groups.get(distributed[0].group or "") if distributed else None
    if group is None or any(spec.group != group.group_id for spec in distributed):
        return None
    nodes = {unit.node for unit in group.units}
    if len(nodes) != 1:
        return None
    stage = Stage(
        "",
        sql,
        "shards",
        WHOLE,
        reason="every shard it reads is on one node",
        group=group.group_id,
        tables=tuple(spec.name for spec in distributed),
    )
    return DistributedPlan(sql, (stage,))


def gather_plan(sql: str, catalog: Catalog, reason: str) -> DistributedPlan:
    """The plan that is right for any query DuckDB answers: every table the text names is
    gathered whole (a distributed one from its shards, a replicated one from a worker) and
    ``sql`` runs unchanged on the client, over tables of the same names. The fallback for a
    query the planner cannot distribute as written; slow for big tables, never wrong."""
    tables = _named_tables(sql, catalog)
    stages = [
        Stage(
            spec.name,
            f"SELECT * FROM {exp.to_identifier(spec.name, quoted=True).sql(DIALECT)}",
            "shards" if spec.distributed else "worker",
            "gather" if spec.distributed else "replicated",
            reason=f"{spec.name} gathered whole",
            group=spec.group,
            tables=(spec.name,) if spec.distributed else (),
        )
        for spec in tables
    ]
    stages.append(
        Stage(
            "",
            sql,
            "client",
            "gather",
            reason=f"runs as written over the gathered tables: {reason}",
            inputs=tuple(spec.name for spec in tables),
        )
    )
    return DistributedPlan(sql, tuple(stages))


def _named_tables(sql: str, catalog: Catalog) -> list[TableSpec]:
    """The catalog tables whose names appear in ``sql`` as identifiers (a superset of those
    it reads: a column or CTE named like a table adds that table; nothing is missed)."""
    found: dict[str, TableSpec] = {}
    for token in tokenize(sql):
        if token.token_type in (TokenType.VAR, TokenType.IDENTIFIER) or token.text.isidentifier():
            spec = catalog.find_table(token.text)
            if spec is not None:
                found.setdefault(spec.name, spec)
    return sorted(found.values(), key=lambda spec: spec.name)


class Planner:
    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self.stages: list[Stage] = []
        self._temp_counter = 0

    # -- stages --------------------------------------------------------------------------
    def plan_query(self, query: exp.Expr, env: Env, output: str) -> None:
        """Append the stages that compute ``query`` (owned: it is rewritten in place)."""
        dist = self.settle_query(query, env, outer=None)
        _drop_unused_ctes(query)  # a CTE settled into an earlier stage may read other shards
        tables = self._distributed_tables(query, env)
        inputs = self._inputs(query, env)
        if dist.kind == "replicated":
            placement: Placement = "worker" if self._reads_catalog(query, env) else "client"
            self.stages.append(
                Stage(
                    output,
                    query.sql(DIALECT),
                    placement,
                    "replicated",
                    reason="reads only replicated tables and earlier results",
                    inputs=inputs,
                )
            )
            return
        for rule in FINISHING_RULES:
            finish = rule(query, dist.kind == "partitioned", dist.reason)
            if finish is not None:
                self.stages.append(self._scatter_stage(output, finish, dist, tables, inputs, env))
                return
        raise AssertionError("the gather rule applies to every query")  # pragma: no cover

    def _scatter_stage(
        self,
        output: str,
        finish: Finish,
        dist: Dist,
        tables: tuple[str, ...],
        inputs: tuple[str, ...],
        env: Env,
    ) -> Stage:
        merge_on: Literal["client", "worker"] = "client"
        if finish.merge is not None and self._reads_catalog(finish.merge, env):
            merge_on = "worker"
        terms = key_terms(finish.fragment, self.catalog)
        return Stage(
            output,
            finish.fragment.sql(DIALECT),
            "shards",
            finish.strategy,
            reason=finish.reason,
            group=dist.group,
            tables=tables,
            inputs=inputs,
            merge_sql=finish.merge.sql(DIALECT) if finish.merge is not None else None,
            merge_on=merge_on,
            buckets=buckets_of(terms, self.catalog),
            key_terms=terms,
        )

    def materialize(self, query: exp.Expr, env: Env) -> str:
        """Plan ``query`` as stages of its own; returns the name its result is visible as."""
        query = query.copy()
        self._attach_ctes(query, env)
        self._temp_counter += 1
        temp = f"{TEMP_PREFIX}{self._temp_counter}"
        self.plan_query(query, Env(dict(env.ctes), set(env.temps)), output=temp)
        env.temps.add(temp)
        return temp

    # -- distribution analysis -----------------------------------------------------------
    def settle_query(self, query: exp.Expr, env: Env, outer: Frame | None) -> Dist:
        """Rewrite ``query`` until every part is replicated, shard-local or materialized,
        and say how its result is distributed."""
        if isinstance(query, exp.Subquery):
            return self.settle_query(query.this, env, outer)
        self._settle_ctes(query, env)
        if isinstance(query, exp.SetOperation):
            return self._settle_set_operation(query, env, outer)
        if isinstance(query, exp.Select):
            return self._settle_select(query, env, outer)
        return REPLICATED  # VALUES and other table-less queries run anywhere

    def _settle_ctes(self, query: exp.Expr, env: Env) -> None:
        with_ = query.args.get("with_")
        if with_ is None:
            return
        if with_.args.get("recursive"):
            self._settle_recursive(query, env)
            return
        _drop_unused_ctes(query)
        with_ = query.args.get("with_")
        for cte in list(with_.expressions) if with_ is not None else []:
            name = cte.alias_or_name
            dist = self.settle_query(cte.this, env, outer=None)
            if dist.kind == "nonlocal":
                temp = self.materialize(cte.this, env)
                cte.pop()
                _rename_table_refs(query, name, temp)
            else:
                env.ctes[name] = (dist, cte)
        if with_ is not None and not with_.expressions:
            query.set("with_", None)

    def _settle_recursive(self, query: exp.Expr, env: Env) -> None:
        """A recursive CTE over distributed tables reads them materialized (gathered)."""
        for table in list(query.find_all(exp.Table)):
            spec = self.catalog.find_table(table.name)
            if spec is not None and spec.distributed and table.name not in env.ctes:
                parent = table.parent_select
                if isinstance(parent, exp.Select):
                    for ref in a.sources(parent):
                        if ref.node is table:
                            self._materialize_source(parent, ref, env)

    def _settle_set_operation(self, query: exp.SetOperation, env: Env, outer: Frame | None) -> Dist:
        """Settle ``a UNION b UNION c ...`` step by step from the innermost operation (a loop,
        not a recursion: generated queries chain thousands of them)."""
        chain = [query]
        while isinstance(chain[-1].left, exp.SetOperation):
            chain.append(chain[-1].left)
        dist = self.settle_query(chain[-1].left, env, outer)
        for node in reversed(chain):
            dist = self._settle_set_step(node, dist, self.settle_query(node.right, env, outer), env)
        return dist

    def _settle_set_step(self, query: exp.SetOperation, left: Dist, right: Dist, env: Env) -> Dist:
        if left.kind == right.kind == "replicated":
            return REPLICATED
        union_all = isinstance(query, exp.Union) and not query.args.get("distinct")
        if union_all and left.kind == right.kind == "partitioned" and left.group == right.group:
            local = not (query.args.get("limit") or query.args.get("offset"))
            return Dist(
                "partitioned" if local else "nonlocal",
                left.group,
                rows=left.rows + right.rows,
                reason="" if local else "limit",
            )
        for side, dist in ((query.left, left), (query.right, right)):
            if dist.kind != "replicated":
                temp = self.materialize(side, env)
                side.replace(exp.select("*").from_(temp))
        return REPLICATED

    def _settle_select(self, select: exp.Select, env: Env, outer: Frame | None) -> Dist:
        decorrelated = False
        for _ in range(MAX_SETTLE_ROUNDS):
            srcs = [_Source(ref, self._source_dist(select, ref, env)) for ref in a.sources(select)]
            if any(s.dist.kind == "nonlocal" for s in srcs):
                continue  # a derived table was materialized: look again
            uf = _equivalences(select, srcs)
            components = _components(select, srcs, uf)
            to_materialize = _join_violations(srcs, components)
            if not to_materialize and len(set(components.values())) > 1:
                keep = self._component_to_keep(srcs, components, uf, outer)
                to_materialize = [s for s in srcs if components.get(s.ref.alias, keep) != keep]
            if to_materialize:
                for source in to_materialize:
                    self._materialize_source(select, source.ref, env)
                continue
            partitioned = [s for s in srcs if s.dist.kind == "partitioned"]
            group = partitioned[0].dist.group if partitioned else None
            key_ids = _key_class(select, partitioned, uf)
            frame = Frame(group, frozenset(key_ids) | (outer.key_ids if outer else frozenset()))
            unresolved = [
                nested
                for nested in a.nested_queries(select)
                if self._settle_nested(select, nested, env, frame) == "decorrelate"
            ]
            if unresolved and not decorrelated:
                for nested in unresolved:
                    mark(nested)
                decorrelate(select)
                decorrelated = True
                continue
            for nested in unresolved:  # what decorrelation could not rewrite is gathered
                self._gather_sources(nested, env)
            if not partitioned:
                return REPLICATED
            anchored = bool(
                outer
                and outer.group == group
                and any(uf.find(k) in {uf.find(o) for o in outer.key_ids} for k in key_ids)
            )
            rows = max(s.dist.rows for s in partitioned)
            reason = _nonlocal_reason(select, key_ids)
            if reason:
                self._gather_post_aggregate_subqueries(select, env)
                return Dist("nonlocal", group, rows=rows, reason=reason, anchored=anchored)
            keys = frozenset(
                projection.alias_or_name
                for projection in select.expressions
                if isinstance(projection.unalias(), exp.Column)
                and a.column_id(projection.unalias()) in key_ids
            )
            return Dist("partitioned", group, keys, rows, anchored=anchored)
        raise AssertionError("planning did not settle")  # pragma: no cover

    def _settle_nested(self, select: exp.Select, nested: exp.Expr, env: Env, frame: Frame) -> str:
        """ "decorrelate" for a correlated subquery that cannot run per shard; otherwise
        "ok", after materializing it here when it is uncorrelated and not local."""
        correlated = bool(a.external_columns(nested))
        dist = self.settle_query(nested, env, frame if correlated else None)
        if dist.kind == "replicated":
            return "ok"
        if correlated:
            if frame.group is not None and dist.group == frame.group and dist.anchored:
                return "ok"
            return "decorrelate"
        if (
            dist.kind == "partitioned"
            and dist.group == frame.group
            and _is_local_in_filter(select, nested, dist, frame)
        ):
            return "ok"
        temp = self.materialize(nested, env)
        nested.replace(exp.select("*").from_(temp))
        return "ok"

    def _gather_post_aggregate_subqueries(self, select: exp.Select, env: Env) -> None:
        """Subqueries evaluated after aggregation run in the merge: they must not read shards."""
        for part in a.block_parts(select, ("expressions", "having", "order", "qualify")):
            for nested in list(a._walk_until_query(part)):
                if self.settle_query(nested, env, None).kind != "replicated":
                    self._gather_sources(nested, env)

    def _source_dist(self, select: exp.Select, ref: a.SourceRef, env: Env) -> Dist:
        node = ref.node
        if isinstance(node, exp.Table) and isinstance(node.this, exp.Identifier):
            name = node.name
            if name in env.temps:
                return REPLICATED
            if name in env.ctes:
                dist = env.ctes[name][0]
                return replace(dist, keys=dist.keys, anchored=False)
            spec = self.catalog.find_table(name)
            if spec is None or not spec.distributed:
                return Dist("replicated", rows=spec.rows if spec else 0)
            keys = frozenset({spec.key}) if spec.key else frozenset()
            return Dist("partitioned", spec.group, keys, spec.rows)
        if isinstance(node, exp.Subquery) and isinstance(node.this, a.QUERY_NODES):
            dist = self.settle_query(node.this, env, outer=None)
            if dist.kind == "nonlocal":
                body = node.this.copy()
                semijoin_reduction(select, ref, body, self._replicated_sources(select, env))
                temp = self.materialize(body, env)
                node.replace(_temp_table(temp, ref.alias))
            return dist
        if any(self._reads_distributed(t, env) for t in node.find_all(exp.Table)):
            raise NotDistributable(
                f"{node.key.upper()} sources over distributed tables are not supported"
            )
        return REPLICATED

    def _component_to_keep(
        self,
        srcs: list[_Source],
        components: dict[str, object],
        uf: a.UnionFind,
        outer: Frame | None,
    ) -> object:
        sizes: dict[object, int] = {}
        for source in srcs:
            if source.ref.alias in components:
                component = components[source.ref.alias]
                sizes[component] = max(sizes.get(component, 0), source.dist.rows)
        if outer is not None:  # keep the part tied to the outer block's key
            outer_roots = {uf.find(o) for o in outer.key_ids}
            for component in sizes:
                if isinstance(component, tuple) and component[1] in outer_roots:
                    return component
        return max(sizes, key=lambda c: (sizes[c], str(c)))

    # -- materialization -----------------------------------------------------------------
    def _materialize_source(self, select: exp.Select, ref: a.SourceRef, env: Env) -> None:
        """Replace one source of ``select`` by a stage computing its needed rows/columns."""
        pushed = _pushable_conjuncts(select, ref)
        needed = _needed_columns(select, ref, self._source_columns(ref, env))
        projections = [
            exp.column(a.identifier(c), table=ref.alias).as_(a.identifier(c)) for c in needed
        ] or [exp.true().as_("__sf_row")]
        body = exp.select(*projections).from_(ref.node.copy())
        condition = a.and_all(pushed)
        if condition is not None:
            body = body.where(condition)
        temp = self.materialize(body, env)
        ref.node.replace(_temp_table(temp, ref.alias))

    def _gather_sources(self, query: exp.Expr, env: Env) -> None:
        """Materialize every distributed source inside ``query`` so it reads no shards."""
        for select in list(query.find_all(exp.Select)):
            for ref in a.sources(select):
                if isinstance(ref.node, exp.Table) and self._reads_distributed(ref.node, env):
                    self._materialize_source(select, ref, env)

    def _source_columns(self, ref: a.SourceRef, env: Env) -> list[str]:
        node = ref.node
        if isinstance(node, exp.Table) and isinstance(node.this, exp.Identifier):
            spec = self.catalog.find_table(node.name)
            if spec is not None and node.name not in env.ctes:
                return [f.name for f in spec.schema]
            if node.name in env.ctes:
                return [p.alias_or_name for p in env.ctes[node.name][1].this.selects]
        if isinstance(node, exp.Subquery):
            return [p.alias_or_name for p in node.this.selects]
        return []

    def _attach_ctes(self, query: exp.Expr, env: Env) -> None:
        """Give a query cut out of a larger one the CTE definitions it refers to."""
        needed: list[exp.CTE] = []
        pending = a.table_names(query)
        seen: set[str] = set()
        while pending:
            name = pending.pop()
            if name in seen or name not in env.ctes:
                continue
            seen.add(name)
            cte = env.ctes[name][1]
            needed.append(cte)
            pending |= a.table_names(cte.this)
        if not needed or not isinstance(query, exp.Select | exp.SetOperation):
            return
        order = {id(cte): i for i, (_, cte) in enumerate(env.ctes.values())}
        needed.sort(key=lambda cte: order[id(cte)])
        own = query.args.get("with_")
        own_ctes = list(own.expressions) if own is not None else []
        own_names = {c.alias_or_name for c in own_ctes}
        ctes = [c.copy() for c in needed if c.alias_or_name not in own_names] + own_ctes
        query.set("with_", exp.With(expressions=ctes))

    # -- catalog questions ---------------------------------------------------------------
    def _replicated_sources(self, select: exp.Select, env: Env) -> set[str]:
        """Aliases of the sources of ``select`` that are replicated catalog tables."""
        aliases = set()
        for ref in a.sources(select):
            node = ref.node
            if isinstance(node, exp.Table) and isinstance(node.this, exp.Identifier):
                spec = self.catalog.find_table(node.name)
                if spec is not None and not spec.distributed and node.name not in env.ctes:
                    aliases.add(ref.alias)
        return aliases

    def _reads_distributed(self, table: exp.Table, env: Env) -> bool:
        if not isinstance(table.this, exp.Identifier) or table.name in env.temps:
            return False
        if table.name in env.ctes:
            return env.ctes[table.name][0].kind != "replicated"
        spec = self.catalog.find_table(table.name)
        return spec is not None and spec.distributed

    def _distributed_tables(self, query: exp.Expr, env: Env) -> tuple[str, ...]:
        """The catalog names of the distributed tables ``query`` reads."""
        specs = [self.catalog.find_table(n) for n in a.table_names(query) - env.temps]
        return tuple(sorted({s.name for s in specs if s is not None and s.distributed}))

    def _inputs(self, query: exp.Expr, env: Env) -> tuple[str, ...]:
        return tuple(sorted(a.table_names(query) & env.temps))

    def _reads_catalog(self, query: exp.Expr, env: Env) -> bool:
        names = a.table_names(query) - env.temps
        return any(self.catalog.find_table(n) is not None for n in names)


# -- pure helpers ----------------------------------------------------------------------------
def check_stage_groups(stages: Sequence[Stage], catalog: Catalog) -> None:
    """Every table a shard stage reads is cut like the stage's group: a worker binds each
    table's units by the group's unit ids. A plan that breaks this is the planner's fault,
    and :class:`QueryError` sends the query to the as-written plan instead of retrying a
    binding that can never succeed."""
    for stage in stages:
        for name in stage.tables:
            spec = catalog.find_table(name)
            if spec is not None and spec.group != stage.group:
                raise QueryError(
                    f"internal: stage {stage.output or 'result'} reads {name} with the units "
                    "of another table's group"
                )


def _temp_table(temp: str, alias: str) -> exp.Table:
    return exp.Table(
        this=exp.to_identifier(temp), alias=exp.TableAlias(this=exp.to_identifier(alias))
    )


def _rename_table_refs(query: exp.Expr, name: str, temp: str) -> None:
    for table in list(query.find_all(exp.Table)):
        if isinstance(table.this, exp.Identifier) and table.name == name:
            alias = table.alias or name
            table.replace(_temp_table(temp, alias))


def _drop_unused_ctes(query: exp.Expr) -> None:
    with_ = query.args.get("with_")
    while with_ is not None:
        used: set[str] = set()
        for table in query.find_all(exp.Table):
            definition = table.find_ancestor(exp.CTE)
            if definition is None or definition.parent is not with_:
                used.add(table.name)
            elif definition.alias_or_name != table.name:
                used.add(table.name)
        unused = [c for c in with_.expressions if c.alias_or_name not in used]
        if not unused:
            return
        for cte in unused:
            cte.pop()
        if not with_.expressions:
            query.set("with_", None)
            return


def _equivalences(select: exp.Select, srcs: list[_Source]) -> a.UnionFind:
    """Union-find of columns made equal on every output row by the block's conditions."""
    uf = a.UnionFind()
    for left, right in a.equalities(select.args.get("where")):
        uf.union(left, right)
    for source in srcs:
        join = source.ref.join
        if join is None or not join.args.get("on"):
            continue
        for left, right in a.equalities(join.args["on"]):
            if source.ref.side in ("", "INNER") or source.ref.alias in (left[1], right[1]):
                uf.union(left, right)
    for source in srcs:  # a source's own key columns are one class
        keys = sorted(source.dist.keys)
        for key in keys[1:]:
            uf.union(
                a.source_column(select, source.ref.alias, keys[0]),
                a.source_column(select, source.ref.alias, key),
            )
    return uf


def _components(select: exp.Select, srcs: list[_Source], uf: a.UnionFind) -> dict[str, object]:
    """Partitioned sources that are co-located with each other share a component id."""
    components: dict[str, object] = {}
    for source in srcs:
        if source.dist.kind != "partitioned":
            continue
        if not source.dist.keys:
            components[source.ref.alias] = ("solo", source.ref.alias)
            continue
        key = sorted(source.dist.keys)[0]
        root = uf.find(a.source_column(select, source.ref.alias, key))
        components[source.ref.alias] = (source.dist.group, root)
    return components


def _join_violations(srcs: list[_Source], components: dict[str, object]) -> list[_Source]:
    """Sources that outer joins keep from running per shard (a replicated preserved side
    joined to a distributed null-supplying side would be padded once per shard)."""
    violations: list[_Source] = []
    seen: list[_Source] = []
    for source in srcs:
        left = {components[s.ref.alias] for s in seen if s.ref.alias in components}
        mine = components.get(source.ref.alias)
        if source.ref.join is not None:
            if source.ref.outer_right:
                if mine is not None and mine not in left:
                    violations.append(source)
            elif source.ref.side == "RIGHT":
                if left and left != {mine}:
                    violations += [s for s in seen if s.ref.alias in components]
            elif source.ref.side == "FULL" and (left or mine is not None) and left != {mine}:
                violations += [s for s in [*seen, source] if s.ref.alias in components]
        seen.append(source)
    unique: dict[str, _Source] = {}
    for source in violations:
        unique[source.ref.alias] = source
    return list(unique.values())


def _key_class(select: exp.Select, partitioned: list[_Source], uf: a.UnionFind) -> set[a.ColumnId]:
    if not partitioned:
        return set()
    own = {
        a.source_column(select, source.ref.alias, key)
        for source in partitioned
        for key in source.dist.keys
    }
    roots = {uf.find(column) for column in own}
    members = {item for item in uf.items() if isinstance(item, tuple) and uf.find(item) in roots}
    return {m for m in members if len(m) == 3} | own


def _nonlocal_reason(select: exp.Select, key_ids: set[a.ColumnId]) -> str:
    """Why a shard-local FROM clause does not make the whole block local ("" if it does)."""

    def on_key(node: exp.Expr) -> bool:
        node = node.unalias() if isinstance(node, exp.Alias) else node
        return isinstance(node, exp.Column) and a.column_id(node) in key_ids

    group = select.args.get("group")
    if group is not None:
        if group.args.get("rollup") or group.args.get("cube") or group.args.get("grouping_sets"):
            return "aggregate"
        if not any(on_key(g) for g in group.expressions):
            return "aggregate"
    elif a.block_has_aggregates(select):
        return "aggregate"
    distinct = select.args.get("distinct")
    if distinct is not None:  # after any grouping: a key in the groups may not be in the rows
        on = distinct.args.get("on")
        keys = on.expressions if isinstance(on, exp.Tuple) else [on] if on else select.expressions
        if not any(on_key(k) for k in keys):
            return "aggregate"
    for window in a.block_windows(select):
        if not any(on_key(p) for p in window.args.get("partition_by") or []):
            return "window"
    if select.args.get("limit") or select.args.get("offset"):
        return "limit"
    return ""


def _is_local_in_filter(select: exp.Select, nested: exp.Expr, dist: Dist, frame: Frame) -> bool:
    """``key IN (subquery returning the key)`` as a filter conjunct is shard-local."""
    holder = nested.parent
    while isinstance(holder, exp.Subquery):
        holder = holder.parent
    if not isinstance(holder, exp.In) or not dist.keys:
        return False
    where = select.args.get("where")
    filters = a.conjuncts(where) + [
        c
        for j in select.args.get("joins") or []
        if not j.side
        for c in a.conjuncts(j.args.get("on"))
    ]
    if not any(part is holder for part in filters):
        return False
    probe = holder.this
    selects = nested.selects if isinstance(nested, exp.Select) else []
    return (
        isinstance(probe, exp.Column)
        and a.column_id(probe) in frame.key_ids
        and len(selects) == 1
        and selects[0].alias_or_name in dist.keys
    )


def _pushable_conjuncts(select: exp.Select, ref: a.SourceRef) -> list[exp.Expr]:
    """Take from ``select`` the conditions that only read ``ref`` and may filter it early."""
    sides = {s.side for s in a.sources(select)}

    def only_this_source(part: exp.Expr) -> bool:
        if any(isinstance(n, a.QUERY_NODES) for n in part.walk()):
            return False
        if any(a.is_aggregate(n) or isinstance(n, exp.Window) for n in part.walk()):
            return False
        columns = list(part.find_all(exp.Column))
        return bool(columns) and all(c.table == ref.alias for c in columns)

    pushed: list[exp.Expr] = []
    if not ref.outer_right and not sides & {"RIGHT", "FULL"}:
        where = select.args.get("where")
        parts = a.conjuncts(where)
        keep = [p for p in parts if not only_this_source(p)]
        pushed += [p for p in parts if only_this_source(p)]
        if len(keep) != len(parts):
            condition = a.and_all(keep)
            select.set("where", exp.Where(this=condition) if condition is not None else None)
    join = ref.join
    if join is not None and join.args.get("on") and ref.side in ("", "INNER", "LEFT"):
        parts = a.conjuncts(join.args["on"])
        keep = [p for p in parts if not only_this_source(p)]
        pushed += [p for p in parts if only_this_source(p)]
        if len(keep) != len(parts):
            join.set("on", a.and_all(keep) or exp.true())
    return pushed


def _needed_columns(select: exp.Select, ref: a.SourceRef, available: Iterable[str]) -> list[str]:
    available = list(available)
    inside = {id(n) for n in ref.node.walk()}
    wanted = {
        column.name
        for column in select.find_all(exp.Column)
        if column.table == ref.alias and id(column) not in inside
    }
    return [c for c in available if c in wanted]
