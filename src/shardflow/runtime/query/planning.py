"""From SQL text to an answer, the same way for every runner: plan the query, bind it in
DuckDB for its output names and types, and where the planner cannot take apart a query
that DuckDB answers, run it as written over the tables it names, gathered whole.

The session uses this over Ray workers; the in-process cluster of the tests and the
conformance gate use it over in-process shards, so both take the same fallbacks.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, TypeVar

import duckdb
import pyarrow as pa

from shardflow.catalog import Catalog, TableSpec
from shardflow.engine import DuckDBEngine, query_error
from shardflow.engine.duckdb_engine import as_schema
from shardflow.errors import (
    NotDistributable,
    QueryError,
    SqlSyntaxError,
    StageRefused,
    UnknownColumnError,
    UnknownTableError,
    UnreadableSql,
    UnsupportedError,
)
from shardflow.runtime.query.executor import ExecutionReport, Runner, execute
from shardflow.sql import DistributedPlan, gather_plan, plan
from shardflow.sql.parse import is_select, refuse_file_functions, refuse_row_ids_in_text
from shardflow.sql.shapes import PlanTemplate, make_template, shape_of

__all__ = ["Binder", "PlanCache", "PlannedQuery", "answer", "plan_query"]

log = logging.getLogger(__name__)
K = TypeVar("K")
V = TypeVar("V")


@dataclass(frozen=True)
class PlannedQuery:
    plan: DistributedPlan
    schema: pa.Schema
    """The result schema DuckDB gives the query: the answer is returned with these names."""
    plan_seconds: float


class Binder:
    """Binds queries in DuckDB over empty tables of the catalog: type errors, unknown
    functions and the like surface here with DuckDB's own message, before any worker is
    asked, and the bound schema names and types the answer."""

    def __init__(self, engine: DuckDBEngine) -> None:
        self.engine = engine
        self._empties: tuple[Mapping[str, TableSpec], dict[str, pa.Table]] | None = None
        """The tables the empties were made of (a session's routing may gain tables within
        one catalog version), and the empties."""

    def schema(self, sql: str, catalog: Catalog) -> pa.Schema:
        empties = self._empties
        if empties is None or empties[0] is not catalog.tables:
            tables = {n: s.schema.empty_table() for n, s in catalog.tables.items()}
            empties = self._empties = (catalog.tables, tables)
        return self.schema_over(sql, empties[1])

    def schema_over(self, sql: str, tables: Mapping[str, pa.Table]) -> pa.Schema:
        """``sql`` bound (and run) over ``tables``: its answer's schema, DuckDB's errors as
        shardflow's."""
        try:
            return self.engine.run(sql, tables).schema
        except duckdb.ParserException as error:
            raise SqlSyntaxError(str(error).strip()) from None
        except duckdb.BinderException as error:
            message = str(error).strip()
            if "not found" in message and "olumn" in message:
                raise UnknownColumnError(message) from None
            mapped = query_error(error)
            if isinstance(mapped, UnsupportedError):
                raise mapped from None
            raise QueryError(message) from None
        except duckdb.CatalogException as error:
            message = str(error).strip()
            if "Table with name" in message:
                raise UnknownTableError(message) from None
            raise QueryError(message) from None
        except duckdb.Error as error:
            raise QueryError(str(error).strip()) from None


@dataclass(frozen=True)
class _Shaped:
    template: PlanTemplate
    schema: pa.Schema


_UNSHAPED: Literal["unshaped"] = "unshaped"
"""A shape whose plan depends on its constants: its queries are kept by exact text."""


def plan_basis(catalog: Catalog) -> tuple[object, ...]:
    """What a plan depends on in the catalog: its tables (names, schemas, kinds, groups,
    sizes), the bucket count, and which groups have all their units on one node (their
    queries run whole there). Not which node owns which unit: a plan names no node, units
    are bound where it runs, so a move, split or merge leaves every plan standing (the
    first query after a move is not planned again)."""
    whole = sorted(
        group_id
        for group_id, group in catalog.groups.items()
        if len({unit.node for unit in group.units}) == 1
    )
    tables = tuple(sorted(catalog.tables.items()))
    return (catalog.n_buckets, tables, tuple(whole))


class PlanCache:
    """Plans kept per :func:`plan_basis` of the catalog: by shape
    (:mod:`shardflow.sql.shapes`), so a query that differs from an earlier one only in the
    constants it compares with is bound to that one's plan without being parsed, planned
    or bound in DuckDB again; and by exact text for the rest. Each map keeps at most
    ``size`` entries (least recently used go)."""

    def __init__(self, binder: Binder, size: int) -> None:
        self.binder = binder
        self.size = size
        self._lock = threading.Lock()
        self._exact: OrderedDict[tuple[str, int], PlannedQuery] = OrderedDict()
        self._shapes: OrderedDict[tuple[object, int], _Shaped | str] = OrderedDict()
        self._basis: tuple[tuple[int, int], int] = ((-1, -1), -1)
        """The last catalog seen (its version, and how many tables it routes: a session's
        routing gains tables within a version) and the number of its plan basis."""
        self._bases: OrderedDict[tuple[object, ...], int] = OrderedDict()
        self._numbered = itertools.count()

    def _basis_of(self, catalog: Catalog) -> int:
        """The number of ``catalog``'s :func:`plan_basis`: the same for every version with
        the same basis (worked out once per version, not per query)."""
        seen, number = self._basis
        if seen == (catalog.version, len(catalog.tables)):
            return number
        basis = plan_basis(catalog)
        with self._lock:
            if basis not in self._bases:
                self._bases[basis] = next(self._numbered)
            self._bases.move_to_end(basis)
            number = self._bases[basis]
            while len(self._bases) > self.size:  # a forgotten basis is numbered anew
                self._bases.popitem(last=False)
            self._basis = ((catalog.version, len(catalog.tables)), number)
        return number

    def plan(self, sql: str, catalog: Catalog) -> PlannedQuery:
        """``sql``'s plan against ``catalog``, from the cache when it can be."""
        started = time.perf_counter()
        shape = shape_of(sql) if isinstance(sql, str) else None
        if shape is None or not shape.values:
            return self._planned(sql, catalog)
        key = (shape.key, self._basis_of(catalog))
        entry = self._get(self._shapes, key)
        if isinstance(entry, _Shaped):
            bound = entry.template.bind(shape, sql, catalog)
            return PlannedQuery(bound, entry.schema, time.perf_counter() - started)
        planned = self._planned(sql, catalog)
        if entry is None:
            template = make_template(shape, sql, planned.plan, catalog)
            if template is None:
                log.debug("plans of this query's shape depend on its constants: %s", sql)
            shaped = _Shaped(template, planned.schema) if template else _UNSHAPED
            self._put(self._shapes, key, shaped)
        return planned

    def replace(self, sql: str, catalog: Catalog, planned: PlannedQuery) -> None:
        """Keep ``planned`` for ``sql`` (a plan that replaced the planner's, see
        :func:`answer`); the queries of its shape are planned one by one from now on."""
        shape = shape_of(sql) if isinstance(sql, str) else None
        if shape is not None and shape.values:
            self._put(self._shapes, (shape.key, self._basis_of(catalog)), _UNSHAPED)
        self._put(self._exact, (sql, self._basis_of(catalog)), planned)

    def _planned(self, sql: str, catalog: Catalog) -> PlannedQuery:
        key = (sql, self._basis_of(catalog))
        cached = self._get(self._exact, key)
        if cached is not None:
            return cached
        planned = plan_query(sql, catalog, self.binder)
        self._put(self._exact, key, planned)
        return planned

    def _get(self, entries: OrderedDict[K, V], key: K) -> V | None:
        with self._lock:
            found = entries.get(key)
            if found is not None:
                entries.move_to_end(key)
            return found

    def _put(self, entries: OrderedDict[K, V], key: K, value: V) -> None:
        with self._lock:
            entries[key] = value
            entries.move_to_end(key)
            while len(entries) > self.size:
                entries.popitem(last=False)


def plan_query(sql: str, catalog: Catalog, binder: Binder) -> PlannedQuery:
    """The distributed plan of ``sql`` and its bound schema. A query the planner cannot
    read or take apart, but DuckDB binds, gets :func:`gather_plan`'s plan instead; the
    planner's own refusals (:class:`UnsupportedError` and the like) stand."""
    started = time.perf_counter()
    try:
        distributed = plan(sql, catalog)
        schema = binder.schema(sql, catalog)
    except UnreadableSql:
        if not is_select(sql):
            raise
        distributed, schema = _gather_if_bound(sql, catalog, binder, None)
    except (SqlSyntaxError, UnknownTableError):
        raise
    except UnsupportedError as error:
        if not isinstance(error, NotDistributable):
            raise
        distributed, schema = _gather_if_bound(sql, catalog, binder, error)
    except QueryError as error:
        distributed, schema = _gather_if_bound(sql, catalog, binder, error)
    return PlannedQuery(distributed, schema, time.perf_counter() - started)


def _gather_if_bound(
    sql: str, catalog: Catalog, binder: Binder, error: QueryError | None
) -> tuple[DistributedPlan, pa.Schema]:
    """:func:`gather_plan`'s plan for a query the planner could not distribute (``error``
    says why; None: shardflow's SQL parser cannot read it), if DuckDB binds it; else the
    planner's ``error`` stands, or DuckDB's own where there is none."""
    refuse_row_ids_in_text(sql, catalog)
    refuse_file_functions(sql)
    try:
        schema = binder.schema(sql, catalog)
    except UnsupportedError:
        raise
    except QueryError:
        if error is None:
            raise
        raise error from None
    why = f"could not distribute it ({error})" if error else "cannot read it"
    log.info("query gathered whole: the planner %s", why)
    return gather_plan(sql, catalog, f"the planner {why}"), schema


def answer(
    sql: str, planned: PlannedQuery, catalog: Catalog, runner: Runner, engine: DuckDBEngine
) -> tuple[pa.Table, ExecutionReport, PlannedQuery]:
    """Run ``planned`` and name and type its answer by the bound schema. If DuckDB refuses
    the SQL of a stage the planner wrote (it bound the query, so the fault is the
    planner's), the query runs as written over gathered tables; the plan that answered is
    returned so the caller can keep it."""
    try:
        result, report = execute(planned.plan, runner, engine)
    except StageRefused as error:
        if _gathers_whole(planned.plan):
            raise QueryError(str(error)) from None
        log.warning("query gathered whole: a distributed stage failed: %s", error)
        reason = f"a distributed stage failed ({error})"
        planned = dataclasses.replace(planned, plan=gather_plan(sql, catalog, reason))
        try:
            result, report = execute(planned.plan, runner, engine)
        except StageRefused as refused:
            raise QueryError(str(refused)) from None
    return as_schema(result, planned.schema), report, planned


def _gathers_whole(plan: DistributedPlan) -> bool:
    """Whether ``plan`` is :func:`gather_plan`'s: the last stage runs the query as written."""
    return plan.result.sql == plan.sql and plan.result.placement == "client"
